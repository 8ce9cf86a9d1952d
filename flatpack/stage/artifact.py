"""A stage artifact's files (``stage.py``, ``weights.safetensors``, ``manifest.json``): their
names, serializing them, verifying and loading them.

Loading never unpickles: the source is flatpack's own generated Python, the weights are
safetensors, the manifest is JSON. A stage is verified against the artifact's index
(:mod:`flatpack.stage.integrity`: sizes, sha256, the weights' safetensors framing) before its
source is executed; the manifest's own hashes are a second, internal consistency check only,
since whoever can rewrite a file can rewrite the manifest beside it.
"""

from __future__ import annotations

import dataclasses
import os
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from flatpack.errors import ArtifactError
from flatpack.stage import wire
from flatpack.stage.integrity import check_safetensors, read_verified, sha256_hex
from flatpack.stage.manifest import FileHash, Manifest

SOURCE_FILE = "stage.py"
WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"


def stage_dirname(index: int) -> str:
    """The name of stage ``index``'s directory in an artifact (``stage_007``), defined once for
    every layer that lays out or looks up a stage's files (the compiler, the images, the store
    keys, the worker, the gpu-container ranks); a run's per-stage parameters file takes the
    same name."""
    return f"stage_{index:03d}"


@dataclass
class StageArtifact:
    """A stage held in memory; :func:`serialize` writes it, :func:`parse_stage` reads it."""

    index: int
    source: str
    tensors: dict[str, torch.Tensor]  # canonical parameter name -> tensor
    manifest: Manifest


def serialize(artifact: StageArtifact) -> dict[str, bytes]:
    """The stage's files as bytes; the manifest gets the other files' hashes."""
    tensors = {name: tensor.detach().contiguous().clone() for name, tensor in artifact.tensors.items()}
    weights = save_safetensors(tensors, metadata={"stage": str(artifact.index)})
    source = artifact.source.encode()
    manifest = dataclasses.replace(artifact.manifest, files={
        SOURCE_FILE: FileHash(sha256_hex(source), len(source)),
        WEIGHTS_FILE: FileHash(sha256_hex(weights), len(weights)),
    })
    return {SOURCE_FILE: source, WEIGHTS_FILE: weights, MANIFEST_FILE: manifest.dumps()}


def read_stage(directory: str | os.PathLike, *, digest: str | None = None,
               verify_key: str | os.PathLike | None = None) -> StageArtifact:
    """Reads and verifies one stage directory of a saved artifact (``out/stage_NNN``): the
    artifact's index (``out/flatpack.index.json``) against ``digest`` or the signature under
    ``verify_key`` when given, then this stage's files against the index. Raises
    ArtifactError naming what is wrong; nothing is executed."""
    directory = Path(directory)
    if not (directory / MANIFEST_FILE).is_file():
        raise ArtifactError(f"{directory} has no {MANIFEST_FILE}: it is not a flatpack stage directory "
                            "(compile one with `flatpack compile` or Compiled.save)")
    verified = read_verified(directory.parent, digest=digest, verify_key=verify_key, under=directory.name)
    prefix = f"{directory.name}/"
    contents = {name[len(prefix):]: data for name, data in verified.files.items() if name.startswith(prefix)}
    return parse_stage(contents, str(directory))


def parse_stage(contents: dict[str, bytes], where: str) -> StageArtifact:
    """Verifies and parses a stage's files given as bytes (from a directory or a store);
    ``where`` names their origin in errors."""
    if MANIFEST_FILE not in contents:
        raise ArtifactError(f"{where} has no {MANIFEST_FILE}: it is not a flatpack stage")
    manifest = Manifest.parse(contents[MANIFEST_FILE], f"{where}/{MANIFEST_FILE}")
    for name in (SOURCE_FILE, WEIGHTS_FILE):
        path = f"{where}/{name}"
        if name not in contents:
            raise ArtifactError(f"{path} is missing; the stage is incomplete, recompile it")
        recorded = manifest.files.get(name)
        expected = recorded.sha256 if recorded else None
        actual = sha256_hex(contents[name])
        if actual != expected:
            raise ArtifactError(f"{path} has sha256 {actual[:16]}… but the manifest records "
                                f"{str(expected)[:16]}…: the file was modified or corrupted. "
                                "Recompile the model, or restore the file from the original output.")
    # the framing is checked before safetensors parses it (header size, tensor bounds)
    check_safetensors(contents[WEIGHTS_FILE], f"{where}/{WEIGHTS_FILE}")
    try:
        tensors = load_safetensors(contents[WEIGHTS_FILE])
    except (SafetensorError, KeyError, TypeError, ValueError, RuntimeError) as err:
        # the framing check mirrors the parser's; this names the file should the two ever disagree
        raise ArtifactError(f"{where}/{WEIGHTS_FILE} passed the framing check but safetensors refused it "
                            f"({type(err).__name__}: {err}); recompile the model") from None
    try:
        source = contents[SOURCE_FILE].decode("utf-8")
    except UnicodeDecodeError as err:
        raise ArtifactError(f"{where}/{SOURCE_FILE} is not UTF-8 text (byte {err.start}); the stage code flatpack "
                            "writes always is: recompile the model") from None
    missing = {entry.name for entry in manifest.parameters} - tensors.keys()
    if missing:
        raise ArtifactError(f"{where}/{WEIGHTS_FILE} lacks {sorted(missing)[:3]}; recompile the model")
    return StageArtifact(manifest.stage, source, tensors, manifest)


def build_module(artifact: StageArtifact, filename: str = "<flatpack stage>") -> nn.Module:
    """Executes the stage source and installs its weights: an ``nn.Module`` ready to run;
    ``module.flatpack_manifest`` is its :class:`~flatpack.stage.manifest.Manifest`."""
    namespace = types.ModuleType(f"flatpack_stage_{artifact.index}")
    namespace.__file__ = filename
    exec(compile(artifact.source, filename, "exec"), namespace.__dict__)  # noqa: S102 - our own generated code
    module = namespace.Stage()
    for entry in artifact.manifest.parameters:
        tensor = artifact.tensors[entry.name]
        if entry.kind in ("parameter", "frozen"):
            module.register_parameter(entry.attr, nn.Parameter(tensor.clone(), requires_grad=entry.trainable))
        else:
            module.register_buffer(entry.attr, tensor.clone())
    module.flatpack_manifest = artifact.manifest
    # a stage starts in the mode its model was compiled in; .train()/.eval() switch it
    # (emitted code reads self.training wherever the model's ops depend on the mode)
    module.train(artifact.manifest.training)
    return module


def stage_manifest(module: nn.Module) -> Manifest:
    """The manifest of a stage module :func:`build_module` made."""
    manifest = getattr(module, "flatpack_manifest", None)
    if not isinstance(manifest, Manifest):
        raise TypeError(f"{type(module).__name__} is not a flatpack stage module (build_module makes those)")
    return manifest


def stage_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, nn.Parameter]]:
    """A stage module's parameters and buffers by their original names, and the trainable
    parameters among them (the optimizer's, in manifest order)."""
    attrs = stage_manifest(module).attributes()
    state = {name: getattr(module, attr) for name, attr in attrs.items()}
    trainable = {name: tensor for name, tensor in state.items()
                 if isinstance(tensor, nn.Parameter) and tensor.requires_grad}
    return state, trainable


def install_weights(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Copies a checkpoint's weights (``w/<name>`` entries) into a stage's parameters and buffers."""
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(tensors[f"w/{name}"])


def load_weights(module: nn.Module, checkpoint: bytes) -> None:
    """Installs a stage checkpoint's weights in ``module`` (inference serves trained weights)."""
    install_weights(stage_tensors(module)[0], wire.loads(checkpoint)[0])


def load_stage(path: str | os.PathLike, *, digest: str | None = None,
               verify_key: str | os.PathLike | None = None) -> nn.Module:
    """Loads one stage directory of a saved artifact as an ``nn.Module``, verified first
    (see :func:`read_stage`).

    Works in a fresh interpreter with only torch and flatpack: the user's model code is
    never imported. ``module.flatpack_manifest`` describes its inputs, outputs and weights.
    """
    path = Path(path)
    return build_module(read_stage(path, digest=digest, verify_key=verify_key), str(path / SOURCE_FILE))
