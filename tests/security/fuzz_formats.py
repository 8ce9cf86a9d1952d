"""Structural mutators for every file format flatpack reads from someone else, and a harness
that feeds each mutant to the format's public reader.

Shared by ``tests/security/test_fuzz_formats.py`` (a few hundred derandomized cases in CI)
and ``benchmarks/fuzz.py`` (tens of thousands). A case is one mutant of one format; its
outcome is ``refused`` (a :class:`~flatpack.errors.FlatpackError`), ``accepted`` (the reader
returned), ``traceback`` (any other exception: a bug), or, under a guard, a hang or a memory
blow-up. Mutations are structural where the format has a structure (a JSON node's type,
nesting depth, size, duplicate keys, NaN; a safetensors header's ranges, dtypes, metadata and
length prefix; a zip's declared sizes) and byte-level everywhere (truncation, flips,
insertions, a BOM, UTF-16, invalid UTF-8).
"""

from __future__ import annotations

import io
import json
import os
import random
import resource
import shutil
import signal
import struct
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import save as save_safetensors

from flatpack.errors import FlatpackError

INDEX, COMPILED, SIGNATURE = "flatpack.index.json", "flatpack.json", "flatpack.index.sig"
MANIFEST, WEIGHTS = "stage_000/manifest.json", "stage_001/weights.safetensors"
WEIGHTS_MANIFEST = "stage_001/manifest.json"   # records the weights' hash
HMAC_ENV = "FLATPACK_FUZZ_KEY"
HMAC_KEY = "fuzz-key-of-at-least-16-chars"
# depths around the readers' limit (64) and far past the interpreter's recursion limit
DEPTHS = (2, 63, 65, 1_000, 200_000)
_PLACEHOLDER = "\u0001flatpack-fuzz\u0001"
VALUES: tuple[Any, ...] = (None, True, False, 0, -1, 1, 7, 2**31, 2**63, 2**64 + 1, -(2**70), 1.5, -0.0, 1e308,
                           "", "x", "\u0000", "../../etc/passwd", "subprocess:Popen", "A" * 10_000, [], {}, [1, 2],
                           {"a": 1}, [[[]]], {"kind": None})
# JSON text Python's json turns into non-finite floats or lone surrogates
TEXTUAL = ("NaN", "Infinity", "-Infinity", "1e999", "-1e999", '"\\ud800"', '"\\u0000"',
           "123456789012345678901234567890")


# -- mutators --------------------------------------------------------------------------------

def byte_mutation(rng: random.Random, data: bytes) -> bytes:
    """One byte-level change: truncation, flips, insertion, deletion, duplication, an
    encoding change (BOM, UTF-16, invalid UTF-8) or garbage appended."""
    kind = rng.randrange(10)
    position = rng.randrange(len(data) + 1)
    if kind == 0:
        return data[:position]
    if kind == 1:
        mutable = bytearray(data or b"\0")
        for _ in range(rng.randint(1, 8)):
            mutable[rng.randrange(len(mutable))] ^= 1 << rng.randrange(8)
        return bytes(mutable)
    if kind == 2:
        return data[:position] + rng.randbytes(rng.randint(1, 64)) + data[position:]
    if kind == 3:
        return data[:position] + data[position + rng.randint(1, 64):]
    if kind == 4:
        return data[:position] + data[position:position + rng.randint(1, 256)] * rng.randint(2, 50) + data[position:]
    if kind == 5:
        return b"\xef\xbb\xbf" + data
    if kind == 6:
        return data.decode("utf-8", "replace").encode("utf-16")
    if kind == 7:
        return data[:position] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\x00"]) + data[position:]
    if kind == 8:
        return b""
    return data + rng.randbytes(rng.randint(1, 4096))


def _nodes(document: Any, limit: int = 4000) -> list[tuple[Any, ...]]:
    """Paths to the nodes of a JSON document, found without recursion (the first ``limit``)."""
    paths: list[tuple[Any, ...]] = [()]
    found: list[tuple[Any, ...]] = []
    while paths and len(found) < limit:
        path = paths.pop()
        found.append(path)
        node = _at(document, path)
        if isinstance(node, dict):
            paths.extend((*path, key) for key in node)
        elif isinstance(node, list):
            paths.extend((*path, index) for index in range(len(node)))
    return found


def _at(document: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        document = document[step]
    return document


def _replace(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _at(document, path[:-1])[path[-1]] = value
    return document


def deep(depth: int, rng: random.Random) -> str:
    """JSON text nested ``depth`` levels (arrays or objects)."""
    if rng.random() < 0.5:
        return "[" * depth + "0" + "]" * depth
    return '{"a":' * depth + "0" + "}" * depth


def json_mutation(rng: random.Random, text: bytes) -> bytes:
    """One structural change to a JSON document: a node's type or value, a key removed or
    added, a node nested deep, a non-finite number or lone surrogate, a key duplicated, a
    node made huge; then, one time in four, a byte-level change on top."""
    document = json.loads(text)
    path = rng.choice(_nodes(document))
    node = _at(document, path)
    kind = rng.randrange(8)
    inject: str | None = None
    if kind == 0:
        document = _replace(document, path, rng.choice(VALUES))
    elif kind == 1 and path:
        del _at(document, path[:-1])[path[-1]]
    elif kind == 2 and isinstance(node, dict):
        node[rng.choice(["extra", "__class__", "kind", "", "\u00e9", "files"])] = rng.choice(VALUES)
    elif kind == 3:
        document, inject = _replace(document, path, _PLACEHOLDER), deep(rng.choice(DEPTHS), rng)
    elif kind == 4:
        document, inject = _replace(document, path, _PLACEHOLDER), rng.choice(TEXTUAL)
    elif kind == 5 and isinstance(node, dict) and node:
        key = rng.choice(list(node))
        rest = json.dumps(node)[1:]
        document = _replace(document, path, _PLACEHOLDER)
        inject = "{" + json.dumps(key) + ":" + json.dumps(rng.choice(VALUES)) + ("," + rest if rest != "}" else "}")
    elif kind == 6:
        big = [0] * rng.choice([1_000, 100_000]) if rng.random() < 0.5 else "x" * rng.choice([10_000, 1 << 20])
        document = _replace(document, path, big)
    else:
        document = _replace(document, path, rng.choice(VALUES))
    out = json.dumps(document)
    if inject is not None:
        out = out.replace(json.dumps(_PLACEHOLDER), inject, 1)
    raw = out.encode("utf-8", "surrogatepass")
    return byte_mutation(rng, raw) if rng.random() < 0.25 else raw


def frame_safetensors(header: bytes, body: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + body


def safetensors_mutation(rng: random.Random, data: bytes) -> bytes:
    """One change to a safetensors file: its header's JSON (structurally, reframed with the
    right length), its tensors' ranges (overlapping, out of order, out of bounds, with gaps),
    dtypes, shapes or ``__metadata__``, the length prefix itself, or its bytes."""
    (length,) = struct.unpack_from("<Q", data)
    header, body = json.loads(data[8:8 + length]), data[8 + length:]
    tensors = [name for name in header if name != "__metadata__"]
    kind = rng.randrange(9)
    if kind == 0:
        return frame_safetensors(json_mutation(rng, data[8:8 + length]), body)
    if kind == 1 and tensors:      # overlap: one tensor's range moved onto another's
        first, second = rng.choice(tensors), rng.choice(tensors)
        header[second]["data_offsets"] = list(header[first]["data_offsets"])
    elif kind == 2 and len(tensors) > 1:   # swap two tensors' ranges
        first, second = rng.sample(tensors, 2)
        header[first]["data_offsets"], header[second]["data_offsets"] = \
            header[second]["data_offsets"], header[first]["data_offsets"]
    elif kind == 3 and tensors:
        entry = header[rng.choice(tensors)]
        begin, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[begin + 1, end + 1], [begin, end + 4], [end, begin], [0, 2**64 - 1],
                                            [-1, end], [begin, 1 << 62], [begin, end, 0], [str(begin), end]])
    elif kind == 4 and tensors:
        header[rng.choice(tensors)]["dtype"] = rng.choice(["F64", "I8", "BOOL", "F8_E8M0", "Q4", "", 7, None])
    elif kind == 5 and tensors:
        header[rng.choice(tensors)]["shape"] = rng.choice([[], [0], [2**40, 2**40, 0], [-1], [1.5], ["4"], [2**64],
                                                           [1] * 100, None])
    elif kind == 6:
        header["__metadata__"] = rng.choice([[1], 7, None, {"k": 1}, {"k": None}, {"k": "v"}, "text", {"": [""]}])
    elif kind == 7:
        prefix = rng.choice([0, 1, length - 1, length + 1, len(data), 2**63, 2**64 - 1, 100 * 1024 * 1024 + 1])
        return struct.pack("<Q", prefix) + data[8:]
    else:
        return byte_mutation(rng, data)
    return frame_safetensors(json.dumps(header).encode(), body)


def toml_mutation(rng: random.Random, text: bytes) -> bytes:
    """One change to a TOML config: deep arrays or inline tables, a duplicate key, a wrong type,
    an unknown option, broken syntax, a huge value; or its bytes."""
    kind = rng.randrange(8)
    depth = rng.choice(DEPTHS)
    if kind == 0:
        return text + b"\nbatch = " + ("[" * depth + "1" + "]" * depth).encode() + b"\n"
    if kind == 1:
        return text + b"\nx = " + ("{a = " * depth + "1" + "}" * depth).encode() + b"\n"
    if kind == 2:
        return text + text.splitlines()[0] + b"\n"
    if kind == 3:
        value = rng.choice(['"eight"', "1.5", "true", "[1, 2]", "{a = 1}", "nan", "inf", "-1", "1979-05-27"])
        return text + f"\nrepeats = {value}\n".encode()
    if kind == 4:
        return text + rng.choice([b"\nnot-an-option = 1\n", b"\n[table]\nx = 1\n", b"\n= 1\n", b"\nkey = \n",
                                  b'\nkey = "unterminated\n', b"\n[[a]]\n[a]\n"])
    if kind == 5:
        return text + b"\nsolver = \"" + b"x" * rng.choice([10, 100_000, 2 << 20]) + b"\"\n"
    return byte_mutation(rng, text)


def zip_mutation(rng: random.Random, data: bytes, *, npz: bool) -> bytes:
    """One change to a zip (``.npz`` or ``.pt``): a member's declared uncompressed size in the
    central directory forged (small, huge, past the shard limit), a member added that
    declares gigabytes, an ``.npy`` header claiming a huge shape, or bytes."""
    kind = rng.randrange(5)
    if kind == 0:
        return _forge_declared_size(data, rng.choice([0, 1, 2**31, 2**32 - 1]), rng)
    if kind == 1:
        return _with_bomb_member(data, rng)
    if kind == 2 and npz:
        buffer = io.BytesIO()
        shape = rng.choice([(2**40,), (2**20, 2**20), (-1,), (3,), (0,)])
        header = {"descr": rng.choice(["<f4", "|O", "<U10", "V8"]), "fortran_order": False, "shape": shape}
        with zipfile.ZipFile(buffer, "w") as archive:
            with archive.open("x.npy", "w") as member:
                np.lib.format.write_array_header_1_0(member, header)
                member.write(b"\0" * 16)
        return buffer.getvalue()
    return byte_mutation(rng, data)


def _forge_declared_size(data: bytes, size: int, rng: random.Random) -> bytes:
    """``data`` with one central-directory entry's uncompressed size set to ``size``."""
    mutable = bytearray(data)
    entries = [offset for offset in range(len(data) - 46) if data[offset:offset + 4] == b"PK\x01\x02"]
    if not entries:
        return data
    struct.pack_into("<I", mutable, rng.choice(entries) + 24, size)
    return bytes(mutable)


def _with_bomb_member(data: bytes, rng: random.Random) -> bytes:
    """``data`` (a zip) with a member added whose central directory declares 3 GiB: a few of
    them together pass the shard limit (the real inflation is tested in test_bounded_reader)."""
    buffer = io.BytesIO(data)
    try:
        with zipfile.ZipFile(buffer, "a") as archive:
            archive.writestr(f"bomb{rng.randrange(100)}.npy", b"\0" * 64)
    except (zipfile.BadZipFile, ValueError):
        return data
    return _forge_declared_size(buffer.getvalue(), 3 << 30, rng)


# -- formats and their readers ---------------------------------------------------------------

@dataclass
class Format:
    """A file format: a valid ``seed``, how to mutate it, and how to read a mutant with the
    format's public reader (``read`` returns normally or raises)."""

    name: str
    seed: bytes
    mutate: Callable[[random.Random, bytes], bytes]
    read: Callable[[bytes], object]

    def case(self, rng: random.Random) -> bytes:
        return self.mutate(rng, self.seed)


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class Workspace:
    """One saved artifact and the files each reader reads, restored after every case (so a
    case costs a few small writes, not a compile)."""

    def __init__(self, root: Path, compiled: Any | None = None) -> None:
        # imported here: the benchmark reports how long importing and compiling took
        import flatpack
        from flatpack.stage.integrity import sign_index

        self.root = root
        if compiled is None:
            compiled = flatpack.compile(small_model(), (torch.randn(4, 8),), stages=2)
        self.artifact = compiled.save(root / "artifact")
        os.environ[HMAC_ENV] = HMAC_KEY
        index = (self.artifact / INDEX).read_bytes()
        (self.artifact / SIGNATURE).write_bytes(sign_index(index, f"env:{HMAC_ENV}", name="fuzzed", version=1))
        self.pristine = {name: (self.artifact / name).read_bytes()
                         for name in (INDEX, COMPILED, SIGNATURE, MANIFEST, WEIGHTS, WEIGHTS_MANIFEST)}
        self.plan = compiled.plan.dumps().encode()
        self.files = root / "files"
        self.files.mkdir()

    def restore(self) -> None:
        for name, data in self.pristine.items():
            (self.artifact / name).write_bytes(data)

    def reindex(self) -> str:
        """A self-consistent index over the artifact's current files (what whoever can write
        the directory does), so the mutant reaches the parser behind the hashes."""
        from flatpack.stage.integrity import Index, sign_index

        files = {path.relative_to(self.artifact).as_posix(): path.read_bytes()
                 for path in sorted(self.artifact.rglob("*")) if path.is_file() and path.name not in (INDEX, SIGNATURE)}
        index = Index.build(files)
        (self.artifact / INDEX).write_bytes(index.raw)
        (self.artifact / SIGNATURE).write_bytes(sign_index(index.raw, f"env:{HMAC_ENV}", name="fuzzed", version=1))
        return index.digest

    def file(self, name: str, data: bytes) -> Path:
        path = self.files / name
        if path.is_dir():
            shutil.rmtree(path)
        path.write_bytes(data)
        return path


def formats(space: Workspace) -> list[Format]:
    """Every format flatpack reads from someone else, each with its reader."""
    import hashlib

    import flatpack
    from flatpack import cli
    from flatpack.data import ShardDirectory, read_shard
    from flatpack.partitioner.plan import Plan
    from flatpack.platform.calibration import Calibration
    from flatpack.rundir import RUN_FILE, RunDirectory, RunRecord

    def load(**trust: Any) -> object:
        try:
            return flatpack.load(space.artifact, **trust)
        finally:
            space.restore()

    def read_index(data: bytes) -> object:
        (space.artifact / INDEX).write_bytes(data)
        # with the mutant's own digest pinned half the time: the parser then sees every mutant
        return load(digest=hashlib.sha256(data).hexdigest()) if data[:1] != b"{" or len(data) % 2 else load()

    def behind_index(name: str) -> Callable[[bytes], object]:
        def read(data: bytes) -> object:
            (space.artifact / name).write_bytes(data)
            if name == WEIGHTS:   # the manifest's own hash of the weights, as an attacker would fix it
                manifest = json.loads(space.pristine[WEIGHTS_MANIFEST])
                manifest["files"]["weights.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                                            "bytes": len(data)}
                (space.artifact / WEIGHTS_MANIFEST).write_text(json.dumps(manifest, indent=2))
            return load(digest=space.reindex())
        return read

    def read_signature(data: bytes) -> object:
        (space.artifact / SIGNATURE).write_bytes(data)
        return load(verify_key=f"env:{HMAC_ENV}")

    def read_run(data: bytes) -> object:
        run_dir = space.files / "run"
        run_dir.mkdir(exist_ok=True)
        (run_dir / RUN_FILE).write_bytes(data)
        return RunDirectory(run_dir).read()

    def read_plan(data: bytes) -> object:
        path = space.file("plan.json", data)
        # the reader `flatpack compile --plan FILE` calls (Plan.load where the plan reader has one)
        reader = getattr(Plan, "load", None)
        return reader(path) if reader is not None else Plan.loads(path.read_text())

    def read_calibration(data: bytes) -> object:
        return Calibration.load(space.file("calibration.json", data))

    plan_parser = _subparser(cli.build_parser(), "plan")

    def read_config(data: bytes) -> object:
        return cli.config_defaults(str(space.file("config.toml", data)), plan_parser)

    def read_shards(suffix: str) -> Callable[[bytes], object]:
        def read(data: bytes) -> object:
            name = f"shard{suffix}"
            shards = space.files / "shards"
            shards.mkdir(exist_ok=True)
            (shards / name).write_bytes(data)
            ShardDirectory(shards).columns(name)
            return read_shard(shards / name, name)
        return read

    tensors = {"input": torch.randn(6, 8), "target": torch.randint(0, 4, (6,))}
    pt = io.BytesIO()
    torch.save(tensors, pt)
    npz = io.BytesIO()
    np.savez_compressed(npz, input=tensors["input"].numpy(), target=tensors["target"].numpy())
    run = RunRecord(run="fuzz", loss="cross_entropy", iterations=3).dumps().encode()

    return [
        Format("index", space.pristine[INDEX], json_mutation, read_index),
        Format("flatpack.json", space.pristine[COMPILED], json_mutation, behind_index(COMPILED)),
        Format("manifest.json", space.pristine[MANIFEST], json_mutation, behind_index(MANIFEST)),
        Format("weights.safetensors", space.pristine[WEIGHTS], safetensors_mutation, behind_index(WEIGHTS)),
        Format("index.sig", space.pristine[SIGNATURE], json_mutation, read_signature),
        Format("run.json", run, json_mutation, read_run),
        Format("plan", space.plan, json_mutation, read_plan),
        Format("calibration", _calibration_seed(), json_mutation, read_calibration),
        Format("config.toml", b'solver = "dp"\nbatch = 8\nrepeats = 2\n', toml_mutation, read_config),
        Format("shard.safetensors", save_safetensors(tensors), safetensors_mutation, read_shards(".safetensors")),
        Format("shard.pt", pt.getvalue(), lambda rng, data: zip_mutation(rng, data, npz=False), read_shards(".pt")),
        Format("shard.npz", npz.getvalue(), lambda rng, data: zip_mutation(rng, data, npz=True), read_shards(".npz")),
    ]


def _subparser(parser: Any, verb: str) -> Any:
    from flatpack.cli.parser import verb_parsers

    return verb_parsers(parser)[verb]


def _calibration_seed() -> bytes:
    from flatpack.ir.profile import Linear
    from flatpack.platform.calibration import Calibration, TierCalibration

    tiers = {1024: TierCalibration((Linear(0.01, 0.1), Linear(0.02, 0.0)), (Linear(0.02, 0.2), Linear(0.04, 0.0)),
                                   bandwidth_bytes_s=25e6)}
    calibration = Calibration(platform="aws-lambda", layer_names=("a", "b"), tiers=tiers, graph_hash="abc123",
                              storage_latency_s=0.03, overlap_slowdown=1.1, provenance={"measured": "2026-11-20"})
    return (json.dumps(calibration.to_json(), indent=2) + "\n").encode()


def outcome(fmt: Format, data: bytes) -> tuple[str, str]:
    """``("accepted", "")``, ``("refused", message)`` or ``("traceback", "Type: message")``."""
    try:
        fmt.read(data)
    except FlatpackError as err:
        return "refused", str(err)
    except Hang:
        raise
    except Exception as err:  # noqa: BLE001 - what the fuzzer looks for: anything but a flatpack error
        return "traceback", f"{type(err).__name__}: {str(err)[:160]}"
    return "accepted", ""


class Hang(Exception):
    """A case ran past its time bound (raised from SIGALRM)."""


@dataclass(frozen=True)
class Result:
    kind: str          # accepted, refused, traceback or hang
    message: str
    seconds: float
    rss_growth: int    # bytes the process's peak RSS grew by during the case


def peak_rss() -> int:
    """The process's peak resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def guarded(fmt: Format, data: bytes, *, seconds: int = 5) -> Result:
    """:func:`outcome` under a SIGALRM time bound, with the case's time and peak-RSS growth."""
    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"{fmt.name}: the reader ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    before, start = peak_rss(), time.monotonic()
    signal.alarm(seconds)
    try:
        kind, message = outcome(fmt, data)
    except Hang as err:
        kind, message = "hang", str(err)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return Result(kind, message, time.monotonic() - start, peak_rss() - before)
