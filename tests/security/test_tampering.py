"""A tampered artifact is refused before any of its code runs, with a message naming the file.

Each hostile edit carries a payload that would create the ``sentinel`` file if it ran (a
``stage.py`` that writes it at import, an output structure naming ``subprocess:Popen`` with
``touch SENTINEL``); every test asserts the refusal and that the sentinel never appears.
docs/security.md cites these tests by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch

import flatpack
from flatpack.errors import ArtifactError
from flatpack.stage.artifact import load_stage
from flatpack.stage.integrity import INDEX_FILE, SIGNATURE_FILE, check_safetensors, sign_index
from tests.security.conftest import hostile_stage_source, rewrite_index, rewrite_weights


def refused(out: Path, sentinel: Path, *names: str, **trust) -> str:
    """Asserts flatpack.load(out) fails naming every one of ``names`` and ran nothing."""
    with pytest.raises(ArtifactError) as caught:
        flatpack.load(out, **trust)
    message = str(caught.value)
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"
    assert not sentinel.exists(), "artifact code ran before the refusal"
    return message


# -- code execution from data: the import gadget in flatpack.json -------------------------------

def _gadget(sentinel: Path) -> dict:
    """``subprocess.Popen(args=["touch", SENTINEL])`` if a loader imports the named class."""
    return {"list": [{"const": "touch"}, {"const": str(sentinel)}]}


def hostile_structures(sentinel: Path) -> dict[str, dict]:
    args = _gadget(sentinel)
    return {
        "dict": {"dict": [args], "keys": ["args"], "class": "subprocess:Popen"},
        "tuple": {"tuple": [args], "class": "subprocess:Popen"},
        "namedtuple": {"tuple": [args], "class": "subprocess:Popen",
                       "namedtuple": {"name": "Popen", "fields": ["args"]}},
        "namedtuple-bad-fields": {"tuple": [args], "namedtuple": {"name": "X", "fields": ["__class__"]}},
        "os-system": {"dict": [{"const": f"touch {sentinel}"}], "keys": ["command"], "class": "os:system"},
        "nested-in-list": {"list": [{"leaf": 0}, {"dict": [args], "keys": ["args"], "class": "subprocess:Popen"}]},
        "nested-in-dict": {"dict": [{"tuple": [args], "class": "subprocess:Popen"}], "keys": ["x"], "class": None},
        "transformers-not-a-model-output": {"dict": [args], "keys": ["args"],
                                            "class": "transformers.utils:subprocess.Popen"},
        "dunder-path": {"dict": [args], "keys": ["args"], "class": "transformers:__builtins__.exec"},
    }


def _write_structure(out: Path, structure: dict) -> None:
    compiled_json = json.loads((out / "flatpack.json").read_text())
    compiled_json["output_structure"] = structure
    (out / "flatpack.json").write_text(json.dumps(compiled_json))


@pytest.mark.parametrize("kind", list(hostile_structures(Path("/x"))))
def test_hostile_flatpack_json_is_refused_by_the_index(out, sentinel, kind):
    _write_structure(out, hostile_structures(sentinel)[kind])
    message = refused(out, sentinel, str(out / "flatpack.json"))
    assert "sha256" in message or "bytes" in message


@pytest.mark.parametrize("kind", list(hostile_structures(Path("/x"))))
def test_hostile_flatpack_json_with_a_rewritten_index_is_refused_by_the_vocabulary(out, sentinel, kind):
    """Whoever can write the directory can rewrite the index too; without a pinned digest the
    closed vocabulary still refuses the gadget (and with one, the digest does)."""
    _write_structure(out, hostile_structures(sentinel)[kind])
    rewrite_index(out)
    if kind == "namedtuple":
        # a named tuple is data (a name and its fields): the class path it also records is used
        # only when that class is on the allowlist, so this rebuilds a harmless namedtuple
        result = flatpack.load(out).as_module()(torch.randn(4, 8))
        import subprocess

        assert type(result).__name__ == "Popen" and type(result) is not subprocess.Popen
        assert isinstance(result, tuple) and getattr(type(result), "_fields", None) == ("args",)
        assert getattr(result, "args", None) == ["touch", str(sentinel)] and not sentinel.exists()
        return
    message = refused(out, sentinel, str(out / "flatpack.json"), "output_structure")
    assert "will not rebuild" in message or "corrupted" in message


def test_hostile_flatpack_json_with_a_rewritten_index_is_refused_by_the_digest(out, sentinel, compiled):
    _write_structure(out, hostile_structures(sentinel)["dict"])
    rewrite_index(out)
    refused(out, sentinel, str(out / INDEX_FILE), "expected digest", digest=compiled.digest)


def test_structure_rebuild_never_imports_what_data_names(sentinel):
    from flatpack.ir import structure

    for kind, hostile in hostile_structures(sentinel).items():
        if kind == "namedtuple":
            continue   # rebuilt as a plain namedtuple (see above)
        with pytest.raises(ArtifactError):
            structure.rebuild(hostile, lambda index: torch.zeros(1), where=f"test {kind}")
    assert not sentinel.exists()


# -- stage code, weights, index --------------------------------------------------------------

def _tamper_stage_source(out: Path, sentinel: Path, *, fix_manifest: bool) -> None:
    stage = out / "stage_000"
    source = hostile_stage_source((stage / "stage.py").read_text(), sentinel).encode()
    (stage / "stage.py").write_bytes(source)
    if fix_manifest:
        manifest_json = json.loads((stage / "manifest.json").read_text())
        manifest_json["files"]["stage.py"] = {"sha256": hashlib.sha256(source).hexdigest(), "bytes": len(source)}
        (stage / "manifest.json").write_text(json.dumps(manifest_json, indent=2) + "\n")


def test_stage_code_tampered_with_its_manifest_hash_is_refused(out, sentinel):
    _tamper_stage_source(out, sentinel, fix_manifest=True)
    message = refused(out, sentinel, str(out / "stage_000"))
    assert "manifest.json" in message or "stage.py" in message


def test_stage_code_tampered_is_refused_by_load_stage_too(out, sentinel):
    _tamper_stage_source(out, sentinel, fix_manifest=True)
    with pytest.raises(ArtifactError, match="stage_000"):
        load_stage(out / "stage_000")
    assert not sentinel.exists()


def test_stage_code_with_manifest_and_index_rewritten_is_refused_by_the_digest(out, sentinel, compiled):
    _tamper_stage_source(out, sentinel, fix_manifest=True)
    rewrite_index(out)
    refused(out, sentinel, str(out / INDEX_FILE), digest=compiled.digest)
    with pytest.raises(ArtifactError, match=INDEX_FILE):
        load_stage(out / "stage_000", digest=compiled.digest)
    assert not sentinel.exists()


def test_without_a_digest_the_index_is_trusted_only_as_far_as_the_directory(out, compiled):
    loaded = flatpack.load(out)
    assert loaded.trust == "directory" and loaded.digest == compiled.digest
    assert flatpack.load(out, digest=compiled.digest).trust == "digest"


def test_weights_tampered_are_refused(out, sentinel):
    weights = out / "stage_001" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    refused(out, sentinel, str(weights), "sha256")


def test_index_tampered_is_refused(out, sentinel, compiled):
    index = json.loads((out / INDEX_FILE).read_text())
    index["files"]["stage_000/stage.py"]["sha256"] = "0" * 64
    (out / INDEX_FILE).write_text(json.dumps(index, sort_keys=True, separators=(",", ":")) + "\n")
    refused(out, sentinel, str(out / INDEX_FILE), digest=compiled.digest)
    # without a digest the altered entry no longer matches its file
    refused(out, sentinel, str(out / "stage_000" / "stage.py"))


def test_missing_index_is_refused(out, sentinel):
    (out / INDEX_FILE).unlink()
    refused(out, sentinel, INDEX_FILE, "Recompile")


def test_unlisted_file_is_refused(out, sentinel):
    (out / "stage_000" / "extra.py").write_text(f"open({str(sentinel)!r}, 'w').close()\n")
    refused(out, sentinel, str(out / "stage_000" / "extra.py"), "not listed")


def test_wrong_digest_is_refused(out, sentinel):
    refused(out, sentinel, str(out / INDEX_FILE), "expected digest", digest="ab" * 32)
    refused(out, sentinel, "not a sha256", digest="not-a-digest")


# -- paths and sizes -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../outside.py", "/etc/passwd", "stage_000/../../x", "stage_000//stage.py",
                                  "./flatpack.json", "stage_000\\..\\x"])
def test_path_traversal_in_the_index_is_refused(out, sentinel, name):
    index = json.loads((out / INDEX_FILE).read_text())
    index["files"][name] = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    raw = (json.dumps(index, sort_keys=True, separators=(",", ":")) + "\n").encode()
    (out / INDEX_FILE).write_bytes(raw)
    # even the digest of the hostile index itself does not make its paths acceptable
    message = refused(out, sentinel, str(out / INDEX_FILE), digest=hashlib.sha256(raw).hexdigest())
    assert "not a plain relative path" in message


def test_symlinked_file_is_refused(out, sentinel, tmp_path):
    source = out / "stage_000" / "stage.py"
    outside = tmp_path / "elsewhere.py"
    outside.write_bytes(source.read_bytes())   # same bytes: only the link itself is wrong
    source.unlink()
    source.symlink_to(outside)
    refused(out, sentinel, str(source), "symbolic link")


def test_symlinked_stage_directory_is_refused(out, sentinel, tmp_path):
    stage = out / "stage_001"
    moved = tmp_path / "moved_stage"
    stage.rename(moved)
    stage.symlink_to(moved, target_is_directory=True)
    refused(out, sentinel, str(stage), "symbolic link")




def test_oversized_safetensors_header_is_refused(out, sentinel):
    weights = rewrite_weights(out, struct.pack("<Q", 1 << 40) + b"{}")
    refused(out, sentinel, str(weights), "header", "limit")


def test_truncated_weights_are_refused(out, sentinel):
    weights = out / "stage_001" / "weights.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    refused(out, sentinel, str(weights), "truncated")


def test_truncated_weights_with_a_rewritten_index_are_refused_by_the_framing(out, sentinel):
    data = (out / "stage_001" / "weights.safetensors").read_bytes()
    weights = rewrite_weights(out, data[: len(data) - 16])
    refused(out, sentinel, str(weights), "truncated")


def test_tensor_offsets_outside_the_file_are_refused():
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 30]}}).encode()
    with pytest.raises(ArtifactError, match="claims bytes"):
        check_safetensors(struct.pack("<Q", len(header)) + header + b"\0" * 16, "w.safetensors")
    header = json.dumps({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 16]}}).encode()
    with pytest.raises(ArtifactError, match="needs 32 bytes"):
        check_safetensors(struct.pack("<Q", len(header)) + header + b"\0" * 16, "w.safetensors")
    with pytest.raises(ArtifactError, match="truncated"):
        check_safetensors(b"\1\0", "w.safetensors")


# -- signatures ------------------------------------------------------------------------------

def _ed25519_keys(directory: Path, name: str) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private, public = directory / f"{name}.pem", directory / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def test_ed25519_signature_verifies_and_a_bad_one_is_refused(out, sentinel, tmp_path):
    private, public = _ed25519_keys(tmp_path, "builder")
    _, other_public = _ed25519_keys(tmp_path, "stranger")
    (out / SIGNATURE_FILE).write_bytes(sign_index((out / INDEX_FILE).read_bytes(), private,
                                                  name="mlp", version=1))
    assert flatpack.load(out, verify_key=public).trust == "signature"
    refused(out, sentinel, str(out / SIGNATURE_FILE), "not a valid ed25519 signature", verify_key=other_public)
    # stage code, manifest and index all rewritten: the signature no longer covers the index
    _tamper_stage_source(out, sentinel, fix_manifest=True)
    rewrite_index(out)
    refused(out, sentinel, str(out / SIGNATURE_FILE), verify_key=public)


def test_hmac_signature_with_the_wrong_key_is_refused(out, sentinel, monkeypatch):
    monkeypatch.setenv("FP_TEST_KEY", "a-build-machine-secret")
    (out / SIGNATURE_FILE).write_bytes(sign_index((out / INDEX_FILE).read_bytes(), "env:FP_TEST_KEY",
                                                  name="mlp", version=1))
    assert flatpack.load(out, verify_key="env:FP_TEST_KEY").trust == "signature"
    monkeypatch.setenv("FP_TEST_KEY", "a-different-secret!!")
    refused(out, sentinel, str(out / SIGNATURE_FILE), "hmac-sha256", verify_key="env:FP_TEST_KEY")


def test_unsigned_artifact_is_refused_when_a_key_is_given(out, sentinel, tmp_path):
    _, public = _ed25519_keys(tmp_path, "builder")
    refused(out, sentinel, "unsigned", verify_key=public)


# -- a clean artifact still works ------------------------------------------------------------

def test_a_pinned_artifact_loads_and_runs(out, compiled):
    loaded = flatpack.load(out, digest=compiled.digest)
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded.as_module()(x), compiled.as_module()(x))
    assert os.path.basename(out) == "out"


def test_control_a_fully_rewritten_directory_without_a_digest_runs_its_code(out, sentinel):
    """The control for every sentinel check above, and the documented limit: whoever can write
    the whole directory (code, manifest and index) gets their code run by a load that pins no
    digest and no key. So the sentinel payload does work when nothing stops it."""
    _tamper_stage_source(out, sentinel, fix_manifest=True)
    rewrite_index(out)
    loaded = flatpack.load(out)
    assert loaded.trust == "directory"
    loaded.stage_modules()
    assert sentinel.exists()


def test_model_output_classes_are_rebuilt_from_transformers_only():
    transformers = pytest.importorskip("transformers")
    from flatpack.ir import structure

    node = {"dict": [{"leaf": 0}], "keys": ["logits"]}
    for path in ("transformers.modeling_outputs:CausalLMOutput",
                 "transformers.models.gpt2.modeling_gpt2:GPT2DoubleHeadsModelOutput"):
        rebuilt = structure.rebuild({**node, "class": path}, lambda index: torch.ones(1))
        assert isinstance(rebuilt, transformers.utils.ModelOutput), path
    # the right class with fields it does not have is an artifact error, not a crash
    with pytest.raises(ArtifactError, match="cannot be rebuilt"):
        structure.rebuild({**node, "keys": ["no_such_field"], "class": "transformers.modeling_outputs:CausalLMOutput"},
                          lambda index: torch.ones(1))
    # a transformers attribute that is a class but not a ModelOutput is refused
    with pytest.raises(ArtifactError, match="will not rebuild"):
        structure.rebuild({**node, "class": "transformers:PreTrainedModel"}, lambda index: torch.ones(1))
