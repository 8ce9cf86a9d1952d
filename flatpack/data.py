"""Data in: where a run's batches come from (``flatpack run --data SOURCE``, or a
``DataLoader`` from Python), parsed once at the edge and checked before any process starts.

A :class:`DataSource` is one of

* :class:`ShardDirectory`: a directory of shards, ``*.safetensors``, ``*.pt`` (tensors saved
  with ``torch.save``, read with ``torch.load(weights_only=True)``) or ``*.npz``, each read
  as a bounded regular file and checked before a parser sees it (:func:`check_shard`: size,
  safetensors framing, a zip's declared sizes; ``tests/security/test_bounded_reader.py``);
* :class:`S3Shards`: the same shards under an ``s3://bucket/prefix`` (any S3-compatible
  endpoint; credentials from the standard AWS environment variables);
* :class:`DatasetFactory`: ``package.module:factory`` or ``file.py:factory`` returning a
  ``torch.utils.data.Dataset`` (map-style: shuffled by index) or ``IterableDataset``;
* :class:`LoaderSource`: a ``torch.utils.data.DataLoader`` (the Python API), its batches as given.
* :class:`SyntheticSource`: random batches shaped like the model's example, each drawn when it
  is asked for (``flatpack run`` without ``--data``).

A shard holds named tensors with one row per sample: the target under ``target`` (or
``targets``/``y``), the inputs under the model's argument names (``input_ids``,
``attention_mask``, ``labels``... for a keyword-input model such as HuggingFace's; a
one-input model may use any one name). A ``.pt`` shard may also be an ``(inputs, target)``
pair of tensors. A shard without a target is accepted only when the model computes its own
loss (``labels`` among the inputs).

:func:`make_batches` turns a source into :class:`Batches`: a function of the iteration
(what ``Deployment.train`` takes) that builds each global batch when it is asked for, so a
dataset is never loaded whole: it keeps the shards of the current batch and loads the next
batch's shards in a background thread while the pipeline trains (the runtime already uploads
batches ahead of the first stage through the store, and each replica reads only its own
micro-batches there). Epochs iterate the data again; ``shuffle`` permutes the shard order and
the rows within each shard per epoch, seeded by ``seed`` and the epoch; ``drop_last`` drops
the final partial batch of an epoch (a run's batches must all have one size: the plan cuts
each into fixed micro-batches). Tests: ``tests/unit/test_data.py``,
``tests/integration/test_data_run.py``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import inspect
import json
import io
import math
import os
import sys
import threading
import zipfile
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, ClassVar, Iterator, Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree
from safetensors.torch import load as load_safetensors
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from flatpack import safeio
from flatpack.errors import InputError
from flatpack.factories import import_factory
from flatpack.rundir import file_fingerprint
from flatpack.runtime.store import S3Store
from flatpack.stage.integrity import MAX_SAFETENSORS_HEADER_BYTES, check_safetensors
from flatpack.stage.tensor_check import TensorSpec, check_tensor

SHARD_SUFFIXES = (".safetensors", ".pt", ".npz")
# A shard is read whole into memory and a few are kept for the batches in flight: 4 GiB
# (file, or a zip's members uncompressed) is far above the hundreds of MiB shards usually
# are, and far below what would take a machine's memory.
MAX_SHARD_BYTES = 4 << 30
MAX_SHARD_MEMBERS = 100_000
MAX_NPY_HEADER = 10_000   # numpy's own default limit for a .npy header
TARGET_KEYS = ("target", "targets", "y")
# the model computes its own loss from these inputs (HuggingFace's convention)
OWN_LOSS_INPUTS = ("labels",)


@dataclass(frozen=True)
class Column:
    """One named tensor of every sample: its shape without the batch dimension and dtype."""

    shape: tuple[int, ...]
    dtype: str


Schema = dict[str, Column]


# -- reading one shard -------------------------------------------------------------------------

def _as_named(loaded: Any, where: str) -> dict[str, torch.Tensor]:
    """A ``.pt`` shard's content as named tensors: a dict, or an ``(inputs, target)`` pair."""
    if isinstance(loaded, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
        return dict(loaded)
    if isinstance(loaded, (tuple, list)) and len(loaded) == 2 and all(isinstance(v, torch.Tensor) for v in loaded):
        return {"input": loaded[0], "target": loaded[1]}
    raise InputError(f"shard {where} holds a {type(loaded).__name__}; a .pt shard must be a dict of named tensors "
                     "(torch.save({'input_ids': ..., 'labels': ...}, path)) or an (inputs, target) pair of tensors")


def read_shard(data: bytes | Path, name: str) -> dict[str, torch.Tensor]:
    """All tensors of a shard (a file or its bytes); ``name`` gives the format by its suffix.
    The bytes are checked before a parser sees them (:func:`check_shard`), so a hostile or
    corrupt shard is an InputError naming it, never a traceback or a memory blow-up."""
    if not name.endswith(SHARD_SUFFIXES):
        raise InputError(f"shard {name} is not one of {', '.join(SHARD_SUFFIXES)}")
    if isinstance(data, Path):
        # a regular file of bounded size, its size from fstat before a byte is read
        data = safeio.read_bounded(data, limit=MAX_SHARD_BYTES, what=f"shard {name}")
    check_shard(data, name)
    try:
        if name.endswith(".safetensors"):
            return load_safetensors(data)
        if name.endswith(".pt"):
            return _as_named(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"), name)
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return {key: torch.from_numpy(np.ascontiguousarray(archive[key])) for key in archive.files}
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 - a corrupt or foreign file: name it and the cause
        raise InputError(f"cannot read shard {name}: {type(err).__name__}: {err}") from None


def check_shard(data: bytes, name: str) -> None:
    """Refuses, before any parser sees it, a shard whose bytes could make one raise from deep
    inside or allocate without bound: more than :data:`MAX_SHARD_BYTES`; a safetensors file
    whose framing does not hold (:func:`~flatpack.stage.integrity.check_safetensors`); a
    ``.npz`` (or a ``.pt``, a zip too) whose members declare more than
    :data:`MAX_SHARD_BYTES` uncompressed, one by one or together, or whose ``.npy`` headers
    claim arrays larger than their members. The zip directory's sizes are read, nothing is
    decompressed: a 6 MiB zip bomb that would inflate to 6 GiB costs nothing."""
    check_shard_size(len(data), name)
    if name.endswith(".safetensors"):
        check_safetensors(data, f"shard {name}", error=InputError)
    elif name.endswith(".npz"):
        _check_zip(io.BytesIO(data), name, npy=True)
    elif name.endswith(".pt") and zipfile.is_zipfile(io.BytesIO(data)):
        # torch.save writes a zip (a legacy .pt is a plain pickle stream, which weights_only reads bounded)
        _check_zip(io.BytesIO(data), name, npy=False)


def check_shard_size(size: int, name: str) -> None:
    """Refuses a shard of more than :data:`MAX_SHARD_BYTES` (a file's size from ``fstat``, or
    the bytes an S3 get returned)."""
    if size > MAX_SHARD_BYTES:
        raise InputError(f"shard {name} has {size:,} bytes, more than the {MAX_SHARD_BYTES:,} a shard may have; "
                         "split the data into smaller shards")


def _check_zip(source: IO[bytes], name: str, *, npy: bool) -> None:
    """A zip's directory (and its ``.npy`` headers) against the limits; reads only those."""
    try:
        with zipfile.ZipFile(source) as archive:
            members = archive.infolist()
            if len(members) > MAX_SHARD_MEMBERS:
                raise InputError(f"shard {name} holds {len(members):,} members, more than the {MAX_SHARD_MEMBERS:,} "
                                 "a shard may have; store fewer, larger arrays per shard")
            total = 0
            for member in members:
                # the size the zip directory declares; zipfile never inflates a member past it
                if member.file_size > MAX_SHARD_BYTES:
                    raise InputError(f"shard {name}: the member {member.filename[:80]!r} declares "
                                     f"{member.file_size:,} bytes uncompressed, more than the {MAX_SHARD_BYTES:,} a "
                                     "shard may hold; split the data into smaller shards")
                total += member.file_size
                if total > MAX_SHARD_BYTES:
                    raise InputError(f"shard {name}: its members declare {total:,}+ bytes uncompressed together, "
                                     f"more than the {MAX_SHARD_BYTES:,} a shard may hold (a zip bomb, or data to "
                                     "split into smaller shards)")
            # every size first: a header is inflated to be read, and only within the limits
            for member in members:
                if npy and member.filename.endswith(".npy"):
                    _check_npy_header(archive, member, name)
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 - zipfile's and numpy's many errors for a corrupt archive
        raise InputError(f"cannot read shard {name}: it is not a valid {'.npz' if npy else '.pt'} archive "
                         f"({type(err).__name__}: {err})") from None


def _check_npy_header(archive: zipfile.ZipFile, member: zipfile.ZipInfo, name: str) -> None:
    """An array's ``.npy`` header against its member's declared size: numpy allocates the
    shape the header claims before it reads the data, so a header claiming more than the
    member holds is refused here instead of allocated there."""
    with archive.open(member) as stream:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(stream, max_header_size=MAX_NPY_HEADER)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(stream, max_header_size=MAX_NPY_HEADER)
        else:
            raise InputError(f"shard {name}: the array {member.filename[:80]!r} has .npy format version {version}, "
                             "not 1.0 or 2.0; save it with numpy.savez")
        header_end = stream.tell()
    if dtype.hasobject:
        raise InputError(f"shard {name}: the array {member.filename[:80]!r} holds Python objects, which are never "
                         "unpickled; store numeric arrays")
    needed = math.prod(shape) * dtype.itemsize
    if needed > member.file_size - header_end:
        raise InputError(f"shard {name}: the array {member.filename[:80]!r} claims shape {shape} of {dtype} "
                         f"({needed:,} bytes) but its member holds {member.file_size - header_end:,}; the file is "
                         "corrupted or hostile")


def _safetensors_columns(file: IO[bytes], size: int, name: str) -> dict[str, _Shape]:
    """A safetensors shard's tensors as shapes and dtypes, from its header alone: the framing
    is checked (:func:`~flatpack.stage.integrity.check_safetensors`) on the header and the
    file's size, without reading the data section."""
    head = file.read(8)
    header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
    if header_len <= MAX_SAFETENSORS_HEADER_BYTES:
        head += file.read(header_len)
    header = check_safetensors(head, f"shard {name}", error=InputError, size=size)
    return {key: _Shape(entry["shape"], entry["dtype"]) for key, entry in header.items() if key != "__metadata__"}


class _Shape:
    """A safetensors tensor seen as far as :func:`shard_schema` looks: shape and dtype."""

    _DTYPES: ClassVar[dict[str, str]] = {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
        "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}

    def __init__(self, shape: list[int], dtype: str) -> None:
        self.shape = tuple(shape)
        self.dtype = "torch." + self._DTYPES.get(dtype, dtype.lower())

    def dim(self) -> int:
        return len(self.shape)


def shard_schema(tensors: dict[str, Any], name: str) -> tuple[int, Schema]:
    """A shard's rows and columns; every tensor must have the same first dimension."""
    if not tensors:
        raise InputError(f"shard {name} holds no tensors")
    rows = {key: int(value.shape[0]) if value.dim() else None for key, value in tensors.items()}
    if None in rows.values() or len(set(rows.values())) != 1:
        raise InputError(f"shard {name}: every tensor needs one row per sample (the same first dimension), got "
                         + ", ".join(f"{key} {tuple(value.shape)}" for key, value in tensors.items()))
    schema = {key: Column(tuple(value.shape[1:]), str(value.dtype).removeprefix("torch."))
              for key, value in tensors.items()}
    count = next(iter(rows.values()))
    assert count is not None  # refused above: a tensor without a first dimension
    return count, schema


# -- sources -----------------------------------------------------------------------------------

class DataSource(ABC):
    """Where a run's samples come from. ``to_json`` is what the run directory records so
    that ``flatpack resume`` reads the same data again instead of a copy of it."""

    kind: str

    @abstractmethod
    def describe(self) -> str: ...

    def to_json(self) -> dict[str, Any] | None:
        """The source as ``run.json`` records it; None: it cannot be reopened by name (a
        DataLoader), so the run directory keeps its batches."""
        return None

    def fingerprint(self) -> dict[str, Any] | None:
        """What the run trained on, cheap and deterministic to take again: ``run.json`` keeps
        it and ``flatpack resume`` refuses data that changed since (None: nothing to check,
        the batches themselves are kept in the run directory)."""
        return None


class ShardSource(DataSource):
    """Shards of named tensors; subclasses list them and read one."""

    def __init__(self) -> None:
        self._shards: list[tuple[str, int]] | None = None
        self._schema: Schema | None = None

    @abstractmethod
    def names(self) -> list[str]: ...

    @abstractmethod
    def read(self, name: str) -> dict[str, torch.Tensor]: ...

    def shard_fingerprints(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Each shard's size and content hash (sha256, or the store's ETag), by name."""
        raise NotImplementedError(f"{type(self).__name__} cannot fingerprint its shards")

    def fingerprint(self) -> dict[str, Any]:
        """The shards' names, sizes and content hashes: a shard added, removed or changed
        (even with the same shapes) shows."""
        return {"kind": "shards", "files": self.shard_fingerprints(self.names())}

    def columns(self, name: str) -> tuple[int, Schema]:
        """A shard's rows and columns (by default from reading it whole)."""
        return shard_schema(self.read(name), name)

    def scan(self) -> tuple[list[tuple[str, int]], Schema]:
        """Every shard's rows, after checking that all have the first shard's columns
        (names, shapes beyond the batch dimension, dtypes). Reads each shard once."""
        if self._shards is not None and self._schema is not None:
            return self._shards, self._schema
        names = self.names()
        shards: list[tuple[str, int]] = []
        schema: Schema | None = None
        for name in names:
            rows, columns = self.columns(name)
            if schema is None:
                schema = columns
            elif columns != schema:
                raise InputError(f"shard {name} does not match shard {names[0]}: "
                                 f"{_schema_difference(schema, columns)}; every shard needs the same tensors, "
                                 "shapes (beyond the batch dimension) and dtypes")
            shards.append((name, rows))
        assert schema is not None
        self._shards, self._schema = shards, schema
        return shards, schema


def _schema_difference(expected: Schema, got: Schema) -> str:
    if set(expected) != set(got):
        return f"tensors {sorted(got)} instead of {sorted(expected)}"
    key = next(key for key in sorted(expected) if expected[key] != got[key])
    return (f"{key!r} has shape (rows, {', '.join(map(str, got[key].shape))}) and dtype {got[key].dtype}, expected "
            f"(rows, {', '.join(map(str, expected[key].shape))}) and dtype {expected[key].dtype}")


class ShardDirectory(ShardSource):
    kind = "directory"

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        if not self.path.exists():
            raise InputError(f"--data {self.path}: no such directory; give a directory of shards "
                             f"({', '.join('*' + s for s in SHARD_SUFFIXES)}), an s3://bucket/prefix or "
                             "package.module:factory")
        if not self.path.is_dir():
            raise InputError(f"--data {self.path} is a file; give the directory that holds the shards")

    def names(self) -> list[str]:
        names = sorted(p.name for p in self.path.iterdir() if p.is_file() and p.name.endswith(SHARD_SUFFIXES))
        if not names:
            raise InputError(f"--data {self.path} holds no shards ({', '.join('*' + s for s in SHARD_SUFFIXES)})")
        return names

    def read(self, name: str) -> dict[str, torch.Tensor]:
        return read_shard(self.path / name, name)

    def shard_fingerprints(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        return {name: file_fingerprint(self.path / name, what=f"shard {name}") for name in names}

    def columns(self, name: str) -> tuple[int, Schema]:
        """From the file's header where the format has one (safetensors: shapes and dtypes
        without reading the data; .pt: its zip directory checked, then memory-mapped), so
        checking a large directory is cheap. The file is opened once, as a regular file of
        bounded size, and checked as :func:`read_shard` checks it."""
        path = self.path / name
        if not name.endswith((".safetensors", ".pt")):
            return super().columns(name)
        fd = safeio.open_regular(path, what=f"shard {name}")
        try:
            with os.fdopen(os.dup(fd), "rb") as file:
                size = os.fstat(fd).st_size
                check_shard_size(size, name)
                if name.endswith(".safetensors"):
                    return shard_schema(_safetensors_columns(file, size, name), name)
                if zipfile.is_zipfile(file):
                    _check_zip(file, name, npy=False)
                # memory-mapped through the descriptor already checked (Linux names it under /proc)
                proc = f"/proc/self/fd/{fd}"
                if os.path.exists(proc):
                    loaded = torch.load(proc, weights_only=True, mmap=True, map_location="cpu")
                else:
                    file.seek(0)
                    loaded = torch.load(file, weights_only=True, map_location="cpu")
                return shard_schema(_as_named(loaded, name), name)
        except InputError:
            raise
        except Exception as err:  # noqa: BLE001 - a corrupt or foreign file: name it and the cause
            raise InputError(f"cannot read shard {name}: {type(err).__name__}: {err}") from None
        finally:
            os.close(fd)

    def describe(self) -> str:
        return f"shards in {self.path}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path.resolve())}


class ShardSubset(ShardSource):
    """Some of a shard source's shards: the training or the held-out side of
    ``--eval-fraction`` (:func:`split_shards`). Whole shards are held out, so that no sample
    is on both sides whatever the shuffling."""

    def __init__(self, inner: ShardSource, names: Sequence[str], side: str) -> None:
        super().__init__()
        self.inner, self._names, self.side = inner, list(names), side
        self.kind = inner.kind

    def names(self) -> list[str]:
        return list(self._names)

    def read(self, name: str) -> dict[str, torch.Tensor]:
        return self.inner.read(name)

    def columns(self, name: str) -> tuple[int, Schema]:
        return self.inner.columns(name)

    def shard_fingerprints(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        return self.inner.shard_fingerprints(names)

    def describe(self) -> str:
        return f"{self.inner.describe()} ({self.side}: {len(self._names)} of its shards)"

    def to_json(self) -> dict[str, Any] | None:
        inner = self.inner.to_json()
        return None if inner is None else {**inner, "shards": self._names, "side": self.side}


def split_shards(source: DataSource, fraction: float) -> tuple[ShardSubset, ShardSubset]:
    """``source``'s shards as (training, held-out): the last ``fraction`` of them in name
    order (at least one) are held out. Only shard sources split this way: a sample-level
    split of a Dataset would need to be recorded and replayed; name its held-out data with
    ``--eval-data`` instead."""
    if not isinstance(source, ShardSource):
        raise InputError(f"--eval-fraction holds out whole shards of a shard directory or s3:// prefix; "
                         f"{source.describe()} has none. Give the held-out data as --eval-data SOURCE")
    names = source.names()
    held = max(1, round(fraction * len(names)))
    if held >= len(names):
        raise InputError(f"--eval-fraction {fraction} of {source.describe()} would hold out {held} of its "
                         f"{len(names)} shards, leaving none to train on; split the data into more shards, use a "
                         "smaller fraction, or give --eval-data SOURCE")
    return (ShardSubset(source, names[:-held], "training"), ShardSubset(source, names[-held:], "held out"))


class S3Shards(ShardSource):
    """Shards under ``s3://bucket/prefix``: ``endpoint`` for an S3-compatible server (None:
    AWS), credentials from the standard AWS chain (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, profiles), never from the url."""

    kind = "s3"

    def __init__(self, url: str, endpoint: str | None = None, **credentials: str) -> None:
        super().__init__()
        rest = url.removeprefix("s3://")
        bucket, _, prefix = rest.partition("/")
        if not url.startswith("s3://") or not bucket or not prefix.strip("/"):
            raise InputError(f"--data {url!r}: an S3 source is s3://bucket/prefix/ (a prefix is needed: the "
                             "shards are the keys under it)")
        prefix = prefix if prefix.endswith("/") else prefix + "/"   # train/, not train2/ too
        self.url, self.bucket, self.prefix, self.endpoint = url, bucket, prefix, endpoint
        self._credentials: dict[str, Any] = dict(credentials)   # S3Store keywords
        self._store: Any = None
        self._lock = threading.Lock()

    def store(self) -> Any:
        with self._lock:
            if self._store is None:
                self._store = S3Store(self.bucket, "", endpoint_url=self.endpoint, **self._credentials)
            return self._store

    def names(self) -> list[str]:
        names = sorted(key for key in self.store().list(self.prefix) if key.endswith(SHARD_SUFFIXES))
        if not names:
            raise InputError(f"--data {self.url}{f' at {self.endpoint}' if self.endpoint else ''} holds no shards "
                             f"({', '.join('*' + s for s in SHARD_SUFFIXES)})")
        return names

    def read(self, name: str) -> dict[str, torch.Tensor]:
        return read_shard(self.store().get(name), name)

    def shard_fingerprints(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        # one listing gives every key's size and ETag: nothing is downloaded
        listed = self.store().objects(self.prefix)
        missing = [name for name in names if name not in listed]
        if missing:
            raise InputError(f"{self.describe()} no longer holds shard {missing[0]}")
        return {name: listed[name] for name in names}

    def describe(self) -> str:
        return f"shards in {self.url}" + (f" at {self.endpoint}" if self.endpoint else "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "url": self.url, "endpoint": self.endpoint}


class DatasetFactory(DataSource):
    """``package.module:factory`` or ``path/file.py:factory`` returning a Dataset."""

    kind = "factory"

    @staticmethod
    def normalized(spec: str) -> str:
        """``spec`` with a file's path made absolute (so that it names the same factory from
        any directory); nothing is imported."""
        source, _, attribute = spec.rpartition(":")
        if source.endswith(".py") and Path(source).is_file():
            return f"{Path(source).resolve()}:{attribute}"
        return spec

    def __init__(self, spec: str) -> None:
        self.spec = self.normalized(spec)
        self.dataset = _call_factory(self.spec)
        if not isinstance(self.dataset, (Dataset, IterableDataset)):
            raise InputError(f"--data {spec} returned a {type(self.dataset).__name__}; the factory must return a "
                             "torch.utils.data.Dataset or IterableDataset")

    @property
    def iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    def describe(self) -> str:
        return f"{type(self.dataset).__name__} from {self.spec}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "spec": self.spec}

    def fingerprint(self) -> dict[str, Any]:
        """The factory's reference, the sha256 of the file that defines it and the dataset's
        length (a map-style one): what is cheap to take again. The samples themselves are the
        factory's to keep stable."""
        source = self.spec.rpartition(":")[0]
        module = sys.modules.get(source)
        defined_in = Path(source) if source.endswith(".py") else Path(getattr(module, "__file__", None) or "")
        found: dict[str, Any] = {"kind": "factory", "spec": self.spec}
        if defined_in.name and defined_in.is_file():
            # the file itself: a module reached through a link is hashed where it lives
            hashed = file_fingerprint(defined_in.resolve(), what=f"the factory's file {defined_in}")
            found["file_sha256"] = hashed["sha256"]
        if not self.iterable and hasattr(self.dataset, "__len__"):
            found["length"] = len(self.dataset)   # type: ignore[arg-type]
        return found


class LoaderSource(DataSource):
    """A DataLoader's batches, as it yields them (its own batch size, order and shuffling)."""

    kind = "loader"

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def describe(self) -> str:
        return f"a DataLoader over {type(self.loader.dataset).__name__}"


# dtypes a synthetic record may name: a run.json is data anyone who can write the run directory
# chooses, so a name is looked up here, never on torch by attribute
SYNTHETIC_DTYPES = {str(dtype): dtype for dtype in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
    torch.int64, torch.bool)}
# a synthetic leaf's elements per sample: a record asking for more is not one flatpack wrote
MAX_SYNTHETIC_ELEMENTS = 1 << 28
# what a non-tensor input of a synthetic record may be: JSON's scalars, passed as they are
SYNTHETIC_CONSTANTS = (type(None), bool, int, float, str)


class SyntheticSource(DataSource):
    """Random batches shaped like a model's example: ``flatpack run`` without ``--data``.
    Batch ``i`` is drawn from a generator seeded by ``(seed, i)`` when it is asked for, so a
    run of any length holds one batch at a time, and its record (``to_json``) is a few shapes
    that ``flatpack resume`` draws the same batches from, where the run directory had held a
    copy of every batch (100,000 iterations of the reduced vgg16 at batch 64 would be 78 GB).

    ``inputs``: per input leaf, ``{"shape": per-sample shape, "dtype": name, "high": int}``
    (``high``: integer leaves draw from ``[0, high)``), or ``{"constant": value}`` for a
    non-tensor leaf; ``names``: the keyword names of a dict example (None: positional);
    ``target``: the target leaf (None: the model computes its own loss)."""

    kind = "synthetic"

    def __init__(self, inputs: Sequence[dict[str, Any]], names: Sequence[str] | None,
                 target: dict[str, Any] | None, seed: Any) -> None:
        self.inputs, self.names = [dict(leaf) for leaf in inputs], None if names is None else list(names)
        self.target, self.seed = None if target is None else dict(target), seed
        for where, leaf in [*((f"input {index}", leaf) for index, leaf in enumerate(self.inputs)),
                            *([("target", self.target)] if self.target is not None else [])]:
            _check_synthetic_leaf(leaf, where)
        if self.names is not None and (len(self.names) != len(self.inputs)
                                       or not all(isinstance(name, str) for name in self.names)):
            raise InputError(f"a synthetic data record names {self.names!r} for {len(self.inputs)} inputs; it is not "
                             "one flatpack wrote")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InputError(f"a synthetic data record's seed must be an integer, got {seed!r}")

    @classmethod
    def like(cls, example: Any, output: torch.Tensor | None, loss: str, seed: int) -> SyntheticSource:
        """Batches like ``example`` (a tensor, a tuple of leaves or a dict of named ones), with
        class targets for ``cross_entropy`` over ``output``'s last dimension, random targets of
        its shape for ``mse``, none for ``output`` (the model's own loss)."""
        names = list(example) if isinstance(example, dict) else None
        leaves = list(example.values()) if names is not None else example if isinstance(example, (tuple, list)) \
            else (example,)
        inputs = [_synthetic_leaf(leaf, f"input {names[index] if names else index}")
                  for index, leaf in enumerate(leaves)]
        if loss == "output" or output is None:
            target = None
        elif loss == "cross_entropy":
            target = {"shape": [], "dtype": str(torch.int64), "high": int(output.shape[-1])}
        else:
            target = {"shape": list(output.shape[1:]), "dtype": str(output.dtype)}
        return cls(inputs, names, target, seed)

    def batch(self, index: int, rows: int) -> tuple[Any, torch.Tensor | None]:
        """Batch ``index`` of ``rows`` samples: the same every time it is asked for."""
        generator = _seeded(self.seed, index)
        inputs = [_draw(leaf, rows, generator) for leaf in self.inputs]
        target = None if self.target is None else _draw(self.target, rows, generator)
        return (dict(zip(self.names, inputs)) if self.names is not None else tuple(inputs)), target

    def describe(self) -> str:
        return f"synthetic batches (seed {self.seed})"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "inputs": self.inputs, "names": self.names, "target": self.target,
                "seed": self.seed}

    def fingerprint(self) -> dict[str, Any]:
        # a record's fingerprint holds plain strings (rundir.check_fingerprint): the digest of
        # what draws the batches
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return {"kind": self.kind, "sha256": hashlib.sha256(canonical.encode()).hexdigest()}


def _synthetic_leaf(leaf: Any, where: str) -> dict[str, Any]:
    if not isinstance(leaf, torch.Tensor):
        if not isinstance(leaf, SYNTHETIC_CONSTANTS):
            raise InputError(f"the example's {where} is a {type(leaf).__name__}: synthetic batches (no --data) draw "
                             "tensor inputs and pass None, numbers and strings as they are. Give --data SOURCE")
        return {"constant": leaf}
    spec: dict[str, Any] = {"shape": list(leaf.shape[1:]), "dtype": str(leaf.dtype)}
    if not leaf.is_floating_point():
        spec["high"] = max(int(leaf.max()) + 1 if leaf.numel() else 2, 2)
    return spec


def _check_synthetic_leaf(leaf: Any, where: str) -> None:
    """A leaf of a synthetic record, refused with its cause where it is not one flatpack writes."""
    if not isinstance(leaf, dict):
        raise InputError(f"a synthetic data record's {where} is {leaf!r}, not a leaf flatpack wrote")
    if "constant" in leaf:
        if set(leaf) != {"constant"} or not isinstance(leaf["constant"], SYNTHETIC_CONSTANTS):
            raise InputError(f"a synthetic data record's {where} holds {leaf!r}; a constant input must be None, a "
                             "number or a string")
        return
    shape, dtype, high = leaf.get("shape"), leaf.get("dtype"), leaf.get("high")
    if set(leaf) - {"shape", "dtype", "high"} or not isinstance(dtype, str) or dtype not in SYNTHETIC_DTYPES:
        raise InputError(f"a synthetic data record's {where} is {leaf!r}: its dtype must be one of "
                         f"{', '.join(SYNTHETIC_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(size, int) and not isinstance(size, bool) and size > 0
                                              for size in shape):
        raise InputError(f"a synthetic data record's {where} has shape {shape!r}; it must be a list of positive sizes")
    if math.prod(shape) > MAX_SYNTHETIC_ELEMENTS:
        raise InputError(f"a synthetic data record's {where} asks for {math.prod(shape):,} elements per sample, over "
                         f"the {MAX_SYNTHETIC_ELEMENTS:,} flatpack draws; the record is not one it wrote")
    floating = SYNTHETIC_DTYPES[dtype].is_floating_point
    if floating != (high is None) or (high is not None and (not isinstance(high, int) or isinstance(high, bool)
                                                            or not 2 <= high <= 1 << 62)):
        raise InputError(f"a synthetic data record's {where} is {leaf!r}: an integer leaf draws from [0, high) with "
                         "an integer high of 2 or more, a floating one has no high")


def _draw(leaf: dict[str, Any], rows: int, generator: torch.Generator) -> Any:
    if "constant" in leaf:
        return leaf["constant"]
    dtype, shape = SYNTHETIC_DTYPES[leaf["dtype"]], (rows, *leaf["shape"])
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randint(0, leaf["high"], shape, generator=generator, dtype=dtype)


def _call_factory(spec: str) -> Any:
    source, colon, attribute = spec.rpartition(":")
    if not colon or not source or not attribute:
        raise InputError(f"--data {spec!r} must be a directory, s3://bucket/prefix, or package.module:factory / "
                         "path/to/file.py:factory returning a Dataset")

    factory = import_factory(spec, "--data")
    return factory()


def parse_source(spec: Any, *, endpoint: str | None = None) -> DataSource:
    """``--data SOURCE`` (or what the Python API was given) as a DataSource: a directory, an
    ``s3://`` prefix, a ``module:factory``, a DataLoader, or a DataSource already."""

    if isinstance(spec, DataSource):
        return spec
    if isinstance(spec, DataLoader):
        return LoaderSource(spec)
    if isinstance(spec, dict):
        return source_from_json(spec)
    if not isinstance(spec, (str, Path)):
        raise InputError(f"data must be a directory, s3://bucket/prefix, package.module:factory or a DataLoader, "
                         f"got {type(spec).__name__}")
    text = str(spec)
    if text.startswith("s3://"):
        return S3Shards(text, endpoint)
    if endpoint is not None:
        raise InputError(f"--store-endpoint names the S3 server of an s3:// --data source; {text} is not one")
    if Path(text).exists() or ":" not in text:
        return ShardDirectory(text)
    return DatasetFactory(text)


def source_from_json(data: dict[str, Any], *, factory: str | None = None) -> DataSource:
    """The source a record describes. A dataset factory is code, and a record (``run.json``) is
    data that never names code to import (docs/security.md): the caller names the factory
    again (``factory``, from the command line), and it must be the one recorded."""
    kind = data.get("kind")
    if "shards" in data:
        inner = source_from_json({key: value for key, value in data.items() if key not in ("shards", "side")},
                                 factory=factory)
        if not isinstance(inner, ShardSource):
            raise InputError(f"a record lists shards of a source that has none: {data!r}")
        return ShardSubset(inner, data["shards"], data.get("side", "training"))
    if kind == "directory":
        return ShardDirectory(data["path"])
    if kind == "synthetic":
        return SyntheticSource(data.get("inputs") or [], data.get("names"), data.get("target"), data.get("seed"))
    if kind == "s3":
        return S3Shards(data["url"], data.get("endpoint"))
    if kind == "factory":
        # the recorded reference is never printed as something to run: anyone who can write
        # the run directory chooses it, and a user who pasted it would run their code
        if factory is None:
            raise InputError("this run's data came from a dataset factory, and a run directory is data that never "
                             "names code to import (docs/security.md, 'A run directory is data'). Name the factory "
                             "of your own code that the run trained on with resume's --data MODULE:FACTORY (or "
                             "path/to/file.py:FACTORY); it must be the factory the run recorded")
        if DatasetFactory.normalized(factory) != data["spec"]:
            raise InputError(f"--data {factory} is not the factory this run recorded in its run.json "
                             "(data.source.spec); resume it on the factory it started with, from your own code")
        return DatasetFactory(factory)
    raise InputError(f"unknown data source record {data!r}")


# -- samples to model inputs -------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """How a sample's named tensors become ``(inputs, target)``: keyword inputs by name (a
    dict), or positional inputs in ``order``."""

    keyword: bool
    inputs: tuple[str, ...]
    target: str | None

    def split(self, named: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor | None]:
        target = named.get(self.target) if self.target else None
        if self.keyword:
            return {name: named[name] for name in self.inputs}, target
        return tuple(named[name] for name in self.inputs), target


def layout_for(model: torch.nn.Module, example: Any, columns: Sequence[str], where: str) -> Layout:
    """Which columns are inputs and which the target, from the model's signature: every
    column a keyword-input model takes by name is an input (``labels`` too: the model then
    computes its own loss); the target is ``target``/``targets``/``y``."""
    parameters = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    target = next((key for key in TARGET_KEYS if key in columns), None)
    rest = [key for key in columns if key != target]
    if isinstance(example, dict):
        unknown = [key for key in rest if key not in parameters and not takes_any]
        if unknown:
            raise InputError(f"{where} has tensors {unknown} that {type(model).__name__}.forward does not take; name "
                             f"them after its arguments ({', '.join(p for p in parameters if p != 'self')}) or "
                             f"'target' for the target")
        missing = [key for key in example if key not in rest]
        if missing:
            raise InputError(f"{where} lacks the model input(s) {missing} the example has; add them to every shard")
        return Layout(True, tuple(rest), target)
    leaves = example if isinstance(example, (tuple, list)) else (example,)
    if len(rest) == 1 and len(leaves) == 1:
        return Layout(False, (rest[0],), target)
    names = [p for p in parameters][: len(leaves)]
    if sorted(rest) != sorted(names):
        raise InputError(f"{where} has tensors {rest} besides the target; {type(model).__name__} takes "
                         f"{len(leaves)} positional input(s), so name them {names} (its forward's arguments)")
    return Layout(False, tuple(names), target)


def keyword_layout(columns: Sequence[str]) -> Layout:
    """Every column but the target a keyword input."""
    target = next((key for key in TARGET_KEYS if key in columns), None)
    return Layout(True, tuple(key for key in columns if key != target), target)


def check_against_example(example: Any, inputs: Any, where: str) -> None:
    """Refuses data whose inputs the model was not written for: a missing input, another
    number of dimensions, or another kind of dtype (float64 from numpy where the example has
    float32). Sizes may differ (a sequence length): the model is compiled with the data's
    first batch."""
    if isinstance(example, dict):
        pairs = [(name, value, inputs.get(name) if isinstance(inputs, dict) else None)
                 for name, value in example.items()]
    else:
        leaves = example if isinstance(example, (tuple, list)) else (example,)
        given = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        pairs = [(position, value, given[position] if position < len(given) else None)
                 for position, value in enumerate(leaves)]
    for name, expected, got in pairs:
        if isinstance(expected, torch.Tensor):
            check_tensor(name, got, TensorSpec.of(expected), where=f"{where}: ", expected_by="the model's example has",
                         exact_dtype=False, fix="Add it to every shard or sample, or reshape or convert the data "
                                                "to what the model takes.")


def loader_batches(loader: Any, iterations: int | None = None) -> Batches:
    """A DataLoader as what ``Deployment.train`` takes: its batches in order, again after
    the last (``iterations`` past one epoch), dict samples bound to the model's inputs by name."""
    return make_batches(LoaderSource(loader), None, None, batch=loader.batch_size or 1, iterations=iterations)


# -- batches -----------------------------------------------------------------------------------

class Batches:
    """Global ``(inputs, target)`` batches of a source, built when asked for: ``batches(i)``
    (what ``Deployment.train`` takes as a function of the iteration); ``len(batches)`` is the
    run's iterations (``epochs`` × the batches of an epoch, unless ``iterations`` caps it)."""

    def __init__(self, count: int, per_epoch: int, batch: int, build: Callable[[int], tuple[Any, Any]],
                 source: DataSource, layout: dict[str, Layout | None],
                 prefetch: Callable[[int], None] | None = None) -> None:
        self.count, self.per_epoch, self.batch = count, per_epoch, batch
        self._build, self._prefetch, self.source = build, prefetch, source
        self.description = source.describe()
        self._layout = layout      # shared with the builder: dict samples fix it at the first batch

    def layout_json(self) -> dict[str, Any] | None:
        """How samples become inputs (what ``flatpack resume`` needs without the model)."""
        layout = self._layout.get("layout")
        return None if layout is None else {"keyword": layout.keyword, "inputs": list(layout.inputs),
                                            "target": layout.target}

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self(index)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return (self(index) for index in range(self.count))

    def __call__(self, index: int) -> tuple[Any, Any]:
        if not 0 <= index < self.count:
            raise IndexError(f"batch {index} of {self.count}")
        batch = self._build(index)
        if self._prefetch is not None and index + 1 < self.count:
            self._prefetch(index + 1)
        return batch


def _epoch_size(samples: int, batch: int, drop_last: bool, what: str) -> int:
    if samples < batch:
        raise InputError(f"{what} holds {samples} samples, fewer than one --batch of {batch}; use a smaller --batch "
                         "or more data")
    if samples % batch and not drop_last:
        raise InputError(f"{what} holds {samples} samples, so the last batch of each epoch would have "
                         f"{samples % batch} instead of {batch}; a run's batches all have one size (the plan cuts "
                         f"each into fixed micro-batches). Pass --drop-last (drop_last=True) to skip it, or use a "
                         f"--batch that divides {samples}")
    return samples // batch


def _iterations(per_epoch: int, epochs: int, iterations: int | None) -> int:
    if epochs < 1:
        raise InputError(f"--epochs must be at least 1, got {epochs}")
    if iterations is None:
        return per_epoch * epochs
    if iterations < 1:
        raise InputError(f"--iterations must be at least 1, got {iterations}")
    return iterations


def make_batches(source: DataSource, model: torch.nn.Module | None, example: Any, *, batch: int, epochs: int = 1,
                 iterations: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, layout: Layout | None = None) -> Batches:
    """The run's batches from ``source`` (see the module docstring). ``iterations``: with
    one epoch, how many batches to train (the data repeats when it holds fewer); with more,
    a cap. Everything that can be checked without training is checked here: the shards'
    columns, the inputs against the model's signature, the sizes against ``batch``.
    ``layout``: how samples become inputs, when there is no model to ask (a resume)."""
    if not isinstance(batch, int) or batch < 1:
        raise InputError(f"--batch must be a positive number of samples, got {batch}")
    box: dict[str, Layout | None] = {"layout": layout}

    def to_inputs(named: Any) -> tuple[Any, Any]:
        """A collated sample batch as ``(inputs, target)``: named tensors through the
        layout, an ``(inputs, target)`` pair as it is."""
        if isinstance(named, dict):
            if box["layout"] is None:
                # without the model (a DataLoader given to Deployment.train): every tensor but the
                # target is a keyword input, bound to the compiled signature by name
                box["layout"] = (layout_for(model, example, list(named), f"--data {source.describe()}")
                                 if model is not None else keyword_layout(list(named)))
            return box["layout"].split(named)
        if isinstance(named, (tuple, list)) and len(named) == 2:
            inputs, target = named
            # one positional input travels as a 1-tuple, as the compiled example does
            return (tuple(inputs) if isinstance(inputs, list) else (inputs,) if isinstance(inputs, torch.Tensor)
                    else inputs), target
        raise InputError(f"{source.describe()} yields {type(named).__name__} samples; give (inputs, target) pairs "
                         "or dicts of named tensors")

    if isinstance(source, SyntheticSource):
        count = _iterations(1, epochs, iterations)
        return Batches(count, count, batch, lambda index: source.batch(index, batch), source, box)
    if isinstance(source, ShardSource):
        return _shard_batches(source, to_inputs, box, batch=batch, epochs=epochs, iterations=iterations,
                              shuffle=shuffle, seed=seed, drop_last=drop_last)
    if isinstance(source, DatasetFactory) and not source.iterable:
        return _dataset_batches(source, to_inputs, box, batch=batch, epochs=epochs, iterations=iterations,
                                shuffle=shuffle, seed=seed, drop_last=drop_last)
    return _stream_batches(source, to_inputs, box, batch=batch, epochs=epochs, iterations=iterations,
                           drop_last=drop_last)


def batches_from_record(record: dict[str, Any], *, factory: str | None = None) -> Batches:
    """The batches a run recorded in ``run.json`` (``job._data_record``), read again;
    ``factory``: a dataset factory source named again (see :func:`source_from_json`)."""
    layout = Layout(record["layout"]["keyword"], tuple(record["layout"]["inputs"]), record["layout"]["target"]) \
        if record.get("layout") else None
    return make_batches(source_from_json(record["source"], factory=factory), None, None, batch=record["batch"],
                        epochs=record["epochs"], iterations=record["iterations"], shuffle=record["shuffle"],
                        seed=record["seed"], drop_last=record["drop_last"], layout=layout)


def _seeded(seed: int, *salt: int) -> torch.Generator:
    """A generator seeded by ``seed`` and ``salt`` (an epoch, a shard, a batch): the same in
    every process (an int tuple's hash is not randomized)."""
    return torch.Generator().manual_seed(hash((seed, *salt)) & 0x7FFF_FFFF_FFFF)


def _permutation(size: int, seed: int, *salt: int) -> list[int]:
    return torch.randperm(size, generator=_seeded(seed, *salt)).tolist()


def _shard_batches(source: ShardSource, to_inputs: Callable[[Any], tuple[Any, Any]], box: dict, *, batch: int,
                   epochs: int, iterations: int | None, shuffle: bool, seed: int, drop_last: bool) -> Batches:
    shards, schema = source.scan()
    # the layout is checked against the model now, from the shards' columns, not at batch 0
    to_inputs({key: torch.zeros((1, *column.shape)) for key, column in schema.items()})
    samples = sum(rows for _, rows in shards)
    per_epoch = _epoch_size(samples, batch, drop_last, source.describe())
    count = _iterations(per_epoch, epochs, iterations)
    cache: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
    pending: dict[int, concurrent.futures.Future] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="flatpack-data")
    lock = threading.Lock()

    def order(epoch: int) -> tuple[list[int], list[int]]:
        """The epoch's shard order and each ordered shard's first sample position."""
        ids = _permutation(len(shards), seed, epoch) if shuffle else list(range(len(shards)))
        starts, at = [], 0
        for shard in ids:
            starts.append(at)
            at += shards[shard][1]
        return ids, starts

    def rows_of(shard: int, epoch: int) -> list[int]:
        size = shards[shard][1]
        return _permutation(size, seed, epoch, shard) if shuffle else list(range(size))

    def pieces(index: int) -> list[tuple[int, list[int]]]:
        """Batch ``index`` as (shard, rows) pieces in sample order."""
        epoch, within = divmod(index, per_epoch)
        ids, starts = order(epoch)
        begin, end = within * batch, (within + 1) * batch
        found = []
        for slot, shard in enumerate(ids):
            first, last = starts[slot], starts[slot] + shards[shard][1]
            if last <= begin or first >= end:
                continue
            permuted = rows_of(shard, epoch)
            found.append((shard, permuted[max(begin, first) - first:min(end, last) - first]))
        return found

    def load(shard: int) -> dict[str, torch.Tensor]:
        with lock:
            if shard in cache:
                cache.move_to_end(shard)
                return cache[shard]
            future = pending.pop(shard, None)
        tensors = future.result() if future is not None else source.read(shards[shard][0])
        with lock:
            cache[shard] = tensors
            while len(cache) > 3:
                cache.popitem(last=False)
        return tensors

    def build(index: int) -> tuple[Any, Any]:
        parts = [(load(shard), rows) for shard, rows in pieces(index)]
        named = {key: torch.cat([tensors[key][torch.tensor(rows, dtype=torch.long)] for tensors, rows in parts])
                 for key in schema}
        return to_inputs(named)

    def prefetch(index: int) -> None:
        for shard, _ in pieces(index):
            with lock:
                if shard in cache or shard in pending:
                    continue
                pending[shard] = pool.submit(source.read, shards[shard][0])

    return Batches(count, per_epoch, batch, build, source, box, prefetch)


def _collate(samples: list[Any]) -> Any:

    return default_collate(samples)


def _dataset_batches(source: DatasetFactory, to_inputs: Callable[[Any], tuple[Any, Any]], box: dict, *, batch: int,
                     epochs: int, iterations: int | None, shuffle: bool, seed: int, drop_last: bool) -> Batches:
    dataset = source.dataset
    try:
        samples = len(dataset)
    except TypeError:
        raise InputError(f"--data {source.spec}: the Dataset has no len(); give it __len__ or make it an "
                         "IterableDataset") from None
    per_epoch = _epoch_size(samples, batch, drop_last, source.describe())
    count = _iterations(per_epoch, epochs, iterations)

    def build(index: int) -> tuple[Any, Any]:
        epoch, within = divmod(index, per_epoch)
        order = _permutation(samples, seed, epoch) if shuffle else range(samples)
        picked = [dataset[order[i]] for i in range(within * batch, (within + 1) * batch)]
        return to_inputs(_collate(picked))

    return Batches(count, per_epoch, batch, build, source, box)


def _stream_batches(source: DataSource, to_inputs: Callable[[Any], tuple[Any, Any]], box: dict, *, batch: int,
                    epochs: int, iterations: int | None, drop_last: bool) -> Batches:
    """An IterableDataset (batched here) or a DataLoader (batched by it), read in order; an
    earlier batch asked for again (the verdict's reference, a resume) restarts the stream."""
    if not isinstance(source, (DatasetFactory, LoaderSource)):
        raise InputError(f"{source.describe()}: batches stream from a Dataset or a DataLoader, not from a "
                         f"{type(source).__name__}")
    loader = source.loader if isinstance(source, LoaderSource) else None
    rows = batch
    if loader is not None and loader.batch_size is not None:
        rows = loader.batch_size

    def epoch_batches() -> Iterator[Any]:
        if isinstance(source, LoaderSource):
            yield from source.loader
            return
        chunk: list[Any] = []
        for sample in source.dataset:
            chunk.append(sample)
            if len(chunk) == batch:
                yield _collate(chunk)
                chunk = []
        if chunk and not drop_last:
            raise InputError(f"{source.describe()} ended with a partial batch of {len(chunk)} samples; a run's "
                             f"batches all have {batch}. Pass --drop-last (drop_last=True), or give a --batch that "
                             "divides the dataset")

    try:
        per_epoch = len(source.loader) if isinstance(source, LoaderSource) else len(source.dataset) // batch
    except TypeError:
        per_epoch = None
    if per_epoch is None:
        if iterations is None:
            raise InputError(f"{source.describe()} has no len(), so the number of iterations is unknown; give "
                             "--iterations (iterations=)")
        per_epoch = iterations
    count = _iterations(per_epoch, epochs, iterations)
    state: dict[str, Any] = {"next": 0, "iterator": None}

    def stream() -> Iterator[Any]:
        while True:
            produced = 0
            for item in epoch_batches():
                produced += 1
                yield item
            if not produced:
                raise InputError(f"{source.describe()} yielded no batches")

    def build(index: int) -> tuple[Any, Any]:
        if state["iterator"] is None or index < state["next"]:
            state["iterator"], state["next"] = stream(), 0
        while state["next"] < index:
            next(state["iterator"])
            state["next"] += 1
        item = next(state["iterator"])
        state["next"] += 1
        return to_inputs(item)

    return Batches(count, per_epoch, rows, build, source, box)


def first_batch_rows(batch: tuple[Any, Any]) -> int:

    return next(int(leaf.shape[0]) for leaf in pytree.tree_leaves(batch[0])
                if isinstance(leaf, torch.Tensor) and leaf.dim())
