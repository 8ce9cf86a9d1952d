"""A training run's directory: what ``flatpack run`` leaves so that ``flatpack resume`` can
finish it after any crash (a worker, the runner, the S3 server, the machine).

Layout (``run.json`` says what is where)::

    RUN/run.json                  the run id, loss, iterations and state ("running", "done")
    RUN/compiled/                 the stage artifacts (``Compiled.save``); run.json's ``compiled``
                                  names another after a ``--replan`` switch, until the run ends
    RUN/batches.safetensors       the global batches the run trains on, in order
    RUN/store/                    the local S3 server's data: artifacts, checkpoints, tensors
    RUN/logs/                     the functions' logs
    RUN/trained.safetensors       the trained weights by original name, once the run is done

The store data stays until the run succeeds (then it is removed unless kept) so that a
resumed run finds its checkpoints; nothing of a run lives in the system temp directory.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_file, save_file

from flatpack.atomic import write_atomic
from flatpack.errors import InputError

RUN_FILE = "run.json"
BATCHES_FILE = "batches.safetensors"
TRAINED_FILE = "trained.safetensors"
RUN_VERSION = 1


@dataclass
class RunRecord:
    """``run.json``: enough to resume a run without the user's model code."""

    run: str                      # the run id: the prefix of every store key of the run
    loss: str
    iterations: int
    state: str = "running"        # "running" until the last iteration is checkpointed, then "done"
    # a --data run: its source and batching (flatpack.data.batches_from_record), read again on
    # resume instead of a copy in batches.safetensors; None: the batches are in the directory
    data: dict | None = None
    # the train() settings (optimizer, schedule, sync, checkpoints), for a resume of a run
    # that stopped before its first call was recorded in the store
    train_options: dict | None = None
    version: int = RUN_VERSION
    # the directory of the stage artifacts of the plan the run trains (a `--replan` switch
    # names the new plan's, ``compiled-<run>``), relative to the run directory
    compiled: str = "compiled"

    def dumps(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def loads(cls, text: str, where: Path) -> RunRecord:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise InputError(f"{where} is not valid JSON ({err}); it is written by `flatpack run`") from None
        if data.get("version") != RUN_VERSION:
            raise InputError(f"{where} has run-record version {data.get('version')!r}; this flatpack reads version "
                             f"{RUN_VERSION}. Resume it with the flatpack version that started it")
        return cls(**data)


@dataclass(frozen=True)
class RunDirectory:
    root: Path

    @property
    def record_path(self) -> Path:
        return self.root / RUN_FILE

    @property
    def compiled(self) -> Path:
        return self.root / "compiled"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def batches_path(self) -> Path:
        return self.root / BATCHES_FILE

    @property
    def trained_path(self) -> Path:
        return self.root / TRAINED_FILE

    def read(self) -> RunRecord:
        if not self.record_path.is_file():
            raise InputError(f"{self.root} has no {RUN_FILE}: it is not a run directory written by `flatpack run` "
                             "(give the --out directory of the run to resume)")
        return RunRecord.loads(self.record_path.read_text(), self.record_path)

    def write(self, record: RunRecord) -> None:
        """Replaces ``run.json`` atomically (a crash never leaves half a record)."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.record_path, record.dumps())

    def save_batches(self, batches: Sequence[tuple[Any, Any]]) -> None:
        save_file(pack_batches(batches), str(self.batches_path))

    def load_batches(self) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor | None]]:
        if not self.batches_path.is_file():
            raise InputError(f"{self.batches_path} is missing: the run's batches are needed to resume it on the same "
                             "data")
        return unpack_batches(load_file(str(self.batches_path)))

    def remove_store(self) -> None:
        shutil.rmtree(self.store, ignore_errors=True)


def pack_batches(batches: Sequence[tuple[Any, Any]]) -> dict[str, torch.Tensor]:
    """Global ``(inputs, target)`` batches as safetensors entries ``b<i>/x<k>`` and ``b<i>/y``."""
    tensors: dict[str, torch.Tensor] = {}
    for index, (inputs, target) in enumerate(batches):
        # keyword inputs by name (k:<name>), positional ones by position (x<k>)
        named = ({f"k:{name}": leaf for name, leaf in inputs.items()} if isinstance(inputs, dict) else
                 {f"x{position:03d}": leaf for position, leaf in
                  enumerate(inputs if isinstance(inputs, (tuple, list)) else (inputs,))})
        for part, leaf in named.items():
            if not isinstance(leaf, torch.Tensor):
                raise InputError(f"batch {index}'s input {part} is a {type(leaf).__name__}; a run directory keeps "
                                 "tensor inputs only")
            tensors[f"b{index:06d}/{part}"] = leaf.contiguous()
        if target is not None:
            tensors[f"b{index:06d}/y"] = target.contiguous()
    return tensors


def unpack_batches(tensors: dict[str, torch.Tensor]) -> list[tuple[Any, torch.Tensor | None]]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        batch, part = key.split("/", 1)
        grouped.setdefault(batch, {})[part] = tensor
    batches = []
    for batch in sorted(grouped):
        parts = grouped[batch]
        keywords = {name[2:]: tensor for name, tensor in parts.items() if name.startswith("k:")}
        inputs = keywords or tuple(parts[name] for name in sorted(name for name in parts if name.startswith("x")))
        batches.append((inputs, parts.get("y")))
    return batches
