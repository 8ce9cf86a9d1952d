"""The artifact's one integrity root: ``flatpack.index.json`` and its digest.

An artifact is code a worker executes, so every file of it (``flatpack.json``, ``plan.json``
and each stage's ``stage.py``, weights and manifest) is listed in one index with its size and
sha256. The index is canonical JSON (sorted keys, no spaces), so its sha256 — the artifact's
**digest** — is stable; ``Compiled.digest`` returns it and ``flatpack compile`` prints it.

Trust comes from outside the artifact: a digest the caller pins (``load(dir, digest=...)``,
``deploy(..., digest=...)``, a worker's invocation payload) or a signature over the index
checked with a key the caller holds (``flatpack sign`` / ``--verify-key``: Ed25519 through
``cryptography``, or HMAC-SHA256 with a key from an environment variable). Without either,
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
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from flatpack.errors import ArtifactError

INDEX_FILE = "flatpack.index.json"
SIGNATURE_FILE = "flatpack.index.sig"
INDEX_KIND = "flatpack-index"
INDEX_SCHEMA_VERSION = 1
# What a signature signs: a domain tag, so an index signature is never valid for anything else.
_SIGNED_PREFIX = b"flatpack-index-v1\0"
ED25519 = "ed25519"
HMAC_SHA256 = "hmac-sha256"
ENV_KEY_PREFIX = "env:"

# safetensors itself refuses headers above 100 MB; a stage's header (names, dtypes, shapes,
# offsets) is far below it, so a larger claim means the bytes are not flatpack's.
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024
_HEADER_LEN = struct.Struct("<Q")
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
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
        try:
            document = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise ArtifactError(f"{where} is not valid JSON ({err}); the artifact is corrupted, recompile it") from None
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

def _hmac_key(spec: str, purpose: str) -> bytes:
    name = spec[len(ENV_KEY_PREFIX):]
    value = os.environ.get(name, "")
    if not name or len(value) < 16:
        raise ArtifactError(f"{purpose} with HMAC needs a key of at least 16 characters in the environment variable "
                            f"{name or '<empty name>'} ({spec!r}); set it on the machines that sign and verify")
    return value.encode()


def sign_index(raw: bytes, key: str | os.PathLike) -> bytes:
    """A signature document for the index bytes ``raw``: with ``env:NAME``, HMAC-SHA256 with the
    key in that environment variable; else ``key`` is an Ed25519 private key file (PEM, as
    ``openssl genpkey -algorithm ed25519`` writes)."""
    message = _SIGNED_PREFIX + raw
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
    document = {"algorithm": algorithm, "index_sha256": sha256_hex(raw), "signature": signature}
    return (json.dumps(document, sort_keys=True, indent=2) + "\n").encode()


def check_signature(raw: bytes, signature_doc: bytes | None, verify_key: str | os.PathLike, where: str) -> None:
    """Raises unless ``signature_doc`` signs the index bytes ``raw`` under ``verify_key``
    (``env:NAME`` for HMAC, else an Ed25519 public key file in PEM)."""
    if signature_doc is None:
        raise ArtifactError(f"{where} has no {SIGNATURE_FILE} but a verify key was given: the artifact is unsigned. "
                            "Sign it with `flatpack sign DIR --key KEY` where it was built.")
    try:
        document = json.loads(signature_doc)
        algorithm, signature = document["algorithm"], bytes.fromhex(document["signature"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise ArtifactError(f"{where}/{SIGNATURE_FILE} is malformed; sign the artifact again") from None
    message = _SIGNED_PREFIX + raw
    if str(verify_key).startswith(ENV_KEY_PREFIX):
        expected = hmac.new(_hmac_key(str(verify_key), "verifying"), message, hashlib.sha256).digest()
        valid = algorithm == HMAC_SHA256 and hmac.compare_digest(expected, signature)
    else:
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
        valid = algorithm == ED25519
        try:
            public.verify(signature, message)
        except InvalidSignature:
            valid = False
    if not valid:
        raise ArtifactError(f"{where}/{SIGNATURE_FILE} is not a valid {algorithm} signature of {where}/{INDEX_FILE} "
                            f"under the key {verify_key}: the index was altered, or signed with another key. Do not "
                            "run this artifact; rebuild and sign it, or pass the right key.")


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

    @property
    def digest(self) -> str:
        return self.index.digest


def _read_regular(path: Path, shown: str) -> bytes:
    """The file's bytes, refusing a symlink or anything but a regular file (no following)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise ArtifactError(f"{shown} is missing; the artifact is incomplete. Recompile the model.") from None
    except OSError as err:
        if path.is_symlink():
            raise ArtifactError(f"{shown} is a symbolic link; an artifact's files must be regular files inside it. "
                                "Replace the link with the file, or recompile.") from None
        raise ArtifactError(f"cannot read {shown}: {err}") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise ArtifactError(f"{shown} is not a regular file; recompile the model")
        return file.read()


def _scan(root: Path, under: str | None) -> list[str]:
    """Relative paths of the files below ``root`` (or its subdirectory ``under``); refuses
    symbolic links and anything that is neither a file nor a directory."""
    start = root / under if under else root
    if start.is_symlink():
        raise ArtifactError(f"{start} is a symbolic link; an artifact's files must be inside it. Recompile.")
    found = []
    for current, dirs, files in os.walk(start, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(current) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise ArtifactError(f"{path} is a symbolic link; an artifact's files must be regular files inside "
                                    "it. Replace the link with the file, or recompile.")
            if stat.S_ISREG(mode):
                found.append(path.relative_to(root).as_posix())
            elif not stat.S_ISDIR(mode):
                raise ArtifactError(f"{path} is not a regular file; remove it from the artifact")
    return found


def read_index(root: str | os.PathLike, *, digest: str | None = None,
               verify_key: str | os.PathLike | None = None) -> tuple[Index, str]:
    """The artifact's index, checked against ``digest`` and/or the signature under
    ``verify_key`` before it is parsed; and what vouched for it (see :class:`Verified`)."""
    root = Path(root)
    index_path = root / INDEX_FILE
    if not index_path.exists() and not index_path.is_symlink():
        raise ArtifactError(f"{root} has no {INDEX_FILE}: it was not written by this flatpack (or was stripped of its "
                            "index), so none of its files can be verified. Recompile the model with this version.")
    raw = _read_regular(index_path, str(index_path))
    trust = "directory"
    if digest is not None:
        check_digest(raw, digest, str(index_path))
        trust = "digest"
    if verify_key is not None:
        signature_path = root / SIGNATURE_FILE
        signature = _read_regular(signature_path, str(signature_path)) if signature_path.exists() else None
        check_signature(raw, signature, verify_key, str(root))
        trust = "digest" if digest is not None else "signature"
    return Index.parse(raw, str(index_path)), trust


def read_verified(root: str | os.PathLike, *, digest: str | None = None, verify_key: str | os.PathLike | None = None,
                  under: str | None = None) -> Verified:
    """Reads the artifact at ``root`` and checks it: the index against ``digest`` / the
    signature, then every file (or only those below ``under``, a stage directory) against the
    index — sizes, sha256, no symlinks, no unlisted files, safetensors headers in bounds.
    Nothing is imported or executed here."""
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"{root} is not a directory; pass the directory `flatpack compile --out` wrote")
    index, trust = read_index(root, digest=digest, verify_key=verify_key)
    present = set(_scan(root, under)) - {INDEX_FILE, SIGNATURE_FILE}
    wanted = [name for name in index.files if under is None or name.startswith(f"{under}/")]
    if under is not None and not wanted:
        raise ArtifactError(f"{root}/{INDEX_FILE} lists no files under {under}/; it is not a stage of this artifact")
    unlisted = sorted(present - set(wanted))
    if unlisted:
        raise ArtifactError(f"{root / unlisted[0]} is not listed in {root}/{INDEX_FILE}; the artifact was altered. "
                            "Remove the file or recompile the model.")
    files = {}
    for name in wanted:
        shown = str(root / name)
        data = index.check(name, _read_regular(root / name, shown), shown)
        if name.endswith(".safetensors"):
            check_safetensors(data, shown)
        files[name] = data
    return Verified(index, files, trust)


def verify_files(index: Index, contents: Mapping[str, bytes], where: str) -> None:
    """Checks fetched files (relative path -> bytes, from a store or an image) against an
    index that was already checked against a digest."""
    for name, data in contents.items():
        index.check(name, data, f"{where}/{name}")
        if name.endswith(".safetensors"):
            check_safetensors(data, f"{where}/{name}")


# -- weights ---------------------------------------------------------------------------------

def check_safetensors(data: bytes, where: str, max_header_bytes: int = MAX_SAFETENSORS_HEADER_BYTES) -> None:
    """Checks a safetensors buffer's framing before any parser sees it: the 8-byte
    little-endian header length is within the file and ``max_header_bytes``, the header is a
    JSON object, and every tensor's byte range lies inside the data section and matches its
    dtype and shape. Raises ArtifactError naming ``where``."""
    if len(data) < _HEADER_LEN.size:
        raise ArtifactError(f"{where} has {len(data)} bytes, fewer than a safetensors header length: the file is "
                            "truncated. Recompile the model, or restore the file.")
    (header_len,) = _HEADER_LEN.unpack_from(data)
    if header_len > max_header_bytes:
        raise ArtifactError(f"{where} claims a {header_len}-byte safetensors header, over the {max_header_bytes}-byte "
                            "limit: the file is corrupted or hostile. Recompile the model.")
    if _HEADER_LEN.size + header_len > len(data):
        raise ArtifactError(f"{where} claims a {header_len}-byte header but has {len(data)} bytes: the file is "
                            "truncated. Recompile the model, or restore the file.")
    try:
        header = json.loads(data[_HEADER_LEN.size:_HEADER_LEN.size + header_len])
    except (ValueError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{where}'s safetensors header is not valid JSON ({err}); recompile the model") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{where}'s safetensors header is not a JSON object; recompile the model")
    body = len(data) - _HEADER_LEN.size - header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            count = 1
            for dim in shape:
                if not isinstance(dim, int) or dim < 0:
                    raise ValueError(dim)
                count *= dim
            width = _DTYPE_BYTES[dtype]
            if not (isinstance(begin, int) and isinstance(end, int)):
                raise ValueError((begin, end))
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(f"{where}: the tensor {str(name)[:80]!r} has a malformed entry in its safetensors "
                                "header; recompile the model") from None
        if not 0 <= begin <= end <= body:
            raise ArtifactError(f"{where}: the tensor {str(name)[:80]!r} claims bytes {begin}..{end} but the data "
                                f"section has {body} bytes: the file is truncated or hostile. Recompile the model.")
        if end - begin != count * width:
            raise ArtifactError(f"{where}: the tensor {str(name)[:80]!r} ({dtype}, shape {shape}) needs "
                                f"{count * width} bytes but its offsets span {end - begin}; recompile the model")
