"""The artifact's one integrity root: ``flatpack.index.json`` and its digest.

An artifact is code a worker executes, so every file of it (``flatpack.json``, ``plan.json``
and each stage's ``stage.py``, weights and manifest) is listed in one index with its size and
sha256. The index is canonical JSON (sorted keys, no spaces), so its sha256 — the artifact's
**digest** — is stable; ``Compiled.digest`` returns it and ``flatpack compile`` prints it.

Trust comes from outside the artifact: a digest the caller pins (``load(dir, digest=...)``,
``deploy(..., digest=...)``, a worker's invocation payload) or a signature over the index
checked with a key the caller holds (``flatpack sign`` / ``--verify-key``: Ed25519 through
``cryptography``, or HMAC-SHA256 with a key from an environment variable); a signature also
names the artifact and its version, which a verifier may require. Without either,
the index is trusted only as far as the directory holding it is. Every check here runs on
bytes read once and kept: the bytes that were hashed are the bytes that get used, and
nothing from the artifact is imported or executed before they pass
(``tests/security/test_tampering.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping

import flatpack.safeio as safeio
from flatpack.errors import ArtifactError, FlatpackError, InputError
from flatpack.safeio import expect_mapping, finite, parse_json

INDEX_FILE = "flatpack.index.json"
SIGNATURE_FILE = "flatpack.index.sig"
INDEX_KIND = "flatpack-index"
INDEX_SCHEMA_VERSION = 1
# What a v1 signature signed (read, never written): a domain tag, then the index bytes.
_SIGNED_PREFIX = b"flatpack-index-v1\0"
ED25519 = "ed25519"
HMAC_SHA256 = "hmac-sha256"
ENV_KEY_PREFIX = "env:"

# safetensors itself refuses headers above 100 MB; a stage's header (names, dtypes, shapes,
# offsets) is far below it, so a larger claim means the bytes are not flatpack's.
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024
_HEADER_LEN = struct.Struct("<Q")
# An index lists a few files per stage (~150 bytes each): 16 MiB is over 100,000 files. A
# signature document is under 300 bytes.
MAX_INDEX_BYTES = 16 * safeio.MiB
# Every other file but the weights (flatpack.json, plan.json, a manifest, stage.py) is text flatpack
# wrote: a few MiB for the largest model. Weights are bounded by the size the index records.
MAX_TEXT_FILE_BYTES = 256 * safeio.MiB
# The dtypes safetensors.torch loads (F8_E8M0 is not among them in 0.8: its loader raises KeyError,
# so framing that admitted it would hand the parser a file it fails on).
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_PATH_PART = re.compile(r"[A-Za-z0-9_.\-]+")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_relative_path(name: object, where: str) -> str:
    """``name`` as a path confined to the artifact: relative, '/'-separated, no '..' or '.'
    parts, no empty parts, only plain characters. Raises ArtifactError otherwise."""
    if not isinstance(name, str) or not name:
        raise ArtifactError(f"{where} lists a file name {name!r} that is not a non-empty string; "
                            "the artifact is corrupted or hostile, recompile it")
    parts = name.split("/")
    if name.startswith("/") or any(part in ("", ".", "..") or not _PATH_PART.fullmatch(part) for part in parts):
        raise ArtifactError(f"{where} lists the file {name!r}, which is not a plain relative path inside the "
                            "artifact (absolute paths, '..', empty parts and unusual characters are refused); "
                            "the artifact is corrupted or hostile, recompile it")
    return name


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Index:
    """The parsed index: relative path -> size and sha256; ``raw`` are the exact bytes whose
    sha256 is ``digest``."""

    files: Mapping[str, FileEntry]
    raw: bytes

    @property
    def digest(self) -> str:
        return sha256_hex(self.raw)

    @classmethod
    def build(cls, files: Mapping[str, bytes]) -> Index:
        """The index of ``files`` (relative path -> bytes), in canonical form."""
        for name in files:
            check_relative_path(name, "the files to index")
        document = {"kind": INDEX_KIND, "schema_version": INDEX_SCHEMA_VERSION,
                    "files": {name: {"bytes": len(data), "sha256": sha256_hex(data)} for name, data in files.items()}}
        raw = (json.dumps(document, sort_keys=True, separators=(",", ":")) + "\n").encode()
        return cls.parse(raw, "the new index")

    @classmethod
    def parse(cls, raw: bytes, where: str) -> Index:
        """Parses and checks an index's bytes (call it after the digest or signature check)."""
        document = safeio.parse_json(raw, what=where, error=ArtifactError)
        if not isinstance(document, dict) or document.get("kind") != INDEX_KIND:
            raise ArtifactError(f"{where} is not a flatpack index (kind {INDEX_KIND!r} expected); recompile the model")
        if document.get("schema_version") != INDEX_SCHEMA_VERSION:
            raise ArtifactError(f"{where} uses index schema {document.get('schema_version')!r}, this flatpack reads "
                                f"schema {INDEX_SCHEMA_VERSION}; recompile with this version")
        listed = document.get("files")
        if not isinstance(listed, dict) or not listed:
            raise ArtifactError(f"{where} lists no files; the artifact is corrupted, recompile it")
        files: dict[str, FileEntry] = {}
        for name, entry in listed.items():
            check_relative_path(name, where)
            if name in (INDEX_FILE, SIGNATURE_FILE):
                raise ArtifactError(f"{where} lists {name}, which cannot cover itself; recompile the model")
            size = entry.get("bytes") if isinstance(entry, dict) else None
            digest = entry.get("sha256") if isinstance(entry, dict) else None
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str) \
                    or not _SHA256_HEX.fullmatch(digest):
                raise ArtifactError(f"{where} has a malformed entry for {name!r} (bytes and a lowercase sha256 "
                                    "hex expected); recompile the model")
            files[name] = FileEntry(size, digest)
        return cls(files, bytes(raw))

    def check(self, name: str, data: bytes, where: str) -> bytes:
        """``data`` if it is the file the index lists as ``name``; else ArtifactError naming ``where``."""
        entry = self.files.get(name)
        if entry is None:
            raise ArtifactError(f"{where} is not listed in the artifact's {INDEX_FILE}; the artifact was altered. "
                                "Recompile the model, or remove the file.")
        if len(data) != entry.size:
            cause = "truncated" if len(data) < entry.size else "longer than it was written"
            raise ArtifactError(f"{where} has {len(data)} bytes but {INDEX_FILE} records {entry.size}: the file is "
                                f"{cause}. Recompile the model, or restore the file from the original output.")
        actual = sha256_hex(data)
        if not hmac.compare_digest(actual, entry.sha256):
            raise ArtifactError(f"{where} has sha256 {actual[:16]}… but {INDEX_FILE} records {entry.sha256[:16]}…: "
                                "the file was modified or corrupted. Recompile the model, or restore the file from "
                                "the original output.")
        return data


def check_digest(raw: bytes, digest: str, where: str) -> None:
    """Raises unless ``raw`` (an index's bytes) has sha256 ``digest``."""
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest.lower()):
        raise ArtifactError(f"the digest to check {where} against, {str(digest)[:80]!r}, is not a sha256 hex string "
                            "(64 hex digits, as `flatpack compile` prints and Compiled.digest returns)")
    actual = sha256_hex(raw)
    if not hmac.compare_digest(actual, digest.lower()):
        raise ArtifactError(f"{where} has digest {actual} but the expected digest is {digest.lower()}: this is not "
                            "the artifact that was compiled (it was altered or replaced). Recompile, or pass the "
                            "digest of the artifact you mean to run.")


# -- signatures ------------------------------------------------------------------------------
#
# A signature signs a *statement*, not the index alone: the index's digest and a subject (the
# artifact's name, a version that only goes up, when it was signed), as canonical JSON whose
# first key is a domain tag (in-toto/TUF style). A verifier that requires a name and a least
# version then refuses another artifact signed by the same key, or an older build of this one
# (``tests/security/test_signatures.py``). The file: ``{"statement": {...}, "algorithm": ...,
# "signature": hex}``; the signed bytes are the statement re-serialized canonically, so only its
# parsed fields, never spacing, matter.

SIGNATURE_TYPE = "flatpack-signature/v2"
# a v2 file is about 500 bytes; anything near this limit is not flatpack's
MAX_SIGNATURE_BYTES = 64 * 1024
SIGNATURE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
# JSON integers beyond int64 would be exact in Python but not in most other verifiers
MAX_SIGNATURE_VERSION = 2**63 - 1
# how Signature.key names a verifying key (and how a trust file indexes its versions)
KEY_FINGERPRINT = re.compile(rf"({ED25519}|{HMAC_SHA256}):[0-9a-f]{{64}}")
_SIGNED_AT = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
_STATEMENT_FIELDS = ("_type", "digest", "name", "version", "signed_at")
_SIGNATURE_HEX = {ED25519: 128, HMAC_SHA256: 64}
_RESIGN = "sign it again with `flatpack sign DIR --key KEY --name NAME --version N`"


@dataclass(frozen=True)
class Signature:
    """What a verified signature vouched for. ``key``: the verifying key's fingerprint
    (``ed25519:<sha256 of the public key>`` or ``hmac-sha256:<HMAC of a fixed label>``, never the
    secret). ``name``, ``version`` and ``signed_at`` are None for a v1 signature, which signed
    the index bytes alone and says nothing about which artifact or build it is."""

    algorithm: str
    key: str
    name: str | None
    version: int | None
    signed_at: str | None

    def to_json(self) -> dict[str, object]:
        return {"algorithm": self.algorithm, "key": self.key, "name": self.name, "version": self.version,
                "signed_at": self.signed_at, "format": 2 if self.name is not None else 1}


def check_subject_name(name: object, what: str, error: type[FlatpackError] = InputError) -> str:
    """``name`` if it is an artifact name a signature may carry (``[a-z0-9][a-z0-9._-]{0,63}``)."""
    if not isinstance(name, str) or not SIGNATURE_NAME.fullmatch(name):
        raise error(f"{what} is {str(name)[:80]!r}; an artifact name is 1 to 64 characters of a-z, 0-9, '.', "
                    "'_' and '-', beginning with a letter or digit (e.g. bert-prod)")
    return name


def check_subject_version(version: object, what: str, error: type[FlatpackError] = InputError) -> int:
    """``version`` if it is a positive integer (bool and float refused: the signed JSON must
    round-trip exactly)."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise error(f"{what} must be a positive whole number, not {type(version).__name__} {str(version)[:40]!r}")
    finite(version, what=what, low=1, high=MAX_SIGNATURE_VERSION, integer=True, error=error)
    return version


def _canonical(statement: Mapping[str, object]) -> bytes:
    return json.dumps(statement, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _hmac_key(spec: str, purpose: str) -> bytes:
    name = spec[len(ENV_KEY_PREFIX):]
    value = os.environ.get(name, "")
    if not name or len(value) < 16:
        raise ArtifactError(f"{purpose} with HMAC needs a key of at least 16 characters in the environment variable "
                            f"{name or '<empty name>'} ({spec!r}); set it on the machines that sign and verify")
    return value.encode()


def _hmac_fingerprint(secret: bytes) -> str:
    # a keyed hash of a fixed label: identifies the secret in a trust file without revealing it
    return f"{HMAC_SHA256}:{hmac.new(secret, b'flatpack key fingerprint', hashlib.sha256).hexdigest()}"


def _ed25519_fingerprint(public: object) -> str:
    # optional dependency: only an Ed25519 key needs it (a function verifies by digest)
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    raw = public.public_bytes(Encoding.Raw, PublicFormat.Raw)  # type: ignore[attr-defined]
    return f"{ED25519}:{sha256_hex(raw)}"


def sign_index(raw: bytes, key: str | os.PathLike, *, name: str, version: int, signed_at: str | None = None) -> bytes:
    """A signature file for the index bytes ``raw`` and the subject ``name`` at ``version``
    (signed now, or at ``signed_at``, ``YYYY-MM-DDTHH:MM:SSZ``): with ``env:NAME``, HMAC-SHA256
    with the key in that environment variable; else ``key`` is an Ed25519 private key file
    (PEM, as ``openssl genpkey -algorithm ed25519`` writes)."""
    check_subject_name(name, "the artifact name to sign (--name)")
    check_subject_version(version, "the version to sign (--version)")
    if signed_at is None:
        signed_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    _check_signed_at(signed_at, "the signing time", InputError)
    statement = {"_type": SIGNATURE_TYPE, "digest": sha256_hex(raw), "name": name, "version": version,
                 "signed_at": signed_at}
    message = _canonical(statement)
    if str(key).startswith(ENV_KEY_PREFIX):
        algorithm = HMAC_SHA256
        signature = hmac.new(_hmac_key(str(key), "signing"), message, hashlib.sha256).hexdigest()
    else:
        # optional dependency: only an Ed25519 key needs it (a function verifies by digest)
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            private = load_pem_private_key(Path(key).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as err:
            raise ArtifactError(f"cannot read the Ed25519 private key {key}: {err}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise ArtifactError(f"{key} is a {type(private).__name__}, not an Ed25519 private key; make one with "
                                "`openssl genpkey -algorithm ed25519 -out key.pem`")
        algorithm = ED25519
        signature = private.sign(message).hex()
    document = {"statement": statement, "algorithm": algorithm, "signature": signature}
    return (json.dumps(document, sort_keys=True, indent=2) + "\n").encode()


def _check_signed_at(value: object, what: str, error: type[FlatpackError]) -> str:
    if not isinstance(value, str) or not _SIGNED_AT.fullmatch(value):
        raise error(f"{what} must be a UTC time written YYYY-MM-DDTHH:MM:SSZ, not {str(value)[:40]!r}")
    try:
        datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        raise error(f"{what} is {value!r}, not a real date and time") from None
    return value


@dataclass(frozen=True)
class _Statement:
    digest: str
    name: str
    version: int
    signed_at: str


@dataclass(frozen=True)
class _SignatureFile:
    """A parsed signature file, not yet verified: the bytes that were signed and what they say."""

    algorithm: str
    signature: bytes
    message: bytes
    statement: _Statement | None   # None: a v1 file (index bytes only)


def _parse_signature_file(data: bytes, raw: bytes, shown: str) -> _SignatureFile:
    """The signature file ``data`` (shown as ``shown``) parsed field by field; every malformed
    field is an ArtifactError naming the file and the field. ``raw``: the index bytes, which a v1
    file signs directly."""
    document = expect_mapping(parse_json(data, what=shown, error=ArtifactError), what=shown, error=ArtifactError)

    def bad(field: str, why: str) -> ArtifactError:
        return ArtifactError(f"{shown}: the field {field} {why}; the file is corrupted or hostile, {_RESIGN}")

    algorithm = document.get("algorithm")
    if not isinstance(algorithm, str) or algorithm not in _SIGNATURE_HEX:
        raise bad("algorithm", f"is {str(algorithm)[:40]!r}, not one of {', '.join(_SIGNATURE_HEX)}")
    signature = document.get("signature")
    if not isinstance(signature, str) or len(signature) != _SIGNATURE_HEX[algorithm] \
            or not re.fullmatch(r"[0-9a-f]*", signature):
        raise bad("signature", f"must be {_SIGNATURE_HEX[algorithm]} lowercase hex digits for {algorithm}")
    if "statement" not in document:
        # v1 (before subjects): the index bytes behind a domain tag
        if set(document) != {"algorithm", "index_sha256", "signature"}:
            raise bad("statement", "is missing (a v1 file has algorithm, index_sha256 and signature only)")
        if not isinstance(document["index_sha256"], str) or not _SHA256_HEX.fullmatch(document["index_sha256"]):
            raise bad("index_sha256", "must be 64 lowercase hex digits")
        return _SignatureFile(algorithm, bytes.fromhex(signature), _SIGNED_PREFIX + raw, None)
    extra = sorted(set(document) - {"statement", "algorithm", "signature"})
    if extra:
        raise bad(extra[0], "is not part of a flatpack signature file")
    statement = expect_mapping(document["statement"], what=f"{shown}: the field statement", error=ArtifactError)
    missing = sorted(set(_STATEMENT_FIELDS) - set(statement))
    if missing:
        raise bad(f"statement.{missing[0]}", "is missing")
    extra = sorted(set(statement) - set(_STATEMENT_FIELDS))
    if extra:
        raise bad(f"statement.{extra[0]}", "is not part of a signed statement")
    if statement["_type"] != SIGNATURE_TYPE:
        raise bad("statement._type", f"is {str(statement['_type'])[:60]!r}, not {SIGNATURE_TYPE!r}")
    digest = statement["digest"]
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
        raise bad("statement.digest", "must be 64 lowercase hex digits (the sha256 of flatpack.index.json)")
    subject = _Statement(digest, check_subject_name(statement["name"], f"{shown}: the field statement.name",
                                                    ArtifactError),
                         check_subject_version(statement["version"], f"{shown}: the field statement.version",
                                               ArtifactError),
                         _check_signed_at(statement["signed_at"], f"{shown}: the field statement.signed_at",
                                          ArtifactError))
    return _SignatureFile(algorithm, bytes.fromhex(signature), _canonical(statement), subject)


def _verify(parsed: _SignatureFile, verify_key: str | os.PathLike) -> tuple[bool, str]:
    """Whether ``parsed`` is a valid signature under ``verify_key``, and the key's fingerprint."""
    if str(verify_key).startswith(ENV_KEY_PREFIX):
        secret = _hmac_key(str(verify_key), "verifying")
        expected = hmac.new(secret, parsed.message, hashlib.sha256).digest()
        valid = parsed.algorithm == HMAC_SHA256 and hmac.compare_digest(expected, parsed.signature)
        return valid, _hmac_fingerprint(secret)
    # optional dependency: only an Ed25519 key needs it (a function verifies by digest)
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        public = load_pem_public_key(Path(verify_key).read_bytes())
    except (OSError, ValueError, TypeError) as err:
        raise ArtifactError(f"cannot read the Ed25519 public key {verify_key}: {err}") from None
    if not isinstance(public, Ed25519PublicKey):
        raise ArtifactError(f"{verify_key} is not an Ed25519 public key; export one with "
                            "`openssl pkey -in key.pem -pubout -out key.pub`")
    valid = parsed.algorithm == ED25519
    try:
        public.verify(parsed.signature, parsed.message)
    except InvalidSignature:
        valid = False
    return valid, _ed25519_fingerprint(public)


def check_signature(raw: bytes, signature_doc: bytes | None, verify_key: str | os.PathLike, where: str, *,
                    name: str | None = None, min_version: int | None = None) -> Signature:
    """What the signature file ``signature_doc`` vouches for, if it signs the index bytes ``raw``
    under ``verify_key`` (``env:NAME`` for HMAC, else an Ed25519 public key file in PEM) and
    its subject is ``name`` (when given) at ``min_version`` or later (when given); else
    ArtifactError naming ``where``/flatpack.index.sig. A v1 signature (no subject) is refused
    whenever a name or a least version is required."""
    shown = f"{where}/{SIGNATURE_FILE}"
    if signature_doc is None:
        raise ArtifactError(f"{where} has no {SIGNATURE_FILE} but a verify key was given: the artifact is unsigned. "
                            "Sign it with `flatpack sign DIR --key KEY --name NAME --version N` where it was built.")
    parsed = _parse_signature_file(signature_doc, raw, shown)
    valid, fingerprint = _verify(parsed, verify_key)
    if not valid:
        raise ArtifactError(f"{shown} is not a valid {parsed.algorithm} signature of {where}/{INDEX_FILE} "
                            f"under the key {verify_key}: the index or the signed statement was altered, or signed "
                            "with another key. Do not run this artifact; rebuild and sign it, or pass the right key.")
    statement = parsed.statement
    if statement is None:
        if name is not None or min_version is not None:
            required = f"the name {name!r}" if name is not None else f"version {min_version} or later"
            raise ArtifactError(f"{shown} is a v1 signature: it signs the index alone and names no artifact or "
                                f"version, so it cannot show {required}. Re-sign the artifact where it was built "
                                "with `flatpack sign DIR --key KEY --name NAME --version N`.")
        return Signature(parsed.algorithm, fingerprint, None, None, None)
    actual = sha256_hex(raw)
    if not hmac.compare_digest(actual, statement.digest):
        raise ArtifactError(f"{shown} signs the index digest {statement.digest} but {where}/{INDEX_FILE} has "
                            f"digest {actual}: the index was replaced or altered since it was signed. Do not run "
                            "this artifact; rebuild and sign it.")
    signed = Signature(parsed.algorithm, fingerprint, statement.name, statement.version, statement.signed_at)
    if name is not None and statement.name != name:
        raise ArtifactError(f"{shown} signs the artifact {statement.name!r} (version {statement.version}), but "
                            f"{name!r} is required: {where} holds another artifact signed by the same key (it was "
                            f"substituted). Do not run it; deploy the {name!r} artifact, or require its own name.")
    if min_version is not None and statement.version < min_version:
        raise ArtifactError(f"{shown} signs {statement.name!r} version {statement.version}, below the least version "
                            f"required, {min_version}: this is a rollback to an older build. Do not run it; deploy "
                            f"version {min_version} or later.")
    return signed


# -- reading a directory ---------------------------------------------------------------------

@dataclass(frozen=True)
class Verified:
    """Files of an artifact that passed the checks, as the bytes that were hashed.

    ``trust`` says what vouched for the index: ``"digest"`` (the caller pinned it),
    ``"signature"`` (a key the caller holds), or ``"directory"`` (nothing outside the
    directory: the index is trusted only as far as the directory is)."""

    index: Index
    files: Mapping[str, bytes]
    trust: str
    # what a signature vouched for, when a verify key was given
    signature: Signature | None = None

    @property
    def digest(self) -> str:
        return self.index.digest


@contextmanager
def open_artifact(root: Path) -> Iterator[int]:
    """A descriptor of the artifact directory ``root``: every file of it is then read below
    this descriptor (:func:`read_file`), so a stage directory swapped for a symlink after the
    scan is refused instead of followed."""
    fd = safeio.open_directory(root, what="the artifact directory", error=ArtifactError)
    try:
        yield fd
    finally:
        os.close(fd)


def read_file(root_fd: int, root: Path, name: str, *, limit: int, size: int | None = None) -> bytes:
    """The bytes of ``name`` below the open artifact directory ``root_fd``: a regular file
    reached with no symlink at any component, refused before a byte is read when it is larger
    than ``limit`` or, with ``size`` (what the index records), of another size."""
    shown = str(root / name)
    try:
        os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        # only for the message: the file itself is opened below, component by component
        raise ArtifactError(f"{shown} is missing; the artifact is incomplete. Recompile the model, or restore the "
                            "file from the original output.") from None
    except OSError:
        pass   # a link or a non-directory on the way: open_beneath names it
    fd = safeio.open_beneath(root_fd, name, what=shown, error=ArtifactError)
    try:
        actual = os.fstat(fd).st_size
        if size is not None and actual != size:
            # the index's own wording: whatever the file is (a 6 GiB sparse file), none of it is read
            cause = "truncated" if actual < size else "longer than it was written"
            raise ArtifactError(f"{shown} has {actual:,} bytes but {INDEX_FILE} records {size:,}: the file is "
                                f"{cause}. Recompile the model, or restore the file from the original output.")
        return safeio.read_fd(fd, limit=limit if size is None else size, what=shown, path=name, error=ArtifactError)
    finally:
        os.close(fd)


def _scan(root: Path, root_fd: int, under: str | None) -> list[str]:
    """Relative paths of the files below the open directory ``root_fd`` (or its subdirectory
    ``under``), walked by descriptor; refuses symbolic links and anything that is neither a
    file nor a directory."""
    start_fd = root_fd
    if under:
        try:
            mode = os.stat(under, dir_fd=root_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            raise ArtifactError(f"{root / under} does not exist; it is not a stage of this artifact") from None
        if stat.S_ISLNK(mode):
            raise ArtifactError(f"{root / under} is a symbolic link; an artifact's files must be inside it. "
                                "Recompile.")
        start_fd = safeio.open_beneath(root_fd, under, what=str(root / under), error=ArtifactError, directory=True)
    found = []
    try:
        for current, dirs, files, current_fd in os.fwalk(".", dir_fd=start_fd, follow_symlinks=False):
            for name in [*dirs, *files]:
                relative = os.path.normpath(os.path.join(under or ".", current, name))
                mode = os.stat(name, dir_fd=current_fd, follow_symlinks=False).st_mode
                if stat.S_ISLNK(mode):
                    raise ArtifactError(f"{root / relative} is a symbolic link; an artifact's files must be regular "
                                        "files inside it. Replace the link with the file, or recompile.")
                if stat.S_ISREG(mode):
                    found.append(Path(relative).as_posix())
                elif not stat.S_ISDIR(mode):
                    raise ArtifactError(f"{root / relative} is not a regular file (a FIFO, socket or device); "
                                        "remove it from the artifact")
    finally:
        if start_fd != root_fd:
            os.close(start_fd)
    return found


def read_index(root: str | os.PathLike, *, digest: str | None = None, verify_key: str | os.PathLike | None = None,
               name: str | None = None, min_version: int | None = None,
               root_fd: int | None = None) -> tuple[Index, str, Signature | None]:
    """The artifact's index, checked against ``digest`` and/or the signature under
    ``verify_key`` (whose subject must be ``name`` at ``min_version`` or later, when given)
    before it is parsed; what vouched for it (see :class:`Verified`); and the signature.
    ``root_fd``: the artifact directory already open (see :func:`open_artifact`)."""
    if verify_key is None and (name is not None or min_version is not None):
        raise InputError("a required artifact name or least version is checked against the signature: pass the "
                         "key that signed it too (verify_key= / --verify-key)")
    if name is not None:
        check_subject_name(name, "the required artifact name (name= / --name)")
    if min_version is not None:
        check_subject_version(min_version, "the least version required (min_version= / --min-version)")
    root = Path(root)
    if root_fd is None:
        with open_artifact(root) as fd:
            return read_index(root, digest=digest, verify_key=verify_key, name=name, min_version=min_version,
                              root_fd=fd)
    index_path = root / INDEX_FILE
    try:
        os.stat(INDEX_FILE, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise ArtifactError(f"{root} has no {INDEX_FILE}: it was not written by this flatpack (or was stripped of its "
                            "index), so none of its files can be verified. Recompile the model with this version.") \
            from None
    # a FIFO, a device or a 6 GiB file in the index's place is refused before a byte is read
    raw = read_file(root_fd, root, INDEX_FILE, limit=MAX_INDEX_BYTES)
    trust = "directory"
    if digest is not None:
        check_digest(raw, digest, str(index_path))
        trust = "digest"
    signature = None
    if verify_key is not None:
        document = None
        try:
            os.stat(SIGNATURE_FILE, dir_fd=root_fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            document = read_file(root_fd, root, SIGNATURE_FILE, limit=MAX_SIGNATURE_BYTES)
        signature = check_signature(raw, document, verify_key, str(root), name=name, min_version=min_version)
        trust = "digest" if digest is not None else "signature"
    return Index.parse(raw, str(index_path)), trust, signature


def read_verified(root: str | os.PathLike, *, digest: str | None = None, verify_key: str | os.PathLike | None = None,
                  under: str | None = None, name: str | None = None, min_version: int | None = None) -> Verified:
    """Reads the artifact at ``root`` and checks it: the index against ``digest`` / the
    signature (and its subject against ``name`` and ``min_version``), then every file (or only
    those below ``under``, a stage directory) against the index — sizes (from ``fstat``, before
    reading), sha256, no symlinks at any component, no unlisted files, safetensors framing.
    Every file is read below one descriptor of ``root``. Nothing is imported or executed here."""
    root = Path(root)
    with open_artifact(root) as root_fd:
        index, trust, signature = read_index(root, digest=digest, verify_key=verify_key, name=name,
                                             min_version=min_version, root_fd=root_fd)
        present = set(_scan(root, root_fd, under)) - {INDEX_FILE, SIGNATURE_FILE}
        wanted = [listed for listed in index.files if under is None or listed.startswith(f"{under}/")]
        if under is not None and not wanted:
            raise ArtifactError(f"{root}/{INDEX_FILE} lists no files under {under}/; it is not a stage of this "
                                "artifact")
        unlisted = sorted(present - set(wanted))
        if unlisted:
            raise ArtifactError(f"{root / unlisted[0]} is not listed in {root}/{INDEX_FILE}; the artifact was altered. "
                                "Remove the file or recompile the model.")
        files = {}
        for listed in wanted:
            shown = str(root / listed)
            entry = index.files[listed]
            if not listed.endswith(".safetensors") and entry.size > MAX_TEXT_FILE_BYTES:
                raise ArtifactError(f"{root}/{INDEX_FILE} records {entry.size:,} bytes for {listed}, more than the "
                                    f"{MAX_TEXT_FILE_BYTES:,} any file of an artifact but its weights may have; the "
                                    "artifact is corrupted or hostile, recompile it")
            data = index.check(listed, read_file(root_fd, root, listed, limit=entry.size, size=entry.size), shown)
            if listed.endswith(".safetensors"):
                check_safetensors(data, shown)
            files[listed] = data
    return Verified(index, files, trust, signature)


def verify_files(index: Index, contents: Mapping[str, bytes], where: str) -> None:
    """Checks fetched files (relative path -> bytes, from a store or an image) against an
    index that was already checked against a digest."""
    for name, data in contents.items():
        index.check(name, data, f"{where}/{name}")
        if name.endswith(".safetensors"):
            check_safetensors(data, f"{where}/{name}")


# -- weights ---------------------------------------------------------------------------------

def check_safetensors(data: bytes, where: str, max_header_bytes: int = MAX_SAFETENSORS_HEADER_BYTES, *,
                      error: type[FlatpackError] = ArtifactError, size: int | None = None) -> dict[str, Any]:
    """Checks a safetensors buffer's framing before any parser sees it, as strictly as the
    safetensors parser itself, so that it never raises: the 8-byte little-endian header length
    is within the file and ``max_header_bytes``; the header is strict JSON (UTF-8, at most
    :data:`flatpack.safeio.MAX_JSON_DEPTH` deep, no duplicate keys), an object whose
    ``__metadata__``, if any, maps strings to strings; every tensor's dtype is known, its shape
    whole numbers whose product fits 64 bits, and its byte range matches dtype and shape; and
    the ranges, taken in order, tile the data section exactly (no overlap, no gap, no trailing
    bytes). Raises ``error`` (ArtifactError; InputError for a data shard) naming ``where``.
    ``size``: the file's size when ``data`` holds only its first bytes (the header). Returns
    the header."""
    size = len(data) if size is None else size
    if size < _HEADER_LEN.size or len(data) < _HEADER_LEN.size:
        raise error(f"{where} has {size} bytes, fewer than a safetensors header length: the file is "
                    "truncated. Recompile the model, or restore the file.")
    (header_len,) = _HEADER_LEN.unpack_from(data)
    if header_len > max_header_bytes:
        raise error(f"{where} claims a {header_len}-byte safetensors header, over the {max_header_bytes}-byte "
                    "limit: the file is corrupted or hostile. Recompile the model.")
    if _HEADER_LEN.size + header_len > min(size, len(data)):
        raise error(f"{where} claims a {header_len}-byte header but has {size} bytes: the file is "
                    "truncated. Recompile the model, or restore the file.")
    header = safeio.parse_json(data[_HEADER_LEN.size:_HEADER_LEN.size + header_len],
                               what=f"{where}'s safetensors header", error=error)
    if not isinstance(header, dict):
        raise error(f"{where}'s safetensors header is a JSON {type(header).__name__}, not an object; "
                    "recompile the model")
    body = size - _HEADER_LEN.size - header_len
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(entry, where, error)
            continue
        begin, end, needed = _tensor_range(name, entry, where, error)
        if not 0 <= begin <= end <= body:
            raise error(f"{where}: the tensor {name[:80]!r} claims bytes {begin}..{end} but the data "
                        f"section has {body} bytes: the file is truncated or hostile. Recompile the model.")
        if end - begin != needed:
            raise error(f"{where}: the tensor {name[:80]!r} ({entry['dtype']}, shape {entry['shape']}) needs "
                        f"{needed} bytes but its offsets span {end - begin}; recompile the model")
        ranges.append((begin, end, name))
    # the parser requires the ranges, in offset order, to cover the data section exactly
    covered = 0
    for begin, end, name in sorted(ranges):
        if begin != covered:
            how = "overlaps the tensor before it" if begin < covered else f"leaves bytes {covered}..{begin} unused"
            raise error(f"{where}: the tensor {name[:80]!r} (bytes {begin}..{end}) {how}; tensors must tile the "
                        "data section. The file is corrupted or hostile: recompile the model.")
        covered = end
    if covered != body:
        raise error(f"{where}: the tensors cover {covered} of the {body} bytes of the data section; the file has "
                    "trailing bytes. Recompile the model.")
    return header


def _check_metadata(entry: Any, where: str, error: type[FlatpackError]) -> None:
    if not isinstance(entry, dict):
        raise error(f"{where}: the safetensors header's __metadata__ is a JSON {type(entry).__name__}, not an "
                    "object of strings; recompile the model")
    for key, value in entry.items():
        if not isinstance(value, str):
            raise error(f"{where}: the safetensors header's __metadata__[{key[:80]!r}] is a JSON "
                        f"{type(value).__name__}, not a string; recompile the model")


def _tensor_range(name: str, entry: Any, where: str, error: type[FlatpackError]) -> tuple[int, int, int]:
    """A header entry's byte range and the bytes its dtype and shape need."""
    def malformed(why: str) -> FlatpackError:
        return error(f"{where}: the tensor {name[:80]!r} has a malformed entry in its safetensors header ({why}); "
                     "recompile the model")

    if not isinstance(entry, dict):
        raise malformed(f"a JSON {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
        raise malformed(f"dtype {str(dtype)[:40]!r} is not one of {', '.join(sorted(_DTYPE_BYTES))}")
    if not isinstance(shape, list) or not all(_whole(dim) for dim in shape):
        raise malformed("shape is not a list of whole numbers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole(offset) for offset in offsets):
        raise malformed("data_offsets is not [begin, end] in whole numbers")
    count = 1
    for dim in shape:
        count *= dim
        if count >= 1 << 64:   # the parser multiplies in 64 bits, in order, and refuses an overflow
            raise malformed(f"shape {shape} has more elements than 64 bits count")
    return offsets[0], offsets[1], count * _DTYPE_BYTES[dtype]


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64
