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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from flatpack import safeio
from flatpack.errors import ArtifactError, FlatpackError

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
# An index lists a few files per stage (~150 bytes each): 16 MiB is over 100,000 files. A
# signature document is under 300 bytes.
MAX_INDEX_BYTES = 16 * safeio.MiB
MAX_SIGNATURE_BYTES = 64 * 1024
# Every other file but the weights (flatpack.json, plan.json, a manifest, stage.py) is text flatpack
# wrote: a few MiB for the largest model. Weights are bounded by the size the index records.
MAX_TEXT_FILE_BYTES = 256 * safeio.MiB
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
    document = safeio.parse_json(signature_doc, what=f"{where}/{SIGNATURE_FILE}", error=ArtifactError)
    try:
        algorithm, signature = document["algorithm"], bytes.fromhex(document["signature"])
        if not isinstance(algorithm, str):
            raise TypeError(algorithm)
    except (ValueError, KeyError, TypeError):
        raise ArtifactError(f"{where}/{SIGNATURE_FILE} is malformed (an object with a string 'algorithm' and a hex "
                            "'signature' expected); sign the artifact again") from None
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


def read_index(root: str | os.PathLike, *, digest: str | None = None,
               verify_key: str | os.PathLike | None = None, root_fd: int | None = None) -> tuple[Index, str]:
    """The artifact's index, checked against ``digest`` and/or the signature under
    ``verify_key`` before it is parsed; and what vouched for it (see :class:`Verified`).
    ``root_fd``: the artifact directory already open (see :func:`open_artifact`)."""
    root = Path(root)
    if root_fd is None:
        with open_artifact(root) as fd:
            return read_index(root, digest=digest, verify_key=verify_key, root_fd=fd)
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
    if verify_key is not None:
        signature = None
        try:
            os.stat(SIGNATURE_FILE, dir_fd=root_fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            signature = read_file(root_fd, root, SIGNATURE_FILE, limit=MAX_SIGNATURE_BYTES)
        check_signature(raw, signature, verify_key, str(root))
        trust = "digest" if digest is not None else "signature"
    return Index.parse(raw, str(index_path)), trust


def read_verified(root: str | os.PathLike, *, digest: str | None = None, verify_key: str | os.PathLike | None = None,
                  under: str | None = None) -> Verified:
    """Reads the artifact at ``root`` and checks it: the index against ``digest`` / the
    signature, then every file (or only those below ``under``, a stage directory) against the
    index — sizes (from ``fstat``, before reading), sha256, no symlinks at any component, no
    unlisted files, safetensors framing. Every file is read below one descriptor of ``root``.
    Nothing is imported or executed here."""
    root = Path(root)
    with open_artifact(root) as root_fd:
        index, trust = read_index(root, digest=digest, verify_key=verify_key, root_fd=root_fd)
        present = set(_scan(root, root_fd, under)) - {INDEX_FILE, SIGNATURE_FILE}
        wanted = [name for name in index.files if under is None or name.startswith(f"{under}/")]
        if under is not None and not wanted:
            raise ArtifactError(f"{root}/{INDEX_FILE} lists no files under {under}/; it is not a stage of this "
                                "artifact")
        unlisted = sorted(present - set(wanted))
        if unlisted:
            raise ArtifactError(f"{root / unlisted[0]} is not listed in {root}/{INDEX_FILE}; the artifact was altered. "
                                "Remove the file or recompile the model.")
        files = {}
        for name in wanted:
            shown = str(root / name)
            entry = index.files[name]
            if not name.endswith(".safetensors") and entry.size > MAX_TEXT_FILE_BYTES:
                raise ArtifactError(f"{root}/{INDEX_FILE} records {entry.size:,} bytes for {name}, more than the "
                                    f"{MAX_TEXT_FILE_BYTES:,} any file of an artifact but its weights may have; the "
                                    "artifact is corrupted or hostile, recompile it")
            data = index.check(name, read_file(root_fd, root, name, limit=entry.size, size=entry.size), shown)
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
