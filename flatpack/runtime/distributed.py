"""The rank program of the ``gpu-container`` backend: Hydrozoa's A×B hybrid plan, where every
stage replica is one ``torch.distributed`` rank and the ranks talk to each other directly.

Ranks are laid out stage by stage: the d_0 replicas of stage 0 are ranks 0..d_0−1, then
stage 1's, and so on (:class:`Layout`). Micro-batch m of an iteration runs on replica
m mod d of every stage (``StageSpec.owned``), so an activation of micro-batch m goes from
replica m mod d_src of its producing stage to replica m mod d_dst of each consuming stage —
which may be any later stage (skip connections), not only the next — and its gradient comes
back the same route. An iteration is the run's schedule's actions (``Schedule.actions``, the
same the store-based runtime runs: FuncPipe's synchronous schedule, 1F1B, any schedule that
flushes every iteration); then the stage's replicas all-reduce (sum) their gradients in a
``dist.new_group`` of their own (a ring in gloo and NCCL), and the optimizer steps.

Why the messages cannot deadlock or mismatch: every send is asynchronous (``isend``,
waited at the end of the iteration) and only receives block, which is the store runtime's
put/wait discipline, so any schedule that runs there runs here. Point-to-point messages
between two ranks are matched in order, so activations and gradients travel on two
different process groups: on each group a pair of ranks only ever talks one way, in an
order both sides compute alike (forwards by increasing micro-batch; backwards in the
schedule's order). Each message is a small header (names, dtypes, shapes and any
non-tensor values as JSON) followed by its tensors, so shapes never have to be guessed from
the manifest; under NCCL the headers go through a gloo group on the CPU.

Tied parameters (manifest ``shared_with``) are all-reduced over every replica of every
stage that holds them, so all copies take the same summed gradient (README, "Tied
weights"), and are left out of the per-stage all-reduce.

The micro-batch compute — parameter discovery, the forward under the precision's autocast
with the micro-batch's dropout seed, the loss scaled by b/B for a micro-batch of b samples,
the backward through the outputs (after recomputing the forward on a stage whose plan says
so), the flat gradient buffer — is ``training.py``'s own (``stage_forward``,
``stage_backward``, ``flat_grads``; ``stage_tensors`` from ``stage.artifact``), so the parameters after N
iterations equal the store runtime's and single-process training (``reference.py``).

Run it under ``torchrun`` (or with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set)::

    python -m flatpack.runtime.distributed --context DIR [--run FILE] [--data DIR | --synthetic] --out DIR

``DIR`` is the packaged context: ``run.json`` (a :class:`DistributedRun`) and
``stages/stage_NNN/``. Data are ``DIR/data/iter_NNNNNN.safetensors`` files of global batches
(``wire.pack_values`` of the input leaves by name and the target under ``TARGET``) of
exactly the run's batch (``--batch``) samples; a rank reads only the tensors its stage
takes from the data, and cuts them into its micro-batches (``spec.split_value``).
At the end, replica 0 of each stage writes ``stage_NNN.safetensors`` (final parameters under
their original names) and every rank writes ``rank_NNNNN.json`` (losses, seconds per
iteration, samples/s) and ``timeline_rank_NNNNN.json`` into the output directory.

An inference run (``DistributedRun.mode`` "infer") sends the same forward messages with no
backward: the modules run in eval mode without autograd, and every rank writes the model
outputs its stage produced, per iteration and micro-batch, to ``outputs_rank_NNNNN.bin``
(``wire.pack_values``); ``--parameters DIR`` loads a finished training run's weights first.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import resource
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from flatpack.atomic import write_atomic
from flatpack.errors import ArtifactError, InputError
from flatpack.runtime import clipping, timeline
from flatpack.runtime.precision import autocast, for_wire, loss_scaler
from flatpack.runtime.spec import (DATA_SOURCE, RunSpec, StageSpec, micro_batch_size, received_specs,
                                   split_value)
from flatpack.runtime.training import (TARGET, MicroBatchState, assign_flat_grads, flat_grads,
                                       input_gradients, stage_backward, stage_forward)
from flatpack.stage.artifact import load_stage, stage_dirname, stage_manifest, stage_tensors
from flatpack.stage.manifest import ValueEntry
from flatpack.stage.tensor_check import check_stage_inputs, stage_input_specs
from flatpack.stage.wire import META_KEY, pack_values, split_values

RUN_FILE = "run.json"
STAGES_DIR = "stages"
DIGEST_ENV = "FLATPACK_DIGEST"   # the artifact digest a rank verifies its stage against
DATA_DIR = "data"
RUN_KIND = "flatpack-distributed-run"
RUN_VERSION = 1
BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")
FORWARD, BACKWARD = 0, 1
# what a run does: the Workload modes (partitioner.workload.MODES, which a test holds these to),
# spelled here so that a rank does not import the partitioner
TRAIN, INFER = "train", "infer"
RUN_MODES = (TRAIN, INFER)


def stage_path(context: str | os.PathLike, stage: int) -> Path:
    return Path(context) / STAGES_DIR / stage_dirname(stage)


def data_file(directory: str | os.PathLike, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:06d}.safetensors"


def rank_report_file(out: str | os.PathLike, rank: int) -> Path:
    return Path(out) / f"rank_{rank:05d}.json"


def timeline_file(out: str | os.PathLike, rank: int) -> Path:
    return Path(out) / f"timeline_rank_{rank:05d}.json"


def parameters_file(out: str | os.PathLike, stage: int) -> Path:
    return Path(out) / f"{stage_dirname(stage)}.safetensors"


def error_file(out: str | os.PathLike, rank: int) -> Path:
    return Path(out) / f"error_rank_{rank:05d}.json"


def outputs_file(out: str | os.PathLike, rank: int) -> Path:
    """An inference run's model outputs that one rank computed (``output_key`` names them)."""
    return Path(out) / f"outputs_rank_{rank:05d}.bin"


def output_key(iteration: int, micro_batch: int, name: str) -> str:
    return f"{iteration}/{micro_batch}/{name}"


# -- who is who ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankRole:
    """One rank: stage ``stage``, replica ``replica``."""

    rank: int
    stage: int
    replica: int

    @property
    def worker(self) -> str:
        return f"s{self.stage}r{self.replica}"


@dataclass(frozen=True)
class Layout:
    """Ranks in stage order: stage s's replicas are ranks offset(s) .. offset(s) + d_s − 1."""

    degrees: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return sum(self.degrees)

    def offset(self, stage: int) -> int:
        return sum(self.degrees[:stage])

    def rank(self, stage: int, replica: int) -> int:
        if not 0 <= replica < self.degrees[stage]:
            raise InputError(f"stage {stage} has {self.degrees[stage]} replicas, not a replica {replica}")
        return self.offset(stage) + replica

    def ranks_of(self, stage: int) -> list[int]:
        return list(range(self.offset(stage), self.offset(stage) + self.degrees[stage]))

    def role(self, rank: int) -> RankRole:
        if not 0 <= rank < self.world_size:
            raise InputError(f"rank {rank} is outside a world of {self.world_size} ranks (degrees {self.degrees})")
        stage = 0
        while rank >= self.offset(stage + 1):
            stage += 1
        return RankRole(rank, stage, rank - self.offset(stage))

    def roles(self) -> list[RankRole]:
        return [self.role(rank) for rank in range(self.world_size)]


# -- what a run is ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DistributedRun:
    """``run.json``: the store runtime's :class:`RunSpec` (stages, routing, micro-batches,
    optimizer, loss, schedule, tied parameters) plus what a rank needs beyond it.

    ``example_batch``: the batch of the compile-time inputs, so that ``--synthetic`` can
    scale the manifest's shapes to a micro-batch. Every wait on a peer is bounded by the
    spec's ``wait_timeout_s``. ``mode`` "infer": forward passes only (the modules in eval
    mode, no gradients, no optimizer step); every rank writes the model ``outputs`` its
    stage produced (:func:`outputs_file`).
    """

    spec: RunSpec
    iterations: int
    backend: str = "gloo"
    device: str = "cpu"
    example_batch: int | None = None
    seed: int = 0
    mode: str = TRAIN
    outputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InputError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.device not in DEVICES:
            raise InputError(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.backend == "nccl" and self.device != "cuda":
            raise InputError("the nccl backend moves CUDA tensors only; use device 'cuda' with it, or backend 'gloo'")
        if self.iterations < 1:
            raise InputError(f"a run needs at least one iteration, got {self.iterations}")
        if self.mode not in RUN_MODES:
            raise InputError(f"run mode {self.mode!r} is not one of {', '.join(RUN_MODES)}")
        self.spec.check_schedule(ranks=True)     # the ranks run only schedules that flush every iteration

    @property
    def layout(self) -> Layout:
        return Layout(tuple(stage.replicas for stage in self.spec.stages))

    def dumps(self) -> bytes:
        document = {"kind": RUN_KIND, "version": RUN_VERSION, "spec": json.loads(self.spec.dumps()),
                    "iterations": self.iterations, "backend": self.backend, "device": self.device,
                    "example_batch": self.example_batch, "seed": self.seed, "mode": self.mode,
                    "outputs": list(self.outputs)}
        return (json.dumps(document, indent=2) + "\n").encode()

    @classmethod
    def loads(cls, raw: bytes | str) -> DistributedRun:
        document = json.loads(raw)
        if document.get("kind") != RUN_KIND or document.get("version") != RUN_VERSION:
            raise InputError(f"this is not a {RUN_KIND} document of version {RUN_VERSION}; repackage the model "
                             "with this flatpack")
        return cls(spec=RunSpec.loads(json.dumps(document["spec"]).encode()), iterations=int(document["iterations"]),
                   backend=document["backend"], device=document["device"], example_batch=document["example_batch"],
                   seed=int(document["seed"]), mode=document.get("mode", TRAIN),
                   outputs=tuple(document.get("outputs", ())))


# -- micro-batches ---------------------------------------------------------------------------

def data_input_names(spec: RunSpec) -> list[str]:
    """The inputs stages read from the data, in stage order: every rank sizes a batch file
    by the first of them that is a batched tensor, so all ranks agree (``example_batch``
    takes the same order)."""
    names: list[str] = []
    for stage in spec.stages:
        names += [name for name in stage.inputs if stage.sources[name] == DATA_SOURCE and name not in names]
    return names


def synthetic_generator(seed: int, micro_batch: int, name: str, device: torch.device) -> torch.Generator:
    """The generator of ``name`` (an input, or ``TARGET``) in micro-batch ``micro_batch``:
    seeded by all three, so every stage that reads an input draws the same values however
    many other inputs it draws."""
    digest = hashlib.sha256(f"{seed}/{micro_batch}/{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"unknown tensor dtype {name!r} in a stage manifest or message header")
    return dtype


def synthetic_tensor(entry: ValueEntry, rows: int, example_batch: int | None,
                     generator: torch.Generator) -> torch.Tensor:
    """A random tensor of a manifest I/O entry's dtype and shape, its batch dimension (the
    first, when it equals the compile-time batch) set to ``rows``, on the generator's device."""
    if not entry.is_tensor:
        raise InputError(f"--synthetic cannot make the input {entry.name!r}: it is a {entry.python_type or 'value'}, "
                         "not a tensor. Write the batches as files instead")
    shape = list(entry.shape)
    if shape and example_batch is not None and shape[0] == example_batch:
        shape[0] = rows
    dtype = _dtype(entry.dtype)
    device = generator.device
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, device=device).to(dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    # integer inputs are indices (token ids, positions): 0 is valid for any table
    return torch.zeros(shape, dtype=dtype, device=device)


def synthetic_target(loss: str, output: ValueEntry, rows: int, example_batch: int | None,
                     generator: torch.Generator) -> torch.Tensor | None:
    """A target the loss accepts for an output of the manifest entry ``output``."""
    if loss == "output":
        return None
    shape = list(output.shape)
    if shape and example_batch is not None and shape[0] == example_batch:
        shape[0] = rows
    if loss == "cross_entropy":
        classes = shape[1] if len(shape) > 1 else 1
        return torch.randint(0, classes, [shape[0], *shape[2:]], generator=generator, device=generator.device)
    return torch.randn(shape, generator=generator, device=generator.device)


# -- messages --------------------------------------------------------------------------------

@dataclass
class Channels:
    """The process groups a rank sends on: ``activations`` and ``gradients`` carry tensors
    (one direction per pair of ranks on each), ``control`` carries headers (a gloo group
    under NCCL; the tensor groups themselves under gloo). ``stage`` is this rank's replica
    group, ``shared`` the tied parameters' holder groups."""

    activations: Any
    gradients: Any
    control_activations: Any
    control_gradients: Any
    stage: Any
    shared: dict[tuple[int, ...], Any] = field(default_factory=dict)

    @classmethod
    def create(cls, run: DistributedRun, role: RankRole) -> Channels:
        """Every rank creates every group in the same order (``new_group`` is collective)."""
        layout = run.layout
        gradients = dist.new_group(list(range(layout.world_size)))
        control = dist.new_group(list(range(layout.world_size)), backend="gloo") if run.backend == "nccl" else None
        stage_group = None
        for stage in range(len(layout.degrees)):
            ranks = layout.ranks_of(stage)
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if stage == role.stage:
                stage_group = group
        shared = {}
        for holders in sorted(set(run.spec.shared.values())):
            ranks = [rank for stage in holders for rank in layout.ranks_of(stage)]
            group = dist.new_group(ranks)
            if role.stage in holders:
                shared[holders] = group
        return cls(activations=dist.group.WORLD, gradients=gradients,
                   control_activations=control if control is not None else dist.group.WORLD,
                   control_gradients=control if control is not None else gradients,
                   stage=stage_group, shared=shared)


class Messenger:
    """Sends and receives named values between ranks: a JSON header, then the tensors."""

    def __init__(self, channels: Channels, transport: torch.device, compute: torch.device,
                 recorder: timeline.Recorder) -> None:
        self.channels = channels
        self.transport = transport   # where tensors must be for the backend (cuda for NCCL)
        self.compute = compute
        self.recorder = recorder
        self.pending: list[tuple[Any, Any]] = []   # (work, tensor kept alive until it is sent)

    def _groups(self, direction: int) -> tuple[Any, Any]:
        if direction == FORWARD:
            return self.channels.control_activations, self.channels.activations
        return self.channels.control_gradients, self.channels.gradients

    def send(self, values: dict[str, Any], dst: int, micro_batch: int, direction: int, iteration: int) -> None:
        control, data = self._groups(direction)
        tag = 2 * micro_batch + direction
        tensors, others = split_values(values)
        header = json.dumps({"tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)]
                                         for name, t in tensors.items()],
                             "values": others}).encode()
        header_bytes = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self.recorder.task("upload", iteration, micro_batch=micro_batch, nbytes=nbytes, lane="upload"):
            for tensor in (torch.tensor([len(header)], dtype=torch.int64), header_bytes):
                self.pending.append((dist.isend(tensor, dst, group=control, tag=tag), tensor))
            for tensor in tensors.values():
                payload = tensor.detach().to(self.transport).contiguous()
                self.pending.append((dist.isend(payload, dst, group=data, tag=tag), payload))

    def recv(self, src: int, micro_batch: int, direction: int, iteration: int) -> dict[str, Any]:
        control, data = self._groups(direction)
        tag = 2 * micro_batch + direction
        start = time.time()
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, src, group=control, tag=tag)
        raw = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(raw, src, group=control, tag=tag)
        header = json.loads(raw.numpy().tobytes())
        values: dict[str, Any] = dict(header["values"])
        nbytes = 0
        for name, dtype, shape in header["tensors"]:
            tensor = torch.empty(shape, dtype=_dtype(dtype), device=self.transport)
            dist.recv(tensor, src, group=data, tag=tag)
            nbytes += tensor.numel() * tensor.element_size()
            values[name] = tensor.to(self.compute)
        self.recorder.add(timeline.Event(self.recorder.stage, self.recorder.replica, iteration, "download", start,
                                         max(time.time(), start), micro_batch=micro_batch, nbytes=nbytes,
                                         lane="download"))
        return values

    def flush(self) -> None:
        """Waits for every send of the iteration, so their buffers may be freed."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def transport_device(backend: str, device: torch.device) -> torch.device:
    """Where the backend needs a tensor to move it: the compute device for NCCL, the host for
    gloo (which moves CPU tensors only)."""
    return device if backend == "nccl" else torch.device("cpu")


def all_reduce_gradients(params: Sequence[nn.Parameter], backend: str, device: torch.device, group: Any) -> None:
    """Sums ``params``' gradients over ``group``: one flat buffer, one collective, through the
    host for gloo, the sum copied back into each gradient (a stage's replicas synchronizing;
    ``collective_probe`` times exactly this)."""
    flat = flat_grads(params).to(transport_device(backend, device))
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    assign_flat_grads(params, flat.to(device))


# -- one rank --------------------------------------------------------------------------------

class StageRank:
    """One replica of one stage, as one rank of the process group."""

    def __init__(self, run: DistributedRun, role: RankRole, module: nn.Module, device: torch.device,
                 channels: Channels, data_dir: Path | None) -> None:
        self.run = run
        self.spec = run.spec
        self.role = role
        self.layout = run.layout
        self.stage: StageSpec = run.spec.stages[role.stage]
        self.device = device
        self.training = run.mode == TRAIN
        self.module = module.to(device).train(self.training)
        self.manifest = stage_manifest(module)
        self.input_specs = received_specs(stage_input_specs(self.manifest),
                                          self.stage, self.spec.precision)
        self.state_tensors, self.trainable = stage_tensors(self.module)
        self.optimizer = self.spec.optimizer.build(self.trainable.values())
        self.scheduler = self.spec.optimizer.build_schedule(self.optimizer)
        self.scaler = loss_scaler(self.spec.precision, self.spec.loss_scaling, device)    # fp16 only
        self.accumulated = 0    # iterations whose gradients .grad holds since the last step
        self.channels = channels
        self.recorder = timeline.Recorder(role.stage, role.replica)
        self.messenger = Messenger(channels, transport_device(run.backend, device), device, self.recorder)
        self.data_dir = data_dir
        self.is_last = role.stage == len(self.spec.stages) - 1
        self.losses: dict[int, float] = {}
        self._loss_total: torch.Tensor | float = 0.0
        self.iteration_ends: list[float] = []
        self.started = 0.0
        # what the iterations look up, worked out once
        self.owned = self.stage.owned(self.spec.micro_batches, role.replica)
        self.data_inputs = [name for name in self.stage.inputs if self.stage.sources[name] == DATA_SOURCE]
        self.batched_inputs = data_input_names(self.spec)
        self.producers = sorted({source for source in self.stage.sources.values() if source != DATA_SOURCE})
        self.inputs_from = {producer: [name for name in self.stage.inputs if self.stage.sources[name] == producer]
                            for producer in self.producers}
        self.local_parameters = [name for name in self.trainable if name not in self.spec.shared]
        # an inference run: the model outputs this stage produces, by output_key
        self.model_outputs = [name for name in self.stage.outputs if name in run.outputs]
        self.results: dict[str, Any] = {}
        self.synthetic_batches: dict[int, dict[str, Any]] = {}
        if data_dir is None and (self.data_inputs or self.is_last):
            self.synthetic_batches = {m: self._synthetic(m) for m in self.owned}

    # data -------------------------------------------------------------------------------------
    def _data(self, iteration: int) -> dict[int, dict[str, Any]]:
        """This rank's owned micro-batches of the iteration's data inputs (and target)."""
        if not self.data_inputs and not self.is_last:
            return {}
        if self.data_dir is None:
            return self.synthetic_batches
        values = self._read_batch(data_file(self.data_dir, iteration), iteration)
        pieces = {name: split_value(value, self.spec.batch, self.spec.micro_batches) for name, value in values.items()}
        return {m: {name: piece[m] for name, piece in pieces.items()} for m in self.owned}

    def _read_batch(self, path: Path, iteration: int) -> dict[str, Any]:
        """The data inputs this rank's stage reads (and the target, on the last stage) from one
        global batch file. Only those tensors are read from disk; the file's size is checked
        first, since a batch of another size would not be cut (every micro-batch would get
        all of it)."""
        if not path.is_file():
            raise InputError(f"rank {self.role.rank} (stage {self.role.stage}) found no data for iteration "
                             f"{iteration}: {path} does not exist. Write the batches there, or run with --synthetic")
        with safe_open(str(path), framework="pt", device="cpu") as batch_file:
            meta = json.loads((batch_file.metadata() or {}).get(META_KEY, "{}"))
            others: dict[str, Any] = meta.get("values", {})
            tensors = set(batch_file.keys())
            shapes = (batch_file.get_slice(name).get_shape() for name in self.batched_inputs if name in tensors)
            rows = next((int(shape[0]) for shape in shapes if shape), None)
            if rows is None:
                raise InputError(f"{path} holds no batched tensor among the data inputs "
                                 f"{', '.join(self.batched_inputs)}: a batch file holds each input's global batch "
                                 "by input name (wire.pack_values)")
            if rows != self.spec.batch:
                raise InputError(f"{path} holds a batch of {rows} samples, but the run's batch is {self.spec.batch}; "
                                 f"pass --batch {rows} (or package(batch={rows})), or write batches of "
                                 f"{self.spec.batch} samples")
            values: dict[str, Any] = {}
            for name in self.data_inputs:
                if name in tensors:
                    values[name] = batch_file.get_tensor(name)
                elif name in others:
                    values[name] = others[name]
                else:
                    raise InputError(f"{path} has no input {name!r}, which stage {self.role.stage} reads from the "
                                     f"data (the file holds {', '.join(sorted(tensors | set(others))) or 'nothing'}); "
                                     "write every model input into each batch file, by input name")
            if self.is_last and TARGET in tensors:
                values[TARGET] = batch_file.get_tensor(TARGET)
            elif self.is_last and TARGET in others:
                values[TARGET] = others[TARGET]
        return values

    def _synthetic(self, m: int) -> dict[str, Any]:
        """Micro-batch m of a throughput run: made once on the rank's device and reused every
        iteration, so that the data path costs nothing (a real input pipeline is not what is
        measured). Each input is drawn from its own generator (``synthetic_generator``), so
        every stage reading an input sees the same values."""
        rows = micro_batch_size(self.spec.batch, self.spec.micro_batches, m)
        entries = {entry.name: entry for entry in self.manifest.inputs}
        values: dict[str, Any] = {
            name: synthetic_tensor(entries[name], rows, self.run.example_batch,
                                   synthetic_generator(self.run.seed, m, name, self.device))
            for name in self.data_inputs}
        if self.is_last and self.training:
            output = next(entry for entry in self.manifest.outputs if entry.name == self.spec.loss_output)
            target = synthetic_target(self.spec.loss, output, rows, self.run.example_batch,
                                      synthetic_generator(self.run.seed, m, TARGET, self.device))
            if target is not None:
                values[TARGET] = target
        return values

    # routes -----------------------------------------------------------------------------------
    def _peer(self, stage: int, micro_batch: int) -> int:
        return self.layout.rank(stage, micro_batch % self.spec.stages[stage].replicas)

    def _names_read_by(self, consumer: int) -> list[str]:
        reader = self.spec.stages[consumer]
        return [name for name in reader.inputs if reader.sources[name] == self.role.stage]

    # compute ----------------------------------------------------------------------------------
    def _forward(self, iteration: int, m: int, data: dict[str, Any], states: dict[int, MicroBatchState]) -> None:
        received: dict[str, Any] = {}
        for producer in self.producers:
            received.update(self.messenger.recv(self._peer(producer, m), m, FORWARD, iteration))
        state = MicroBatchState()
        args = []
        for name in self.stage.inputs:
            if self.stage.sources[name] == DATA_SOURCE:
                value = data[name]
                value = value.to(self.device) if isinstance(value, torch.Tensor) else value
            else:
                value = received[name]
                if self.training and isinstance(value, torch.Tensor) and value.is_floating_point():
                    value = value.detach().requires_grad_(True)
            state.inputs[name] = value
            args.append(value)
        check_stage_inputs(self.input_specs, state.inputs.items(),
                           where=f"stage {self.role.stage} rank, iteration {iteration}, micro-batch {m}: ")
        if self.training:
            if self.is_last:
                target = data.get(TARGET)
                state.target = target.to(self.device) if isinstance(target, torch.Tensor) else target
            # a recomputing stage keeps only its inputs; its backward runs the forward again
            with (self.recorder.task("forward", iteration, micro_batch=m),
                  torch.set_grad_enabled(not self.stage.recompute)):
                stage_forward(self.module, self.spec, self.stage, iteration, m, state, device_type=self.device.type)
            states[m] = state   # kept for the backward
        else:
            # serving: the outputs alone, without autograd or a loss
            with (self.recorder.task("forward", iteration, micro_batch=m), torch.no_grad(),
                  autocast(self.spec.precision, self.device.type)):
                state.outputs = dict(zip(self.stage.outputs, self.module(*args)))
        for name in self.model_outputs:
            value = state.outputs[name]
            self.results[output_key(iteration, m, name)] = value.cpu() if isinstance(value, torch.Tensor) else value
        for consumer in self.stage.consumers:
            values = {name: state.outputs[name] for name in self._names_read_by(consumer)}
            self.messenger.send(for_wire(values, self.spec.precision), self._peer(consumer, m), m, FORWARD, iteration)

    def _backward(self, iteration: int, m: int, states: dict[int, MicroBatchState]) -> None:
        state = states.pop(m)
        grads: dict[str, torch.Tensor] = {}
        for consumer in self.stage.consumers:
            for name, grad in self.messenger.recv(self._peer(consumer, m), m, BACKWARD, iteration).items():
                grads[name] = grads[name] + grad if name in grads else grad
        with self.recorder.task("backward", iteration, micro_batch=m):
            stage_backward(self.module, self.spec, self.stage, iteration, m, state, grads,
                           device_type=self.device.type, scaler=self.scaler)
            if self.is_last:
                # read once per iteration: no sync here; the batch's mean, whatever accumulation's 1/K
                if state.loss is None:
                    raise RuntimeError(f"stage {self.stage.index}: micro-batch {m}'s forward left no loss")
                self._loss_total = self._loss_total + state.loss.detach() * self.spec.optimizer.accumulate
        input_grads = input_gradients(state.inputs)
        for producer in self.producers:
            # always a message, possibly empty: the producer waits for one from every consumer
            self.messenger.send(for_wire({name: input_grads[name] for name in self.inputs_from[producer]
                                          if name in input_grads}, self.spec.precision),
                                self._peer(producer, m), m, BACKWARD, iteration)

    def _all_reduce(self, names: list[str], group: Any) -> None:
        """Sums the named parameters' gradients over ``group`` (one flat buffer, one collective)."""
        if group is None or not names:
            return
        all_reduce_gradients([self.trainable[name] for name in names], self.run.backend, self.device, group)

    def _synchronize(self, iteration: int) -> None:
        with self.recorder.task("sync", iteration):
            self._all_reduce(self.local_parameters, self.channels.stage)
            # groups in sorted order on every rank: collectives on overlapping groups cannot cross
            for holders, group in sorted(self.channels.shared.items()):
                names = sorted(name for name, held in self.spec.shared.items()
                               if held == holders and name in self.trainable)
                self._all_reduce(names, group)

    def _checked_step(self) -> bool:
        """Unscaling (fp16), the global overflow check and global-norm clipping
        (``clipping.checked_step``): replica 0 of every stage contributes its squared gradient
        norm (a tied weight at its first holder) and whether it overflowed, one float64
        all-reduce over every rank (on the CPU group) gives the totals; whether to step."""
        counted = [param.grad for name, param in self.trainable.items()
                   if min(self.spec.shared.get(name, (self.role.stage,))) == self.role.stage]

        def reduce(own: list[float]) -> list[float]:
            total = torch.tensor(own if self.role.replica == 0 else [0.0] * len(own), dtype=torch.float64)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.channels.control_gradients)
            return total.tolist()

        return clipping.checked_step(list(self.trainable.values()), counted, self.spec.optimizer.clip_grad_norm,
                                     self.scaler, reduce)

    def run_iteration(self, iteration: int) -> None:
        if not self.training:
            self.infer_iteration(iteration)
            return
        self._loss_total = 0.0
        data = self._data(iteration)
        states: dict[int, MicroBatchState] = {}
        for action in self.spec.schedule_object.actions(self.role.stage, len(self.spec.stages), self.owned):
            if action.is_forward:
                self._forward(iteration, action.micro_batch, data.get(action.micro_batch, {}), states)
            else:
                self._backward(iteration, action.micro_batch, states)
        self.messenger.flush()
        # gradient accumulation: the local gradients keep adding up in .grad (ranks never
        # replay, so nothing needs checkpointing) and the replicas reduce once per step
        self.accumulated += 1
        if self.accumulated == self.spec.optimizer.accumulate:
            self.accumulated = 0
            self._synchronize(iteration)
            with self.recorder.task("update", iteration):
                steps = self._checked_step()
                if steps:
                    self.optimizer.step()
                if self.scaler is not None:
                    self.scaler.update(not steps)
                if self.scheduler is not None:
                    self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the iteration's time is the device's, not the launches'
        self.iteration_ends.append(time.time())
        if self.is_last:
            self.losses[iteration] = float(self._loss_total)

    def infer_iteration(self, iteration: int) -> None:
        """One request: the forwards of this rank's micro-batches, in order (the same sends
        and receives as a training iteration's forwards, so the routes are the same)."""
        data = self._data(iteration)
        for m in self.owned:
            self._forward(iteration, m, data.get(m, {}), {})
        self.messenger.flush()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.iteration_ends.append(time.time())

    def load_parameters(self, directory: Path) -> None:
        """This stage's parameters and buffers from ``parameters_file(directory, stage)`` (a
        finished training run's output): what an inference after training computes with."""
        path = parameters_file(directory, self.role.stage)
        if not path.is_file():
            raise InputError(f"rank {self.role.rank} (stage {self.role.stage}) found no parameters at {path}; give "
                             "the output directory of a finished training run of this plan, or leave --parameters out")
        with torch.no_grad():
            for name, tensor in load_file(str(path)).items():
                if name not in self.state_tensors:
                    raise InputError(f"{path} holds {name!r}, which stage {self.role.stage} does not have; it was "
                                     "written for another plan")
                self.state_tensors[name].copy_(tensor)

    def train(self) -> None:
        self.started = time.time()
        for iteration in range(self.run.iterations):
            self.run_iteration(iteration)

    # results ----------------------------------------------------------------------------------
    def iteration_seconds(self) -> list[float]:
        """Seconds between consecutive iteration ends: in steady state, the pipeline's period."""
        starts = [self.started, *self.iteration_ends[:-1]]
        return [end - start for start, end in zip(starts, self.iteration_ends)]

    def report(self, warmup: int) -> dict[str, Any]:
        seconds = self.iteration_seconds()
        steady = seconds[warmup:] or seconds
        median = statistics.median(steady) if steady else 0.0
        if self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024   # Linux: KiB
        return {"rank": self.role.rank, "stage": self.role.stage, "replica": self.role.replica,
                "backend": self.run.backend, "device": str(self.device), "batch": self.spec.batch,
                "micro_batches": self.spec.micro_batches, "degrees": list(self.layout.degrees),
                "losses": [self.losses[i] for i in sorted(self.losses)] if self.is_last else [],
                "iteration_seconds": seconds, "warmup": warmup, "median_iteration_s": median,
                "samples_per_s": self.spec.batch / median if median > 0 else 0.0, "peak_bytes": peak}

    def write_outputs(self, out: Path, warmup: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        if self.results:
            write_atomic(outputs_file(out, self.role.rank), pack_values(self.results))
        if self.role.replica == 0 and self.training:
            tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_tensors.items()}
            save_file(tensors, str(parameters_file(out, self.role.stage)), metadata={"stage": str(self.role.stage)})
        timeline_file(out, self.role.rank).write_bytes(timeline.dumps(self.recorder.drain()))
        write_atomic(rank_report_file(out, self.role.rank), json.dumps(self.report(warmup), indent=2).encode())


# -- the process -----------------------------------------------------------------------------

def rank_device(backend: str, device: str, local_rank: int) -> torch.device:
    """NCCL: one device per rank (cuda:LOCAL_RANK, which NCCL requires to be distinct).
    gloo with device cuda: ranks share the node's GPUs round-robin and stage tensors through
    the host for the transfers."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InputError(f"the run asks for device cuda (backend {backend}) but this process sees no CUDA "
                         "device; give the container a GPU, or run with backend gloo on the CPU")
    count = torch.cuda.device_count()
    if backend == "nccl" and local_rank >= count:
        raise InputError(f"local rank {local_rank} needs its own GPU for NCCL, but this node has {count}; start at "
                         f"most {count} ranks per node")
    index = local_rank % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def run_rank(run: DistributedRun, context: Path, out: Path, *, data_dir: Path | None, rank: int, local_rank: int,
             warmup: int = 1, digest: str | None = None, parameters: Path | None = None) -> None:
    """Joins the process group (``env://``: MASTER_ADDR, MASTER_PORT), trains (or infers),
    writes outputs. ``parameters``: a finished run's output directory whose weights replace
    the artifact's (:meth:`StageRank.load_parameters`).

    The rank's stage is verified before it is loaded: against the context's
    ``stages/flatpack.index.json``, which must have sha256 ``digest`` when one is given
    (``--digest`` or ``FLATPACK_DIGEST``, set where the rank is started, not in the context)."""
    if not digest:
        # as a function worker refuses one (runtime.function.artifact_index): without a digest
        # only the context's own index would vouch for the stage, which whoever wrote it chose
        raise ArtifactError(f"this rank was started with no artifact digest (--digest or ${DIGEST_ENV} is empty or "
                            "unset), so its stage cannot be verified and will not be loaded; start it with the "
                            f"digest of the compiled artifact (Compiled.digest), as gpu_container.deploy sets "
                            f"${DIGEST_ENV}")
    layout = run.layout
    world = int(os.environ.get("WORLD_SIZE", layout.world_size))
    if world != layout.world_size:
        raise InputError(f"the plan has {layout.world_size} stage replicas (degrees {list(layout.degrees)}), but "
                         f"WORLD_SIZE is {world}; start exactly one rank per stage replica")
    role = layout.role(rank)
    device = rank_device(run.backend, run.device, local_rank)
    module = load_stage(stage_path(context, role.stage), digest=digest)
    kwargs: dict[str, Any] = {}
    if run.backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(run.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=run.spec.wait_timeout_s), **kwargs)
    try:
        channels = Channels.create(run, role)
        worker = StageRank(run, role, module, device, channels, data_dir)
        if parameters is not None:
            worker.load_parameters(parameters)
        worker.train()
        worker.write_outputs(out, warmup)
        # nobody leaves before everyone has sent everything: a peer may still be reading
        dist.barrier(group=channels.control_gradients)
    finally:
        dist.destroy_process_group()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flatpack.runtime.distributed",
                                     description="One rank of a gpu-container training or inference run (start it "
                                                 "with torchrun).")
    parser.add_argument("--context", required=True, help="the packaged context: run.json and stages/")
    parser.add_argument("--run", help=f"the run document (default: CONTEXT/{RUN_FILE})")
    parser.add_argument("--data", help=f"directory of iter_NNNNNN.safetensors batches (default: CONTEXT/{DATA_DIR})")
    parser.add_argument("--synthetic", action="store_true", help="generate batches from the manifest shapes")
    parser.add_argument("--out", default="out", help="where ranks write parameters, reports and timelines")
    parser.add_argument("--iterations", type=int, help="override the run document's iteration count")
    parser.add_argument("--batch", type=int, help="override the global batch (synthetic throughput runs)")
    parser.add_argument("--warmup", type=int, default=1, help="iterations left out of the median seconds")
    parser.add_argument("--digest", help=f"the artifact digest the stages must match (default: ${DIGEST_ENV})")
    parser.add_argument("--parameters", help="a finished training run's output directory: its stage_NNN.safetensors "
                                             "replace the artifact's weights")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    context = Path(args.context)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    run: DistributedRun | None = None
    try:
        run = DistributedRun.loads(Path(args.run or context / RUN_FILE).read_bytes())
        run = with_overrides(run, iterations=args.iterations, batch=args.batch)
        data_dir = None if args.synthetic else Path(args.data or context / DATA_DIR)
        run_rank(run, context, Path(args.out), data_dir=data_dir, rank=rank, local_rank=local_rank,
                 warmup=args.warmup, digest=args.digest if args.digest is not None else os.environ.get(DIGEST_ENV),
                 parameters=Path(args.parameters) if args.parameters else None)
    except Exception:  # noqa: BLE001 - the launcher reads the traceback from this rank's log
        failed_at = time.time()
        trace = traceback.format_exc()
        print(f"flatpack rank {rank} ({_describe(run, rank)}) failed:\n{trace}", file=sys.stderr, flush=True)
        _record_failure(Path(args.out), rank, failed_at, trace)
        return 1
    return 0


def with_overrides(run: DistributedRun, *, iterations: int | None, batch: int | None) -> DistributedRun:
    """``run`` with the command line's ``--iterations`` and ``--batch``, where given."""
    if batch is not None and batch < run.spec.micro_batches:
        raise InputError(f"--batch {batch} is smaller than the run's {run.spec.micro_batches} micro-batches, and "
                         f"every micro-batch needs a sample: pass --batch {run.spec.micro_batches} or more")
    if iterations is None and batch is None:
        return run
    return replace(run, iterations=run.iterations if iterations is None else iterations,
                   spec=run.spec if batch is None else replace(run.spec, batch=batch))


def _record_failure(out: Path, rank: int, failed_at: float, trace: str) -> None:
    """When one rank fails its peers fail soon after (their connections close); the time
    lets the launcher report the first failure, the cause, rather than the echoes."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(error_file(out, rank), json.dumps({"rank": rank, "time": failed_at, "traceback": trace}).encode())
    except OSError:
        pass   # the log still has the traceback


def _describe(run: DistributedRun | None, rank: int) -> str:
    """The rank's stage and replica, for the failure message; the run may not have loaded."""
    if run is None:
        return "stage unknown"
    try:
        role = run.layout.role(rank)
    except InputError:
        return "stage unknown"
    return f"stage {role.stage}, replica {role.replica}"


def iter_reports(out: Path) -> Iterator[dict[str, Any]]:
    for path in sorted(out.glob("rank_*.json")):
        yield json.loads(path.read_text())


if __name__ == "__main__":
    sys.exit(main())
