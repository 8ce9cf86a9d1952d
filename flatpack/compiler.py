"""``flatpack.compile``: trace → LayerGraph → passes → plan → stage artifacts.

The ``Compiled`` result runs in-process (``as_module``), saves to a directory and loads back
(``flatpack.load``) without the user's model code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from flatpack.analysis.refit import COMPILED_DIR, EVENTS_FILE, Replan, refit, replan
from flatpack.atomic import write_atomic
from flatpack.codegen.emit import emit_stages
from flatpack.compiled_info import COMPILED_KIND, CompiledInfo
from flatpack.errors import ArtifactError, InputError, PlanError
from flatpack.ir import meta, structure
from flatpack.ir.graph import LayerGraph
from flatpack.ir.passes import Pass, pass_spec, resolve, run_pipeline
from flatpack.ir.profile import ChainProfile
from flatpack.ir.trace import ModeWarning, Signature, flatten_inputs, trace
from flatpack.partitioner.cost import gillis
from flatpack.partitioner.cost.funcpipe import check_layers_fit
from flatpack.partitioner.objective import with_micro_batches
from flatpack.partitioner.options import ProblemOptions
from flatpack.partitioner.plan import Plan, Provenance
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers import Solver, get_solver
from flatpack.partitioner.space import SearchSpace
from flatpack.partitioner.workload import Workload
from flatpack.stage.artifact import stage_dirname
from flatpack.platform.calibration import Calibration
from flatpack.platform.catalog import platform_names
from flatpack.profiler import ProfileOptions, attach, graph_hash, profile_graph
from flatpack.runtime import timeline
from flatpack.runtime.precision import crossed
from flatpack.runtime.request_tensors import InputContract
from flatpack.runtime.timeline import Event
from flatpack.stage.artifact import StageArtifact, build_module, parse_stage, serialize, stage_manifest
from flatpack import safeio
from flatpack.safeio import expect_mapping, load_json
from flatpack.stage.integrity import (INDEX_FILE, KEY_FINGERPRINT, SIGNATURE_FILE, Index, check_subject_name,
                                      check_subject_version, read_verified, sign_index)
from flatpack.stage.integrity import Signature as ArtifactSignature
from flatpack.stage.tensor_check import TensorSpec, check_tensor
from flatpack.version import __version__

COMPILED_FILE = "flatpack.json"
# flatpack.json holds the chain's JSON and its profile: a few MiB for the largest zoo model
MAX_COMPILED_BYTES = 256 * safeio.MiB


class Compiled:
    """A compiled model: the layer chain, the plan and one artifact per stage.

    ``graph`` is the LayerGraph when compiled in this process and None after
    ``flatpack.load`` (the saved directory keeps its JSON summary in ``chain``). ``info`` is
    what ``flatpack.json`` records besides the plan (:class:`~flatpack.compiled_info.CompiledInfo`).
    """

    def __init__(self, *, graph: LayerGraph | None, plan: Plan, artifacts: list[StageArtifact],
                 info: CompiledInfo, problem: Problem | None = None, trust: str = "compiled here") -> None:
        self.graph = graph
        self.plan = plan
        self.artifacts = artifacts
        self.info = info
        self.problem = problem
        # what vouched for the artifact: "compiled here", or load()'s "digest", "signature" or
        # "directory" (only the index in the directory itself: pin the digest to do better)
        self.trust = trust
        # load(verify_key=...)'s verified signature: the artifact's signed name, version and time
        self.signature: ArtifactSignature | None = None
        self._index: Index | None = None

    @property
    def profile(self) -> ChainProfile | None:
        """The per-layer profile when compiled with ``profile=...`` (kept across save/load)."""
        return self.info.profile

    # what it is -----------------------------------------------------------------------------
    @property
    def target(self) -> str:
        return self.info.target

    @property
    def frontend(self) -> str:
        return self.info.frontend

    @property
    def chain(self) -> dict[str, Any]:
        return self.info.chain

    def __repr__(self) -> str:
        return (f"Compiled(target={self.target!r}, frontend={self.frontend!r}, "
                f"layers={self.plan.num_layers}, stages={self.plan.ranges})")

    # running ----------------------------------------------------------------------------
    def stage_modules(self) -> list[nn.Module]:
        """Fresh ``nn.Module`` per stage, built from the generated source and weights."""
        return [build_module(artifact, f"<flatpack {stage_dirname(artifact.index)}>") for artifact in self.artifacts]

    def input_leaves(self, inputs: Any, kwargs: dict | None = None) -> list[Any]:
        """The model's flat inputs for a call like ``model(inputs)`` (a tensor, a tuple of
        positional inputs or a dict of keyword inputs), in the graph's placeholder order:
        what the stages' data inputs are named by (``info.input_names``)."""

        args, keywords = _as_call(inputs, kwargs)
        return flatten_inputs(self.info.signature, args, keywords)[0]

    def as_module(self) -> StagedModule:
        """The stages chained in-process: call it like the original model, forward and backward."""
        return StagedModule(self.stage_modules(), self.info)

    def request_contract(self) -> InputContract:
        """The predict requests a serving master accepts for this artifact: its inputs' specs,
        and the fewest samples its plan's batch splits need (each partition one). Both serving
        masters check requests against it: ``flatpack serve`` (``serve.pool``) and the Lambda
        endpoint's (``aws_lambda.serve_config`` writes it into its configuration)."""
        return InputContract.of(self.info.input_names, self.info.input_specs,
                                gillis.ForkJoinPlan.from_plan(self.plan).min_request_samples)

    # storing ----------------------------------------------------------------------------
    def files(self) -> dict[str, bytes]:
        """Every file of the artifact by relative path, except the index that covers them."""
        files = {COMPILED_FILE: self.info.dumps(self.plan.to_json()),
                 "plan.json": (self.plan.dumps() + "\n").encode()}
        for artifact in self.artifacts:
            for name, data in serialize(artifact).items():
                files[f"{stage_dirname(artifact.index)}/{name}"] = data
        return files

    @property
    def index(self) -> Index:
        """The artifact's index (``flatpack.index.json``): every file's size and sha256."""
        if self._index is None:
            self._index = Index.build(self.files())
        return self._index

    @property
    def digest(self) -> str:
        """The sha256 of the artifact's index: pin it (``load(dir, digest=...)``,
        ``deploy(..., digest=...)``) and no file of the artifact can change unnoticed."""
        return self.index.digest

    def save(self, directory: str | os.PathLike, *, private: bool = True) -> Path:
        """Writes ``flatpack.json``, ``plan.json``, one ``stage_NNN/`` per stage and
        ``flatpack.index.json`` (every file's size and sha256; its own sha256 is
        ``self.digest``), atomically.

        The files are written into a new directory with an unpredictable name beside the
        target (``tempfile.mkdtemp``: created exclusively, mode 0700, so nothing another user
        planted or raced into the parent is written through) and renamed into place.
        ``private`` (the default): the artifact is readable by its owner only (files 0600,
        directories 0700); ``private=False``: by everyone (0644 and 0755), for an artifact
        other users or services deploy. Refuses a directory that exists, is not empty and was
        not written by flatpack; a previous flatpack output there is replaced whole.
        """
        target = Path(directory)
        check_out_dir(target)
        files = self.files()
        self._index = Index.build(files)
        files[INDEX_FILE] = self._index.raw
        file_mode, dir_mode = (0o600, 0o700) if private else (0o644, 0o755)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.flatpack-tmp-"))
        try:
            for relative, data in files.items():
                path = staging / relative
                for parent in reversed(path.relative_to(staging).parents[:-1]):
                    if not (staging / parent).is_dir():
                        (staging / parent).mkdir()
                        os.chmod(staging / parent, dir_mode)   # not mkdir's mode: the umask would narrow it
                # O_EXCL: the staging directory is ours and new, so every file in it is created here
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, file_mode)
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
                os.chmod(path, file_mode)   # the umask may have taken bits private=False asks for
            os.chmod(staging, dir_mode)
            _replace_dir(staging, target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return target


def _replace_dir(staging: Path, target: Path) -> None:
    if not target.exists():
        staging.rename(target)
        return
    # the old output moves into a fresh private directory (no predictable name to pre-plant), then goes
    retired = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.flatpack-old-"))
    target.rename(retired / "old")
    staging.rename(target)
    shutil.rmtree(retired, ignore_errors=True)


def check_out_dir(directory: Path) -> None:
    """Raises unless ``directory`` is absent, empty, or a previous flatpack output."""
    if not directory.exists():
        if not directory.parent.exists():
            raise ArtifactError(f"cannot write {directory}: its parent directory does not exist")
        return
    if not directory.is_dir():
        raise ArtifactError(f"{directory} exists and is a file; pass a directory path for the output")
    if not any(directory.iterdir()):
        return
    marker = directory / COMPILED_FILE
    try:
        # bounded and regular files only: a FIFO or a huge file planted there cannot hang or fill the save
        document = safeio.load_json(marker, limit=MAX_COMPILED_BYTES, what=str(marker), error=ArtifactError)
        written_by_us = isinstance(document, dict) and document.get("kind") == COMPILED_KIND
    except ArtifactError:
        written_by_us = False
    if not written_by_us:
        raise ArtifactError(f"{directory} exists, is not empty and was not written by flatpack (no "
                            f"{COMPILED_FILE}); flatpack will not overwrite it. Choose a new or empty "
                            "directory, or remove this one.")


def load(directory: str | os.PathLike, *, digest: str | None = None, verify_key: str | os.PathLike | None = None,
         name: str | None = None, min_version: int | None = None,
         trust_file: str | os.PathLike | None = None) -> Compiled:
    """Loads a directory written by ``Compiled.save``, verified before any of its code runs.

    Every file is checked against ``flatpack.index.json`` (size, sha256, no unlisted files,
    no symlinks, safetensors framing) and the output structures against the closed
    vocabulary (``ir.structure``). ``digest``: the index must have this sha256 (what
    ``compile`` printed, ``Compiled.digest``). ``verify_key``: the index must carry a valid
    signature (``flatpack sign``) under this key: an Ed25519 public key file, or
    ``env:NAME`` for HMAC with the key in that environment variable. ``name``: the signature
    must name this artifact (else any artifact the key ever signed passes: substitution);
    ``min_version``: its version must be at least this (else an older build passes:
    rollback); ``trust_file``: a file recording the highest version accepted so far per key
    and name, which refuses anything older and records newer versions (needs ``name``).
    ``compiled.signature`` says what the signature vouched for. With neither digest nor key,
    the index itself is trusted only as far as the directory is — whoever can write the
    directory can rewrite the index too; ``compiled.trust`` says ``"directory"`` and
    ``compiled.digest`` is the digest to pin. ``tests/security/test_tampering.py``,
    ``tests/security/test_signatures.py``.
    """
    check_trust_file_args(trust_file, name)
    directory = Path(directory)
    marker = directory / COMPILED_FILE
    # lstat only: no file of the artifact is opened before the index is (a FIFO here cannot hang it)
    if not marker.is_file():
        raise ArtifactError(f"{directory} has no {COMPILED_FILE}: it is not a flatpack output directory")
    verified = read_verified(directory, digest=digest, verify_key=verify_key, name=name, min_version=min_version)
    if COMPILED_FILE not in verified.files:
        raise ArtifactError(f"{marker} is not listed in {directory / INDEX_FILE}; the artifact was altered, "
                            "recompile it")
    document = safeio.parse_json(verified.files[COMPILED_FILE], what=str(marker), error=ArtifactError)
    info = CompiledInfo.parse(document, str(marker))
    if not isinstance(document.get("plan"), dict):
        raise ArtifactError(f"{marker} has no plan (an object under 'plan'); the output is corrupted, recompile")
    try:
        plan = Plan.from_json(document["plan"])
    except (PlanError, KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
        # the plan's reader raises PlanError; anything else it let through is named here, never a traceback
        raise ArtifactError(f"{marker}'s 'plan' is malformed ({type(err).__name__}: {err}); the output is "
                            "corrupted, recompile") from None
    artifacts = []
    for index in range(len(plan.stages)):
        prefix = stage_dirname(index)
        contents = {name[len(prefix) + 1:]: data for name, data in verified.files.items()
                    if name.startswith(f"{prefix}/")}
        artifacts.append(parse_stage(contents, str(directory / prefix)))
    if trust_file is not None and verified.signature is not None:
        # last: only an artifact that passed every other check moves the recorded version up
        check_trust_file(trust_file, verified.signature, str(directory))
    compiled = Compiled(graph=None, plan=plan, artifacts=artifacts, info=info, trust=verified.trust)
    compiled._index = verified.index
    compiled.signature = verified.signature
    return compiled


def sign(directory: str | os.PathLike, key: str | os.PathLike, *, name: str, version: int,
         digest: str | None = None) -> str:
    """Signs the artifact in ``directory`` as ``name`` at ``version`` (a positive integer that
    goes up with each build a verifier should prefer) after checking every file against its
    index (and the index against ``digest``, when given); writes ``flatpack.index.sig``
    atomically and returns the digest it signed. ``key``: an Ed25519 private key file (PEM),
    or ``env:NAME`` for HMAC-SHA256 with the key in that environment variable."""
    verified = read_verified(directory, digest=digest)
    # as private as the artifact it signs (a saved artifact is 0600 unless saved with private=False)
    mode = stat.S_IMODE(os.stat(Path(directory) / INDEX_FILE).st_mode)
    write_atomic(Path(directory) / SIGNATURE_FILE, sign_index(verified.index.raw, key, name=name, version=version),
                 mode=mode)
    return verified.digest


# -- the trust file: rollback protection across loads (as TUF's trusted metadata) ------------

TRUST_FILE_KIND = "flatpack-trusted-versions"
TRUST_FILE_SCHEMA = 1
# one small entry per (key, name) a host has accepted: a megabyte holds thousands
MAX_TRUST_FILE_BYTES = 1 << 20


def check_trust_file_args(trust_file: str | os.PathLike | None, name: str | None) -> None:
    """Refuses a trust file without a required name: versions are recorded per name, and
    without a name any artifact the key signed would pass anyway."""
    if trust_file is not None and name is None:
        raise InputError(f"the trust file {trust_file} records versions per artifact name: pass the name the "
                         "artifact must be signed as too (name= / --name)")


def _read_trust_file(path: Path) -> dict[str, dict[str, int]]:
    """The versions recorded in ``path`` (key fingerprint -> name -> version); empty when the
    file does not exist yet (the first load creates it)."""
    if not path.exists() and not path.is_symlink():
        return {}
    what = f"the trust file {path}"
    fix = "restore it from a backup, or pass a new path to start over (which trusts any version once)"
    document = expect_mapping(load_json(path, limit=MAX_TRUST_FILE_BYTES, what=what), what=what)
    if document.get("kind") != TRUST_FILE_KIND:
        raise InputError(f"{what}: the field kind is {str(document.get('kind'))[:60]!r}, not {TRUST_FILE_KIND!r}: "
                         f"it is not a flatpack trust file; {fix}")
    if document.get("schema_version") != TRUST_FILE_SCHEMA:
        raise InputError(f"{what}: the field schema_version is {str(document.get('schema_version'))[:20]!r}; this "
                         f"flatpack reads {TRUST_FILE_SCHEMA}. {fix[0].upper()}{fix[1:]}")
    versions = expect_mapping(document.get("versions"), what=f"{what}: the field versions")
    state: dict[str, dict[str, int]] = {}
    for key, names in versions.items():
        if not KEY_FINGERPRINT.fullmatch(key):
            raise InputError(f"{what}: the key {key[:80]!r} under versions is not a key fingerprint "
                             f"(ed25519:<64 hex> or hmac-sha256:<64 hex>); {fix}")
        field = f"{what}: the field versions[{key!r}]"
        state[key] = {check_subject_name(name, f"{field}, a name"): check_subject_version(version, f"{field}[{name!r}]")
                      for name, version in expect_mapping(names, what=field).items()}
    return state


def check_trust_file(trust_file: str | os.PathLike, signature: ArtifactSignature, where: str) -> int | None:
    """Refuses ``signature`` (of the artifact in ``where``) when ``trust_file`` records a
    higher version of its name under its key: a rollback. Records its version when it is the
    highest so far. Returns the version recorded before (None: the first of this key and name).
    A lock beside the file makes concurrent loads read and write it one at a time."""
    path = Path(trust_file)
    if signature.name is None or signature.version is None:
        raise ArtifactError(f"{where}/{SIGNATURE_FILE} is a v1 signature with no name or version, so the trust file "
                            f"{path} cannot compare it. Re-sign it with `flatpack sign DIR --key KEY --name NAME "
                            "--version N`.")
    try:
        lock = open(path.with_name(f".{path.name}.lock"), "a")  # noqa: SIM115 - held for the whole block below
    except OSError as err:
        raise InputError(f"cannot open the trust file's lock beside {path}: {err.strerror or err}; the trust file's "
                         "directory must exist and be writable") from None
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        state = _read_trust_file(path)
        known = state.get(signature.key, {}).get(signature.name)
        if known is not None and signature.version < known:
            raise ArtifactError(f"{where}/{SIGNATURE_FILE} signs {signature.name!r} version {signature.version}, but "
                                f"the trust file {path} records that version {known} was already accepted under this "
                                f"key: this is a rollback to an older build. Do not run it; deploy version {known} or "
                                f"later (to roll back on purpose, lower the entry in {path}).")
        if known is None or signature.version > known:
            state.setdefault(signature.key, {})[signature.name] = signature.version
            document = {"kind": TRUST_FILE_KIND, "schema_version": TRUST_FILE_SCHEMA, "versions": state}
            try:
                write_atomic(path, json.dumps(document, indent=2, sort_keys=True) + "\n")
            except OSError as err:
                raise InputError(f"cannot write the trust file {path}: {err.strerror or err}; the artifact was not "
                                 "loaded, since its version could not be recorded") from None
    return known


def load_run(run_dir: str | os.PathLike) -> tuple[Problem, Plan, list[Event]]:
    """The problem, plan and timeline a ``flatpack run`` left in ``run_dir`` (for
    :func:`flatpack.analysis.refit.refit`, ``compile(measured=RUN_DIR)`` and ``flatpack plan --from-run``)."""
    run_dir = Path(run_dir)
    events_path, compiled_dir = run_dir / EVENTS_FILE, run_dir / COMPILED_DIR
    for path in (events_path, compiled_dir):
        if not path.exists():
            raise InputError(f"{run_dir} is not a finished flatpack run: it has no {path.name} (flatpack run --out "
                             "DIR writes it when training ends)")
    compiled = load(compiled_dir)
    if compiled.profile is None:
        raise InputError(f"the artifact in {compiled_dir} has no profile: re-plan needs the run's per-layer profile")
    provenance = compiled.plan.provenance
    if provenance is None or provenance.workload is None:
        raise InputError(f"the plan in {compiled_dir} does not record its workload (made by an older flatpack); "
                         "run again with this flatpack")
    workload = Workload(**{key: provenance.workload[key]
                           for key in ("mode", "batch", "micro_batches", "optimizer", "sync")})
    problem = Problem.from_saved(compiled.chain, compiled.profile, compiled.target, workload)
    return problem, compiled.plan, timeline.loads(events_path.read_bytes())


def refit_run(run_dir: str | os.PathLike) -> Calibration:
    """:func:`~flatpack.analysis.refit.refit` of what ``flatpack run`` left in ``run_dir``
    (``compile(measured=...)``)."""
    problem, plan, events = load_run(run_dir)
    return refit(problem, plan, events, source=str(run_dir))


def replan_run(run_dir: str | os.PathLike, *, solver: str = "dp") -> Replan:
    """:func:`~flatpack.analysis.refit.replan` of what ``flatpack run`` left in ``run_dir``."""
    problem, plan, events = load_run(run_dir)
    return replan(problem, plan, events, solver=solver, source=str(run_dir))


class StagedModule(nn.Module):
    """The stage modules run one after another in this process.

    Calling it takes the same arguments as the original model and returns the same nested
    outputs. Parameters shared by several stages (tied weights) are one ``nn.Parameter``
    here, so their gradients sum as in the original.
    """

    def __init__(self, stages: list[nn.Module], info: CompiledInfo) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self._signature = info.signature
        self._input_structure = info.input_structure
        self._output_structure = info.output_structure
        self._input_names = info.input_names
        self._input_specs = info.input_specs
        self._output_names = info.output_names
        self._by_name: dict[str, tuple[int, str]] = {}
        self._aliases: dict[str, str] = {}
        for index, stage in enumerate(self.stages):
            for entry in stage_manifest(stage).parameters:
                name, attr = entry.name, entry.attr
                for alias in entry.aliases:
                    self._aliases[alias] = name
                if name in self._by_name:
                    first_index, first_attr = self._by_name[name]
                    shared = getattr(self.stages[first_index], first_attr)
                    if entry.kind in ("parameter", "frozen"):
                        stage.register_parameter(attr, shared)
                    else:
                        stage.register_buffer(attr, shared)
                else:
                    self._by_name[name] = (index, attr)
        # the mode the model was compiled in (the stages start in it); train()/eval() switch
        # every stage, as they would every submodule of the original
        self.training = info.training if info.training is not None else (stages[0].training if stages else True)
        self._mode_fixed = info.mode_fixed or ()
        # the precision whose wire dtype the tensors between stages are rounded to
        # (runtime.precision.crossed), as a pipelined run under that precision sends them;
        # "fp32" (the default) passes them as they are
        self.wire_precision = "fp32"

    def train(self, mode: bool = True) -> StagedModule:
        if self._mode_fixed and bool(mode) != bool(self._compiled_training):
            warnings.warn(f"switching the staged model to {'train' if mode else 'eval'} mode, but it was compiled in "
                          f"{'train' if self._compiled_training else 'eval'} mode and these parts cannot switch: "
                          f"{'; '.join(self._mode_fixed[:6])}", ModeWarning, stacklevel=2)
        return super().train(mode)

    @property
    def _compiled_training(self) -> bool:
        return stage_manifest(self.stages[0]).training if len(self.stages) else True

    def tensor(self, name: str) -> torch.Tensor:
        """The stages' tensor for an original parameter or buffer name (any alias of a tied one)."""
        canonical = self._aliases.get(name, name)
        if canonical not in self._by_name:
            raise KeyError(f"no stage holds {name!r}")
        index, attr = self._by_name[canonical]
        return getattr(self.stages[index], attr)

    def named_original_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, (index, attr) in self._by_name.items():
            yield name, getattr(self.stages[index], attr)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, given = flatten_inputs(self._signature, args, kwargs)
        if given != self._input_structure:
            raise InputError(f"the inputs are structured as {given}, but the model was compiled for "
                             f"{self._input_structure} (constants are part of the structure: they "
                             "were fixed at compile time). Call it the way the example inputs did.")
        check_inputs(self._input_specs, self._input_names, leaves)
        env = dict(zip(self._input_names, leaves))
        # a stage output as the stages that read it receive it (one rounding per value, however
        # many stages read it: the producing stage sends it once to each, all equal)
        received = dict(env)
        for stage in self.stages:
            manifest = stage_manifest(stage)
            stage_args = []
            for name in manifest.input_names:
                if name not in received:
                    received[name] = crossed(env[name], self.wire_precision)
                stage_args.append(received[name])
            outputs = stage(*stage_args)
            env.update(zip(manifest.output_names, outputs))
        return structure.rebuild(self._output_structure, lambda index: env[self._output_names[index]])


def input_specs(traced: Any) -> tuple[TensorSpec, ...]:
    """Per tensor input: the compiled example's shape and dtype, and which dimensions the graph
    leaves free (``None`` when the frontend cannot tell: fx graphs accept what their code does)."""
    dynamic = traced.dynamic_dims
    return tuple(TensorSpec.of(leaf, None if dynamic is None or index >= len(dynamic) else tuple(dynamic[index]))
                 for index, leaf in enumerate(traced.example_leaves))


def check_inputs(specs: Sequence[TensorSpec] | None, names: Sequence[str], leaves: list[Any]) -> None:
    """Refuses a call whose tensors the stages were not compiled for, before any stage runs.

    A stage traced by torch.export holds the example's size wherever export fixed it (a
    sequence length the model's position table pinned, a batch of 1); called with another
    size, it would fail deep inside generated code with an error naming no input. The error
    here names the input, the compiled shape and the fix (``tests/unit/test_trace.py``).
    """
    if not specs or len(specs) != len(leaves):
        return
    for name, spec, leaf in zip(names, specs, leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        check_tensor(name, leaf, spec,
                     fix=f"Call it with those sizes, or recompile with example inputs of the shape you will call it "
                         f"with (flatpack.compile(model, example_inputs) with '{name}' of shape {tuple(leaf.shape)}); "
                         "compile's trace_notes say why export fixed a size.")


def _as_call(example_inputs: Any, example_kwargs: dict | None) -> tuple[tuple, dict]:
    kwargs = dict(example_kwargs or {})
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), kwargs
    if isinstance(example_inputs, dict):
        return (), {**example_inputs, **kwargs}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), kwargs
    raise InputError(f"example_inputs must be a tensor, a tuple of positional inputs or a dict of "
                     f"keyword inputs, got {type(example_inputs).__name__}")


def compile(model: nn.Module, example_inputs: Any = (), *, target: str = "local",
            solver: str | Solver | None = None, stages: int | None = None,
            passes: str | Sequence[Pass | str] | None = None, out_dir: str | os.PathLike | None = None,
            example_kwargs: dict | None = None, plan: Plan | None = None,
            profile: bool | ProfileOptions = False, workload: Workload | None = None,
            calibration: Any = None, force: bool = False, measured: str | os.PathLike | None = None,
            **options: Any) -> Compiled:
    """Compiles ``model`` into pipeline stages.

    ``example_inputs``: a tensor, a tuple of positional inputs or a dict of keyword inputs
    (``example_kwargs`` adds keyword inputs to a tuple). ``passes``: a pipeline string or a
    list of pass names and pass objects (default ``"fuse-elementwise,merge-branches"``).
    ``solver``: a registered name or an object ``Problem -> Plan`` (default ``"balanced"``).
    ``stages``: how many stages ``balanced`` makes (default 2). ``plan``: a ready Plan,
    which skips the solver. ``out_dir``: also save there (see ``Compiled.save``).
    ``profile``: True or :class:`ProfileOptions` measures every layer after the passes, or
    just before ``coarsen{by=time}`` so that it balances measured seconds (cached on disk;
    see ``flatpack.profiler``), so that cost-model solvers can run. ``workload``: what
    the plan is for (train or infer, batch, micro-batches, optimizer); with a profile and a
    training workload, a layer that cannot fit the target's largest tier even alone is
    reported before solving (``flatpack.compile`` first refuses a workload the target's
    backend cannot run, ``flatpack.api``). ``calibration``: a
    :class:`~flatpack.platform.calibration.Calibration` or the path of one, measured inside
    the target, overriding the host-to-tier compute model; the plan records its digest.
    A plan solved here records its :class:`~flatpack.partitioner.plan.Provenance`; a
    ``plan`` given with one is refused (``PlanError``) when made for another graph, target,
    workload (when ``workload`` is given), calibration or flatpack version, or used with a
    warning when ``force``. ``measured``: a finished ``flatpack run`` directory whose
    timeline re-fits the per-layer and per-transfer times (``analysis.refit``) in place
    of ``calibration``; the solver then searches the tiers that run measured unless
    ``memory_mb`` says otherwise. ``options``: the cost-model solvers' search space and
    objective (:class:`~flatpack.partitioner.options.ProblemOptions`): ``memory_mb``,
    ``replicas``, ``micro_batches``, ``max_workers``, ``weights=(α₁, α₂)``, ``cost_model``...
    """
    _check_request(model, target, options, "flatpack.compile")
    if out_dir is not None:
        check_out_dir(Path(out_dir))
    if measured is not None:
        if calibration is not None:
            raise InputError("measured=RUN_DIR re-fits the model to a run, calibration=FILE gives it measurements: "
                             "give one or the other")
        calibration = refit_run(measured)
        options.setdefault("memory_mb", tuple(sorted(calibration.tiers)))
    args, kwargs = _as_call(example_inputs, example_kwargs)
    Signature.of(model).bind(args, kwargs)
    pipeline = resolve(passes)
    solver_obj = get_solver(solver) if plan is None else None
    lowered = _lower(model, args, kwargs, pipeline, target=target, stages=stages, profile=profile,
                     workload=workload, calibration=calibration, options=options)
    graph, traced, chain_profile, problem = lowered.graph, lowered.traced, lowered.profile, lowered.problem
    plan = _planned(plan, solver_obj, problem, provenance_of(graph, target, workload, problem),
                    given_workload=workload is not None, force=force)
    plan, artifacts = _emit(graph, problem, plan)
    info = _compiled_info(model, target, traced, graph, pipeline, plan, chain_profile)
    compiled = Compiled(graph=graph, plan=plan, artifacts=artifacts, info=info, problem=problem)
    if out_dir is not None:
        compiled.save(out_dir)
    return compiled


def _planned(plan: Plan | None, solver: Solver | None, problem: Problem, current: Provenance, *,
             given_workload: bool, force: bool) -> Plan:
    """The plan to emit: ``solver``'s for ``problem`` when no plan was given, recording where
    it comes from (``current``); else the given one, checked against ``current`` (refused when
    made for another graph, target, workload, calibration or version, unless ``force``)."""
    if plan is None:
        assert solver is not None  # compile resolves it (before lowering, to fail fast) whenever plan is None
        solved = solver(problem)
        if not isinstance(solved, Plan):
            raise PlanError(f"solver {getattr(solver, 'name', solver)!r} returned "
                            f"{type(solved).__name__}, not a Plan")
        return dataclasses.replace(solved, provenance=current)
    if plan.provenance is not None:
        # a workload not given here is not known, so it is not held against the plan's
        plan.provenance.check(current if given_workload else
                              dataclasses.replace(current, workload=plan.provenance.workload), force=force)
    return plan


def _compiled_info(model: nn.Module, target: str, traced: Any, graph: LayerGraph, pipeline: Sequence[Pass],
                   plan: Plan, chain_profile: ChainProfile | None) -> CompiledInfo:
    """What ``flatpack.json`` records of a compile: versions, target, how the model was
    traced and lowered, its input and output contract, the stages and the chain."""
    return CompiledInfo(
        flatpack_version=__version__,
        torch_version=torch.__version__,
        target=target,
        frontend=traced.frontend,
        trace_notes=tuple(traced.notes),
        training=traced.training,
        mode_fixed=tuple(traced.mode_fixed),
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        passes=tuple(pass_spec(p) for p in pipeline),
        signature=traced.signature,
        input_structure=traced.input_structure,
        output_structure=traced.output_structure,
        input_names=tuple(n.name for n in traced.gm.graph.nodes if n.op == "placeholder"),
        input_specs=input_specs(traced),
        output_names=tuple(graph.output_names()),
        # what ``Deployment.state_dict()`` returns: every key model.load_state_dict expects
        # (tied weights under each name, persistent buffers only)
        state_dict_keys=tuple(model.state_dict().keys()),
        stages=tuple(stage_dirname(index) for index in range(len(plan.stages))),
        chain=graph.to_json(),
        profile=chain_profile,
    )


def _emit(graph: LayerGraph, problem: Problem, plan: Plan) -> tuple[Plan, list[StageArtifact]]:
    """The stage artifacts of ``plan`` over ``graph`` (the plan checked against the chain, its
    replicated stages' splits written out): what ``compile`` and :func:`with_plan` emit."""
    plan.check_against(len(graph.layers))
    plan = gillis.with_splits(problem, plan)
    return plan, emit_stages(graph, plan)


def with_plan(compiled: Compiled, plan: Plan) -> Compiled:
    """``compiled`` cut by ``plan`` instead: the same chain, problem and settings, the stages
    emitted again for the new cuts (``flatpack run --replan`` switches a run onto it). Needs
    the chain ``compile`` traced in this process: an artifact ``flatpack.load`` read back has
    only its stages' code."""
    if compiled.graph is None or compiled.problem is None:
        raise InputError("re-cutting a compiled model needs the layer chain and problem that flatpack.compile made "
                         "in this process; an artifact read back with flatpack.load has only its stages. Compile "
                         "the model again (flatpack.compile) to train it with replan")
    provenance = plan.provenance or compiled.plan.provenance
    plan, artifacts = _emit(compiled.graph, compiled.problem, dataclasses.replace(plan, provenance=provenance))
    info = dataclasses.replace(compiled.info, stages=tuple(stage_dirname(index) for index in range(len(plan.stages))))
    return Compiled(graph=compiled.graph, plan=plan, artifacts=artifacts, info=info, problem=compiled.problem)


def workload_json(workload: Workload) -> dict[str, Any]:
    """What of a workload a plan depends on."""
    return {"mode": workload.mode, "batch": workload.batch, "micro_batches": workload.micro_batches,
            "optimizer": workload.optimizer, "sync": workload.sync}


def provenance_of(graph: LayerGraph, target: str, workload: Workload | None, problem: Problem) -> Provenance:
    """What a plan for ``graph`` on ``target`` is made for (see :class:`Provenance`)."""
    calibration = problem.calibration
    return Provenance(graph_hash(graph), target, workload_json(workload) if workload is not None else None,
                      getattr(calibration, "digest", None))


def build_problem(model: nn.Module, example_inputs: Any = (), *, target: str = "local",
                  passes: str | Sequence[Pass | str] | None = None, profile: bool | ProfileOptions = True,
                  workload: Workload | None = None, calibration: Any = None, example_kwargs: dict | None = None,
                  stages: int | None = None, **options: Any) -> Problem:
    """The :class:`Problem` that ``compile`` would hand its solver, without solving or emitting
    stages: trace, passes, profile (on by default, since cost-model solvers need it), platform
    and workload. ``options`` go to ``Problem.options`` (see
    :class:`~flatpack.partitioner.options.ProblemOptions`: the search space, ``weights``,
    ``cost_model``...). ``flatpack plan`` uses it to draw fronts."""
    _check_request(model, target, options, "flatpack.build_problem")
    args, kwargs = _as_call(example_inputs, example_kwargs)
    Signature.of(model).bind(args, kwargs)
    pipeline = resolve(passes)
    return _lower(model, args, kwargs, pipeline, target=target, stages=stages, profile=profile, workload=workload,
                  calibration=calibration, options=options).problem


def _check_request(model: Any, target: str, options: dict[str, Any], caller: str) -> None:
    if not isinstance(model, nn.Module):
        raise InputError(f"{caller} expects a torch.nn.Module, got {type(model).__name__}; "
                         "wrap the function in an nn.Module whose forward calls it")
    if target not in platform_names():
        raise InputError(f"unknown target {target!r}; flatpack targets: {', '.join(platform_names())}")
    ProblemOptions.of(options, caller)   # an unknown option is refused before anything is traced


@dataclasses.dataclass(frozen=True)
class _Lowered:
    """What compiling has before a plan exists: the traced model, the final chain, its
    profile (when asked for) and the solver's Problem."""

    traced: Any
    graph: LayerGraph
    profile: ChainProfile | None
    problem: Problem


def _lower(model: nn.Module, args: tuple, kwargs: dict, pipeline: list[Pass], *, target: str, stages: int | None,
           profile: bool | ProfileOptions, workload: Workload | None, calibration: Any,
           options: dict[str, Any]) -> _Lowered:
    """Trace → passes (with profiling when asked) → Problem; the one path ``compile`` and
    ``build_problem`` share."""
    with _restoring([*model.buffers(), *(leaf for leaf in pytree.tree_leaves((args, kwargs))
                                         if isinstance(leaf, torch.Tensor))]):
        _run_eagerly(model, args, kwargs)
        traced = trace(model, args, kwargs)
        with _restoring(list(traced.gm.buffers())):
            graph = LayerGraph.from_traced(traced)
    if not graph.layers:
        raise InputError(f"{type(model).__name__} computes nothing: its forward returns inputs, parameters "
                         "or constants only, so there is nothing to cut into stages")
    chain_profile = None
    if profile:
        options_obj = profile if isinstance(profile, ProfileOptions) else ProfileOptions()
        graph, chain_profile = _passes_with_profile(graph, pipeline, options_obj,
                                                    flatten_inputs(traced.signature, args, kwargs)[0])
    else:
        graph = run_pipeline(graph, pipeline)
    problem = Problem.from_graph(graph, stages=stages, target=target, workload=workload, profile=chain_profile,
                                 calibration=_load_calibration(calibration), **options)
    if chain_profile is not None and workload is not None and workload.mode == "train":
        _check_some_layout_fits(problem)
    return _Lowered(traced, graph, chain_profile, problem)


def _check_some_layout_fits(problem: Problem) -> None:
    """``check_layers_fit`` at each (M, d) of the search space (``space.py``): a layer is
    refused only when no allowed layout holds it, since more micro-batches shrink its
    activations and more replicas shrink µ but add sync buffers. The error reported is the
    first layout's."""
    first_error = None
    for count, degree in SearchSpace.of(problem).configurations():
        try:
            check_layers_fit(with_micro_batches(problem, count), replicas=degree)
            return
        except PlanError as err:
            first_error = first_error or err
    if first_error is not None:
        raise first_error


def _passes_with_profile(graph: LayerGraph, pipeline: list[Pass], options: ProfileOptions,
                         leaves: list[Any]) -> tuple[LayerGraph, ChainProfile]:
    """Runs the passes and profiles the chain. A pass that reads profiles (``coarsen{by=time}``,
    FuncPipe §4's merge by computation time) gets the chain profiled just before it; merged
    layers carry merged profiles (``LayerGraph.merged``). If a later pass drops them, the
    final chain is profiled again."""
    split = next((index for index, graph_pass in enumerate(pipeline) if getattr(graph_pass, "reads_profile", False)),
                 len(pipeline))
    graph = run_pipeline(graph, pipeline[:split])
    measured = _profile(graph, leaves, options)
    if split == len(pipeline):
        return graph, measured
    graph = run_pipeline(graph, pipeline[split:])
    profiles = [layer.meta.get(meta.PROFILE) for layer in graph.layers]
    if any(layer_profile is None for layer_profile in profiles):
        return graph, _profile(graph, leaves, options)
    return graph, dataclasses.replace(measured, layers=tuple(profiles), graph_hash=graph_hash(graph))


def _profile(graph: LayerGraph, leaves: list[Any], options: ProfileOptions) -> ChainProfile:
    """Profiles and attaches; the model's buffers are put back afterwards (profiling runs
    training-mode layers that update BatchNorm statistics)."""
    with _restoring([*graph.gm.buffers(), *(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))]):
        measured = profile_graph(graph, leaves, options)
    attach(graph, measured)
    return measured


def _load_calibration(calibration: Any) -> Any:
    if calibration is None or not isinstance(calibration, (str, os.PathLike)):
        return calibration

    return Calibration.load(calibration)


@contextlib.contextmanager
def _restoring(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Puts the tensors' values back afterwards: compiling runs the model, and a forward that
    writes in place (BatchNorm statistics in training mode, a counter, an input scaled in
    place) must not change the user's model or example inputs."""
    saved = [(tensor, tensor.detach().clone()) for tensor in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in saved:
                if not torch.equal(tensor, value):
                    tensor.copy_(value)


def _run_eagerly(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Runs the model once so that inputs it rejects fail here, with the model's own message."""
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure means the example inputs are unusable
        names = ", ".join(name for name, _, _ in Signature.of(model).parameters)
        raise InputError(
            f"{type(model).__name__}(…) failed on the example inputs: {type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}. forward takes ({names}); "
            "pass example inputs with the shapes and dtypes the model expects."
        ) from None
