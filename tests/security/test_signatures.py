"""A signature says what it signs: the index digest and a subject (name, version, signing time).

The attacks: copy another artifact signed by the same key over this one's directory
(substitution), or an older build of this one (rollback). With a required name, a least
version or a trust file they are refused before any of the artifact's code runs; each hostile
artifact here carries stage code that creates the ``sentinel`` file when it is imported, and
the controls show that code does run when nothing is required. docs/security.md cites these
tests by name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import stat
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import flatpack
from flatpack.cli import build_parser, main
from flatpack.compiler import TRUST_FILE_KIND
from flatpack.errors import InputError
from flatpack.stage.integrity import INDEX_FILE, MAX_SIGNATURE_BYTES, SIGNATURE_FILE, Signature, sign_index
from tests.security.conftest import rewrite_index
from tests.security.test_tampering import _ed25519_keys, _tamper_stage_source, refused

NAME = "mlp-prod"


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return _ed25519_keys(tmp_path, "builder")


@pytest.fixture(scope="module")
def other_model() -> flatpack.Compiled:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    return flatpack.compile(model, (torch.randn(4, 8),), stages=2)


def _signed(directory: Path, **trust) -> Signature:
    """What ``flatpack.load(directory, **trust)`` verified (it loads, and a key was given)."""
    signature = flatpack.load(directory, **trust).signature
    assert signature is not None
    return signature


def _sign(directory: Path, key: Path | str, name: str, version: int) -> None:
    flatpack.sign(directory, key, name=name, version=version)


def _hostile_build(source: Path, target: Path, sentinel: Path) -> Path:
    """A copy of ``source`` whose stage 0 creates the sentinel when imported, with its manifest
    and index rewritten to match: a self-consistent artifact the key holder may well have
    signed (another model, an older build)."""
    shutil.copytree(source, target)
    (target / SIGNATURE_FILE).unlink(missing_ok=True)
    _tamper_stage_source(target, sentinel, fix_manifest=True)
    rewrite_index(target)
    return target


def _substitute(victim: Path, replacement: Path) -> None:
    """What an attacker who can write the deployment directory does: replace it whole."""
    shutil.rmtree(victim)
    shutil.copytree(replacement, victim)


# -- (a) substitution ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["another-model", "another-build"])
def test_an_artifact_signed_by_the_same_key_for_another_name_is_refused(out, sentinel, keys, tmp_path, kind,
                                                                          other_model):
    private, public = keys
    _sign(out, private, NAME, 1)
    assert _signed(out, verify_key=public, name=NAME).name == NAME
    source = other_model.save(tmp_path / "b-src") if kind == "another-model" else out
    other = _hostile_build(source, tmp_path / "b", sentinel)
    _sign(other, private, "dev-experiment", 7)
    _substitute(out, other)
    message = refused(out, sentinel, str(out / SIGNATURE_FILE), "'dev-experiment'", f"{NAME!r}", "substituted",
                      verify_key=public, name=NAME)
    assert "version 7" in message


def test_control_without_a_required_name_a_substituted_artifact_loads_and_its_code_runs(out, sentinel, keys,
                                                                                       tmp_path):
    """The control for the substitution test: the same swap passes a signature check that
    requires no name, and the hostile stage code then runs."""
    private, public = keys
    other = _hostile_build(out, tmp_path / "b", sentinel)
    _sign(other, private, "dev-experiment", 7)
    _substitute(out, other)
    loaded = flatpack.load(out, verify_key=public)
    assert loaded.trust == "signature" and loaded.signature is not None
    assert (loaded.signature.name, loaded.signature.version) == ("dev-experiment", 7)
    assert not sentinel.exists()
    loaded.stage_modules()
    assert sentinel.exists()


def test_the_verified_subject_is_exposed(out, keys):
    private, public = keys
    _sign(out, private, NAME, 3)
    signature = flatpack.load(out, verify_key=public, name=NAME, min_version=3).signature
    assert signature is not None and (signature.name, signature.version, signature.algorithm) == (NAME, 3, "ed25519")
    assert signature.signed_at is not None and signature.signed_at.endswith("Z")
    assert signature.key.startswith("ed25519:") and len(signature.key) == len("ed25519:") + 64
    assert flatpack.load(out).signature is None


# -- (b) rollback --------------------------------------------------------------------------

@pytest.fixture
def two_versions(out, sentinel, keys, tmp_path) -> tuple[Path, Path]:
    """Version 1 (an older build whose stage code creates the sentinel) and version 2 of NAME."""
    private, _ = keys
    old = _hostile_build(out, tmp_path / "v1", sentinel)
    _sign(old, private, NAME, 1)
    _sign(out, private, NAME, 2)
    return old, out


def test_a_version_below_min_version_is_refused_as_a_rollback(two_versions, sentinel, keys):
    old, new = two_versions
    _, public = keys
    message = refused(old, sentinel, str(old / SIGNATURE_FILE), "version 1", "least version required, 2",
                      "rollback", verify_key=public, name=NAME, min_version=2)
    assert NAME in message
    assert _signed(new, verify_key=public, name=NAME, min_version=2).version == 2
    # the control: without a least version the old build is a valid signature of the name
    assert _signed(old, verify_key=public, name=NAME).version == 1


def test_a_trust_file_refuses_a_version_older_than_one_it_accepted(two_versions, sentinel, keys, tmp_path):
    old, new = two_versions
    private, public = keys
    trust_file = tmp_path / "trusted.json"
    # the first load of the name records its version; the older one is refused after it
    assert _signed(new, verify_key=public, name=NAME, trust_file=trust_file).version == 2
    recorded = json.loads(trust_file.read_text())
    assert recorded["kind"] == TRUST_FILE_KIND and list(recorded["versions"].values()) == [{NAME: 2}]
    refused(old, sentinel, str(old / SIGNATURE_FILE), str(trust_file), "version 1", "version 2", "rollback",
            verify_key=public, name=NAME, trust_file=trust_file)
    assert json.loads(trust_file.read_text()) == recorded
    # the same version again loads; a newer one is recorded, and then 2 is a rollback too
    flatpack.load(new, verify_key=public, name=NAME, trust_file=trust_file)
    _sign(new, private, NAME, 3)
    flatpack.load(new, verify_key=public, name=NAME, trust_file=trust_file)
    assert list(json.loads(trust_file.read_text())["versions"].values()) == [{NAME: 3}]
    _sign(new, private, NAME, 2)
    refused(new, sentinel, "version 2", "version 3", verify_key=public, name=NAME, trust_file=trust_file)


def test_a_trust_file_keeps_versions_per_key_and_name(two_versions, sentinel, keys, tmp_path, monkeypatch):
    old, new = two_versions
    _, public = keys
    trust_file = tmp_path / "trusted.json"
    flatpack.load(new, verify_key=public, name=NAME, trust_file=trust_file)
    # another name under the same key, and the same name under another key, start afresh
    _sign(old, keys[0], "other-model", 1)
    assert _signed(old, verify_key=public, name="other-model", trust_file=trust_file).version == 1
    monkeypatch.setenv("FP_SIGNING_KEY", "a-build-machine-secret")
    _sign(old, "env:FP_SIGNING_KEY", NAME, 1)
    assert _signed(old, verify_key="env:FP_SIGNING_KEY", name=NAME, trust_file=trust_file).version == 1
    versions = json.loads(trust_file.read_text())["versions"]
    assert sorted(versions) == sorted([_signed(new, verify_key=public).key,
                                       _signed(old, verify_key="env:FP_SIGNING_KEY").key])
    assert "a-build-machine-secret" not in trust_file.read_text()
    assert not sentinel.exists()


@pytest.mark.parametrize("content, field", [
    (b"not json", "not valid JSON"),
    (b'{"kind": "something-else", "schema_version": 1, "versions": {}}', "kind"),
    (b'{"kind": "flatpack-trusted-versions", "schema_version": 9, "versions": {}}', "schema_version"),
    (b'{"kind": "flatpack-trusted-versions", "schema_version": 1, "versions": []}', "versions"),
    (b'{"kind": "flatpack-trusted-versions", "schema_version": 1, "versions": {"nokey": {}}}', "nokey"),
    (b'{"kind": "flatpack-trusted-versions", "schema_version": 1, "versions": {"ed25519:' + b"0" * 64
     + b'": {"mlp-prod": "9"}}}', "mlp-prod"),
])
def test_a_malformed_trust_file_is_refused_naming_the_file(two_versions, keys, tmp_path, content, field):
    _, new = two_versions
    trust_file = tmp_path / "trusted.json"
    trust_file.write_bytes(content)
    with pytest.raises(InputError) as caught:
        flatpack.load(new, verify_key=keys[1], name=NAME, trust_file=trust_file)
    assert str(trust_file) in str(caught.value) and field in str(caught.value)
    assert trust_file.read_bytes() == content


def test_a_subject_needs_a_key_and_a_trust_file_needs_a_name(out, keys, tmp_path):
    with pytest.raises(InputError, match="verify_key"):
        flatpack.load(out, name=NAME)
    with pytest.raises(InputError, match="verify_key"):
        flatpack.load(out, min_version=2)
    with pytest.raises(InputError, match="name="):
        flatpack.load(out, verify_key=keys[1], trust_file=tmp_path / "t.json")
    with pytest.raises(InputError, match="artifact name"):
        flatpack.load(out, verify_key=keys[1], name="Not A Name")
    for version in (0, -1, True, 2.0):
        with pytest.raises(InputError, match="version"):
            flatpack.load(out, verify_key=keys[1], name=NAME, min_version=version)  # type: ignore[arg-type]
        with pytest.raises(InputError, match="version"):
            flatpack.sign(out, keys[0], name=NAME, version=version)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="artifact name"):
        flatpack.sign(out, keys[0], name="../x", version=1)
    assert not (out / SIGNATURE_FILE).exists()


# -- (c) the statement is signed -----------------------------------------------------------

@pytest.mark.parametrize("field, value", [("name", "dev-experiment"), ("version", 9),
                                          ("signed_at", "2031-01-01T00:00:00Z"), ("digest", "0" * 64),
                                          ("_type", "flatpack-signature/v3")])
def test_an_edited_statement_is_refused(out, sentinel, keys, tmp_path, field, value):
    private, public = keys
    hostile = _hostile_build(out, tmp_path / "hostile", sentinel)
    _sign(hostile, private, "dev-experiment", 1)
    document = json.loads((hostile / SIGNATURE_FILE).read_text())
    if field == "name":
        document["statement"]["name"] = NAME   # claim to be the artifact the verifier requires
    else:
        document["statement"][field] = value
    (hostile / SIGNATURE_FILE).write_text(json.dumps(document))
    required = {"name": NAME} if field == "name" else {}
    refused(hostile, sentinel, str(hostile / SIGNATURE_FILE), verify_key=public, **required)


def test_an_index_rewritten_after_signing_is_refused_naming_both_digests(out, sentinel, keys):
    private, public = keys
    _sign(out, private, NAME, 1)
    signed = hashlib.sha256((out / INDEX_FILE).read_bytes()).hexdigest()
    _tamper_stage_source(out, sentinel, fix_manifest=True)
    now = rewrite_index(out)
    refused(out, sentinel, str(out / SIGNATURE_FILE), signed, now, verify_key=public, name=NAME)


def test_the_signed_bytes_are_the_canonical_statement_behind_its_domain_tag(out, monkeypatch):
    """The HMAC recomputed by hand: what a verifier in another language must reproduce."""
    monkeypatch.setenv("FP_SIGNING_KEY", "a-build-machine-secret")
    raw = (out / INDEX_FILE).read_bytes()
    document = json.loads(sign_index(raw, "env:FP_SIGNING_KEY", name=NAME, version=4,
                                     signed_at="2026-11-28T12:00:00Z"))
    statement = {"_type": "flatpack-signature/v2", "digest": hashlib.sha256(raw).hexdigest(), "name": NAME,
                 "version": 4, "signed_at": "2026-11-28T12:00:00Z"}
    assert document["statement"] == statement and document["algorithm"] == "hmac-sha256"
    message = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    assert message.startswith(b'{"_type":"flatpack-signature/v2",')
    assert document["signature"] == hmac.new(b"a-build-machine-secret", message, hashlib.sha256).hexdigest()


# -- v1 signature files --------------------------------------------------------------------

def _v1_signature(raw: bytes, secret: bytes) -> bytes:
    """A signature file as flatpack wrote it before subjects: HMAC of a domain tag and the index."""
    signature = hmac.new(secret, b"flatpack-index-v1\0" + raw, hashlib.sha256).hexdigest()
    document = {"algorithm": "hmac-sha256", "index_sha256": hashlib.sha256(raw).hexdigest(), "signature": signature}
    return (json.dumps(document, sort_keys=True, indent=2) + "\n").encode()


def test_a_v1_signature_loads_only_when_no_subject_is_required(out, sentinel, monkeypatch, tmp_path):
    monkeypatch.setenv("FP_SIGNING_KEY", "a-build-machine-secret")
    hostile = _hostile_build(out, tmp_path / "hostile", sentinel)
    (hostile / SIGNATURE_FILE).write_bytes(_v1_signature((hostile / INDEX_FILE).read_bytes(),
                                                         b"a-build-machine-secret"))
    loaded = flatpack.load(hostile, verify_key="env:FP_SIGNING_KEY")
    assert loaded.trust == "signature" and loaded.signature is not None and loaded.signature.name is None
    for required in ({"name": NAME}, {"name": NAME, "min_version": 1},
                     {"name": NAME, "trust_file": tmp_path / "trusted.json"}):
        message = refused(hostile, sentinel, str(hostile / SIGNATURE_FILE), "v1 signature", "--name",
                          verify_key="env:FP_SIGNING_KEY", **required)
        assert "names no artifact" in message or "no name" in message
    assert not (tmp_path / "trusted.json").exists()


# -- (d) malformed signature files ---------------------------------------------------------

def _valid_document(out: Path) -> dict:
    return json.loads(sign_index((out / INDEX_FILE).read_bytes(), "env:FP_SIGNING_KEY", name=NAME, version=1))


def _with(out: Path, path: str, value: object) -> bytes:
    document = _valid_document(out)
    *parents, last = path.split(".")
    target = document
    for part in parents:
        target = target[part]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return json.dumps(document).encode()


_DELETE = object()
MALFORMED = {
    "not-json": (lambda out: b"{not json", "not valid JSON"),
    "not-utf8": (lambda out: b"\xff\xfe{}", "not UTF-8"),
    "a-list": (lambda out: b"[]", "JSON object"),
    "empty": (lambda out: b"", "not valid JSON"),
    "nan": (lambda out: _with(out, "statement.version", 1).replace(b'"version": 1', b'"version": NaN'),
            "not valid JSON"),
    "duplicate-key": (lambda out: _with(out, "statement.version", 1).replace(b'"version": 1',
                                                                            b'"version": 1, "version": 5'),
                      "twice"),
    "deep": (lambda out: b"[" * 200 + b"]" * 200, "levels deep"),
    "huge": (lambda out: b'{"pad": "' + b"x" * (MAX_SIGNATURE_BYTES + 1) + b'"}', "bytes"),
    "algorithm": (lambda out: _with(out, "algorithm", "rsa"), "algorithm"),
    "algorithm-type": (lambda out: _with(out, "algorithm", ["ed25519"]), "algorithm"),
    "v1-digest-type": (lambda out: json.dumps({"algorithm": "hmac-sha256", "index_sha256": 7,
                                               "signature": "ab" * 32}).encode(), "index_sha256"),
    "signature-type": (lambda out: _with(out, "signature", 5), "signature"),
    "signature-hex": (lambda out: _with(out, "signature", "zz" * 32), "signature"),
    "statement-type": (lambda out: _with(out, "statement", "mlp-prod"), "statement"),
    "statement-missing": (lambda out: _with(out, "statement", _DELETE), "statement"),
    "extra-field": (lambda out: _with(out, "comment", "hi"), "comment"),
    "name-missing": (lambda out: _with(out, "statement.name", _DELETE), "statement.name"),
    "name-type": (lambda out: _with(out, "statement.name", ["mlp-prod"]), "statement.name"),
    "name-pattern": (lambda out: _with(out, "statement.name", "../Mlp Prod"), "statement.name"),
    "version-string": (lambda out: _with(out, "statement.version", "1"), "statement.version"),
    "version-bool": (lambda out: _with(out, "statement.version", True), "statement.version"),
    "version-float": (lambda out: _with(out, "statement.version", 1.0), "statement.version"),
    "version-zero": (lambda out: _with(out, "statement.version", 0), "statement.version"),
    "version-huge": (lambda out: _with(out, "statement.version", 2**70), "statement.version"),
    "signed-at-format": (lambda out: _with(out, "statement.signed_at", "yesterday"), "statement.signed_at"),
    "signed-at-date": (lambda out: _with(out, "statement.signed_at", "2026-13-40T00:00:00Z"), "statement.signed_at"),
    "digest-upper": (lambda out: _with(out, "statement.digest", "AB" * 32), "statement.digest"),
    "type-extra": (lambda out: _with(out, "statement.expires", "never"), "statement.expires"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_signature_file_is_a_clean_artifact_error(out, sentinel, tmp_path, monkeypatch, case):
    monkeypatch.setenv("FP_SIGNING_KEY", "a-build-machine-secret")
    make, field = MALFORMED[case]
    hostile = _hostile_build(out, tmp_path / "hostile", sentinel)
    (hostile / SIGNATURE_FILE).write_bytes(make(hostile))
    refused(hostile, sentinel, str(hostile / SIGNATURE_FILE), field, verify_key="env:FP_SIGNING_KEY")
    refused(hostile, sentinel, str(hostile / SIGNATURE_FILE), field, verify_key="env:FP_SIGNING_KEY", name=NAME)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_signature_file_that_is_not_a_regular_file_is_refused(out, sentinel, tmp_path, monkeypatch, kind):
    monkeypatch.setenv("FP_SIGNING_KEY", "a-build-machine-secret")
    signature = out / SIGNATURE_FILE
    if kind == "symlink":
        elsewhere = tmp_path / "elsewhere.sig"
        elsewhere.write_bytes(json.dumps(_valid_document(out)).encode())
        signature.symlink_to(elsewhere)
    elif kind == "fifo":
        os.mkfifo(signature)
    else:
        signature.mkdir()
    refused(out, sentinel, str(signature), verify_key="env:FP_SIGNING_KEY")


# -- (e) the command line ------------------------------------------------------------------

def test_cli_sign_with_a_name_then_check_requiring_it(out, keys, tmp_path, capsys):
    private, public = keys
    assert main(["sign", str(out), "--key", str(private), "--name", NAME, "--version", "3"]) == 0
    assert f"as {NAME} version 3" in capsys.readouterr().out
    # as private as the artifact it signs
    modes = {stat.S_IMODE((out / name).stat().st_mode) for name in (SIGNATURE_FILE, INDEX_FILE)}
    assert modes == {0o600}
    assert main(["check", str(out), "--verify-key", str(public), "--name", NAME, "--min-version", "3"]) == 0
    captured = capsys.readouterr()
    assert f"signed as {NAME} version 3 at 20" in captured.out and "no name was required" not in captured.err
    # without --name it passes, with a note on what that leaves open
    assert main(["check", str(out), "--verify-key", str(public)]) == 0
    captured = capsys.readouterr()
    assert f"signed as {NAME} version 3" in captured.out
    assert "no name was required" in captured.err and "--name" in captured.err
    # a refused artifact: the documented code for bad input, one line naming both, no traceback
    assert main(["check", str(out), "--verify-key", str(public), "--name", "bert-prod"]) == 2
    err = capsys.readouterr().err
    assert f"'{NAME}'" in err and "'bert-prod'" in err and SIGNATURE_FILE in err and "Traceback" not in err
    assert main(["check", str(out), "--verify-key", str(public), "--name", NAME, "--min-version", "4"]) == 2
    err = capsys.readouterr().err
    assert "version 3" in err and "rollback" in err and "Traceback" not in err


def test_cli_check_with_a_trust_file_refuses_a_rollback(out, keys, tmp_path, capsys):
    private, public = keys
    trust_file = tmp_path / "trusted.json"
    check = ["check", str(out), "--verify-key", str(public), "--name", NAME, "--trust-file", str(trust_file), "--json"]
    assert main(["sign", str(out), "--key", str(private), "--name", NAME, "--version", "5"]) == 0
    capsys.readouterr()
    assert main(check) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["signature"]["name"] == NAME and document["signature"]["version"] == 5
    assert main(["sign", str(out), "--key", str(private), "--name", NAME, "--version", "4"]) == 0
    capsys.readouterr()
    assert main(check) == 2
    err = capsys.readouterr().err
    assert str(trust_file) in err and "version 4" in err and "version 5" in err and "Traceback" not in err


def test_cli_sign_requires_a_valid_name_and_version(out, keys, capsys):
    private, _ = keys
    with pytest.raises(SystemExit):
        main(["sign", str(out), "--key", str(private), "--version", "1"])   # argparse: --name is required
    assert main(["sign", str(out), "--key", str(private), "--name", "Bad Name", "--version", "1"]) == 2
    assert main(["sign", str(out), "--key", str(private), "--name", NAME, "--version", "0"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert not (out / SIGNATURE_FILE).exists()


def test_resume_takes_the_same_signature_requirements():
    args = build_parser().parse_args(["resume", "run", "--verify-key", "k.pub", "--name", NAME, "--min-version", "2",
                                      "--trust-file", "t.json"])
    assert (args.verify_key, args.name, args.min_version, args.trust_file) == ("k.pub", NAME, 2, "t.json")
