"""What every function backend shares: a deployment whose stage replicas are functions that
share nothing but a store, and the invoker that runs training and fork-join inference on
them (``runtime.worker`` is the function's side).

A backend subclasses :class:`FunctionDeployment` and says how to start one function
(:meth:`FunctionDeployment.launch`: a local process, a Lambda invocation, a Function Compute
invocation); the invoker plays the platform's part everywhere else: it starts functions,
restarts one that was lost (killed, a straggler relaunched), invokes again one that
checkpointed near its time limit, and re-scales stages between epochs when an elasticity
policy asks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, TextIO, Unpack

import torch
from torch.utils.data import DataLoader

from flatpack.analysis.host_load import INVOKER_POLL_S
from flatpack.backends.batch_checks import batch_values, check_training_call
from flatpack.backends.protocol import Capability
from flatpack.backends.elastic_policy import ElasticPolicy, ElasticScaler, check_elastic
from flatpack.backends.replan import Replanner, ReplanPolicy, check_replan, check_switchable
from flatpack.backends.results import Restart, TrainResult
from flatpack.backends.results import merge_results as merge_results   # job.py's name for it
from flatpack.compiler import Compiled
from flatpack.data import loader_batches
from flatpack.errors import ArtifactRefused, FunctionOutOfMemory, InputError, RunFailure, StoreError
from flatpack.ir import structure
from flatpack.partitioner.cost.gillis import ForkJoinPlan
from flatpack.partitioner.workload import Workload
from flatpack.platform.catalog import get_platform
from flatpack.progress import ProgressLine
from flatpack.runtime import channel_split, chaos, forkjoin, timeline
from flatpack.runtime.forkjoin import ForkJoinSpec, GroupSpec, stop_message
from flatpack.runtime.function import Role
from flatpack.runtime.keys import RunKeys
from flatpack.safeio import expect_mapping, parse_json
from flatpack.runtime.settings import (RunControls, TrainOptions, TrainSettings, fields_of, refuse_unhonoured,
                                       resolve_options)
from flatpack.runtime.spec import RunSpec, StageSpec, shared_holders, split_value, stage_specs
from flatpack.runtime.store import Store
from flatpack.runtime.store_url import open_store
from flatpack.runtime.training import TARGET
from flatpack.runtime.worker import OUT_OF_MEMORY, REINVOKE
from flatpack.stage import wire
from flatpack.stage.artifact import build_module
from flatpack.stage.wire import pack_values
from flatpack.table import plural
from flatpack.units import MIB
from flatpack.weights import state_dict_of

# every function backend (local, aws-lambda, alibaba-fc) runs FunctionDeployment: all of it
FUNCTION_CAPABILITIES = frozenset(Capability)
# the invoker's poll of its workers' reports; the host bound counts its lists (analysis.host_load)
POLL_S = INVOKER_POLL_S
DATA_WINDOW = 4          # iterations of data kept uploaded ahead of the slowest worker (the first stage prefetches)
# an iteration's data and target keys go up this many at a time. One after another, a 2 x 2
# vgg16 plan's 16 puts took the local invoker 0.46 s per iteration on a loaded host (25 ms
# each beside its 4 workers and the store), longer than the iteration: the window drained and
# the first stage's prefetch waited ~0.1 s for its data. On a quiet host the demo's steady
# state was 302.5 ms one put at a time, 250.7 ms eight at a time (benchmarks/steady_state.py;
# BENCHMARKS.md, issue 19's ninth pass)
FEED_THREADS = 8
MAX_RESTARTS = 3         # per worker, for lost functions and relaunched stragglers
# the invoker deletes finished iterations' keys at most this often (a segment's end deletes
# the rest): each deletion lists every kind of key once, and deleting after every 0.2 s
# iteration of bert-large 2 x 1 kept the local S3 server busy enough to slow the iteration
# 28 % (BENCHMARKS.md, "Issue 19, sixth pass")
RELEASE_EVERY_S = 1.0

# what train() trains on: global (inputs, target) batches, a function of the iteration, or a DataLoader
Batches = Sequence[Any] | Callable[[int], Any] | DataLoader
WAIT_TIMEOUT_S = 120.0   # a function's wait on a peer's tensor, when the call names none


class Invocation(Protocol):
    """A running function as the invoker sees it (``subprocess.Popen`` is one): its exit
    code once it ended, and a way to stop waiting for it."""

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class CallRecord:
    """One train() call as the store keeps it (``RunKeys.call``), so that another process
    can resume it: its iteration numbers, the checkpoint it started from, where its first
    batch sits in the caller's data, and its :class:`TrainSettings` (resolved: micro-batches
    and sync as the call ran). The store is a file tree a run directory holds, so a record
    holds nothing but training settings: a run control written into one by hand (``faults``,
    ``timeout_s``) makes it a :class:`StoreError`, never a knob of the resume
    (tests/security/test_run_records.py)."""

    first_iteration: int
    iterations: int
    initial_checkpoint: int | None
    batch_offset: int
    settings: TrainSettings

    def dumps(self) -> bytes:
        return json.dumps({"first_iteration": self.first_iteration, "iterations": self.iterations,
                           "initial_checkpoint": self.initial_checkpoint, "batch_offset": self.batch_offset,
                           "settings": self.settings.to_json()}).encode()

    @classmethod
    def loads(cls, raw: bytes) -> CallRecord:
        what = "a train() call record in the store"
        data = expect_mapping(parse_json(raw, what=what, error=StoreError), what=what, error=StoreError)
        if not isinstance(data.get("settings"), dict):
            raise StoreError(f"{what} has no settings object; it is not one this flatpack wrote")
        try:
            settings = TrainSettings.from_json(data.pop("settings"))
            return cls(settings=settings, **data)
        except (InputError, TypeError, ValueError) as err:
            raise StoreError(f"{what} is not one this flatpack wrote ({err})") from None


@dataclass
class _Worker:
    role: Role
    process: Invocation


class FunctionDeployment:
    """A compiled model deployed as functions on ``platform``; ``train`` and ``infer`` run it.

    ``store_url`` is the store the functions share (``env`` holds the credentials the
    invoker's own client uses); ``emulate_tiers``: the functions hold themselves to their
    tier's CPU share and bandwidth (the local backend), where a real platform enforces them.
    """

    platform = "local"
    emulate_tiers = True
    time_limit_s: float | None = None    # a function checkpoints and is invoked again before this (Lambda's 900 s)

    def __init__(self, compiled: Compiled, store_url: str, env: dict[str, str], keys: RunKeys, workdir: Path,
                 store: Store | None = None) -> None:
        self.compiled = compiled
        self.store_url = store_url
        self.env = env
        self.keys = keys
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.store: Store = store if store is not None else _open_with_env(store_url, env)
        self.workers: dict[tuple, _Worker] = {}
        self._inference: str | None = None
        self._requests = 0
        self._batch_size: int | None = None     # every call trains on one batch size (replicas average shards)
        self.last_latency_s: float | None = None
        self.manifests = [artifact.manifest for artifact in compiled.artifacts]
        # what every invocation carries for its worker to verify the artifact against; the
        # index itself travels with the stages (the local store's artifacts/, an image's
        # artifacts/: local.package, images.function_images)
        self.digest = compiled.digest

    def launch(self, role: Role) -> Invocation:
        """Starts the function for ``role``."""
        raise NotImplementedError(f"{type(self).__name__} must say how to start a function")

    # settings -----------------------------------------------------------------------------
    def _stage_specs(self, degrees: Sequence[int]) -> tuple[StageSpec, ...]:
        return stage_specs(self.manifests, self.compiled.info.input_names, degrees,
                           [stage.memory_mb for stage in self.compiled.plan.stages],
                           get_platform(self.platform).tier if self.emulate_tiers else None,
                           [stage.recompute for stage in self.compiled.plan.stages])

    def _shared(self) -> dict[str, tuple[int, ...]]:
        return shared_holders(self.manifests)

    def adopt(self, compiled: Compiled, keys: RunKeys) -> None:
        """Runs ``compiled`` under ``keys`` from now on: a plan switch (``backends.replan``),
        which first puts the new stages and the moved checkpoints under ``keys``."""
        self.compiled, self.keys = compiled, keys
        self.manifests = [artifact.manifest for artifact in compiled.artifacts]
        self.digest = compiled.digest

    def respecified(self, spec: RunSpec) -> RunSpec:
        """``spec`` for this deployment's plan: its stages at the plan's replica degrees and
        tiers, its tied weights' holders; every other setting of the run kept."""
        degrees = [stage.replicas for stage in self.compiled.plan.stages]
        return dataclasses.replace(spec, stages=self._stage_specs(degrees), shared=self._shared())

    def dollars_per_second(self, degrees: Sequence[int]) -> float:
        platform = get_platform(self.platform)
        return sum(platform.tier(stage.memory_mb).price_per_s * degree
                   for stage, degree in zip(self.compiled.plan.stages, degrees) if stage.memory_mb)

    # data ---------------------------------------------------------------------------------
    def _upload_batch(self, iteration: int, batch: Any, micro_batches: int) -> int:
        values, target, size = batch_values(self.compiled, batch, iteration)
        if size < micro_batches:
            raise InputError(f"batch {iteration} has {plural(size, 'sample')}; it cannot be cut into "
                             f"{plural(micro_batches, 'micro-batch', 'micro-batches')}. Use a larger batch or fewer "
                             "micro-batches")
        pieces = {name: split_value(value, size, micro_batches) for name, value in values.items()}
        targets = split_value(target, size, micro_batches) if isinstance(target, torch.Tensor) else None
        objects = {self.keys.data(iteration, m): pack_values({name: piece[m] for name, piece in pieces.items()})
                   for m in range(micro_batches)}
        if targets is not None:
            objects.update({self.keys.target(iteration, m): wire.dumps({TARGET: targets[m].contiguous()})
                            for m in range(micro_batches)})
        with ThreadPoolExecutor(max_workers=min(FEED_THREADS, len(objects)),
                                thread_name_prefix="flatpack-feed") as pool:
            puts = [pool.submit(self.store.put, key, data) for key, data in objects.items()]
        # every put has finished (the pool's exit waits): the first failure, if any, is raised
        for put in puts:
            put.result()
        return size

    # training -----------------------------------------------------------------------------
    def train(self, batches: Batches, settings: TrainSettings | None = None, controls: RunControls | None = None,
              **options: Unpack[TrainOptions]) -> TrainResult:
        """Trains ``controls.iterations`` global batches through the pipeline and returns the
        final parameters (read from the last checkpoints), the losses and the timeline.

        ``settings`` (:class:`~flatpack.runtime.settings.TrainSettings`) is what the pipeline
        computes, recorded with the call so :meth:`resume` repeats it; ``controls``
        (:class:`~flatpack.runtime.settings.RunControls`) how the call is driven. A Python
        caller may name their fields as keywords instead (``iterations=3, micro_batches=4``),
        over ``settings`` and ``controls`` when given; an unknown name is an ``InputError``.

        ``batches``: a sequence of ``(inputs, target)`` global batches, a function of the
        iteration, or a ``torch.utils.data.DataLoader`` (one epoch unless ``iterations`` says
        more; dict samples go to the model's inputs by name, ``target`` to the loss:
        :func:`flatpack.data.loader_batches`). ``elastic(epoch, degrees) -> new degrees | None``
        is asked at every epoch boundary (``epoch_iterations``); ``elastic`` may instead be a
        :class:`~flatpack.backends.elastic_policy.ElasticPolicy`, which re-fits the cost model to
        each epoch and changes degrees (and cuts) when the predicted saving exceeds the model's
        error on the run (its decisions are in the result's ``decisions``). ``straggler_ratio``: relaunch a
        replica that has not finished its micro-batches ``ratio`` × the peers' compute time
        after they did.

        A second call continues from the weights the first one left (its last checkpoint),
        and so does a call after a failed one (from the last checkpoint every stage took).
        ``batch_offset``: the index of this call's first batch in the caller's data (what
        :meth:`resume` uses). ``store_faults``: transient store errors and stalls injected into
        the functions' store clients for chaos runs (``runtime.chaos``). ``precision``: "fp32",
        "bf16" (autocast in every stage, float32 master weights and optimizer state, bfloat16
        tensors between stages: ``runtime.precision``) or "fp16" (the same in float16, the loss
        scaled as ``torch.amp.GradScaler`` scales it, with ``loss_scaling``'s settings).
        ``schedule``: "sync" (FuncPipe), "1f1b" (PipeDream's 1F1B with a flush per iteration)
        or "1f1b-async" (no flush, an optimizer step per micro-batch with weight stashing, and
        with ``vertical_sync`` every stage on the first stage's version: ``runtime.stashing``).
        ``non_finite``: what a NaN or infinity does, in the inputs and in an iteration's loss:
        "warn" (once), "error" (stops the call; the checkpoints stay) or "ignore". ``replan``:
        True or a :class:`~flatpack.backends.replan.ReplanPolicy` moves the run onto a plan
        predicted faster after an epoch (``backends.replan``; the local backend, not with
        ``elastic`` or 1f1b-async); the switches are in the result's ``switches``.
        """
        settings, controls = resolve_options(settings, controls, options)
        if isinstance(batches, DataLoader):
            batches = loader_batches(batches, controls.iterations)
            controls = controls.replace(iterations=controls.iterations or len(batches))
        settings, controls = resolve_settings(self.compiled, settings), self._controls(controls)
        iterations = iteration_count(batches, controls.iterations)
        # the data and settings, checked before any function starts; the batch size measured
        # here is the one the workers cut into micro-batches
        self._batch_size = check_training_call(
            self.compiled, batches, iterations=iterations, optimizer=settings.optimizer,
            micro_batches=settings.micro_batch_count, previous_batch_size=self._batch_size,
            non_finite=controls.non_finite)
        degrees = tuple(stage.replicas for stage in self.compiled.plan.stages)
        # inference functions hold the weights they loaded; the next request restarts them
        self.stop_inference()
        first = self.next_iteration()
        spec = RunSpec.of(settings, controls, run=self.keys.run, stages=self._stage_specs(degrees),
                          shared=self._shared(), batch=self._batch_size, loss_output=loss_output(self.compiled),
                          first_iteration=first, initial_checkpoint=self.consistent_checkpoint())
        replanner = self._replanner(spec, controls, iterations)
        record = CallRecord(first, iterations, spec.initial_checkpoint, controls.batch_offset, settings)
        self.store.put(self.keys.call(first), record.dumps())
        batch_for = batches if callable(batches) else batches.__getitem__
        # a policy object decides through the scaler; a callback is asked by the run itself
        callback = controls if not isinstance(controls.elastic, ElasticPolicy) else controls.replace(elastic=None)
        run = _Run(self, spec, lambda iteration: batch_for(iteration - first), first, first + iterations, callback,
                   replanner)
        return run.execute()

    def _controls(self, controls: RunControls) -> RunControls:
        """``controls`` with this backend's defaults where they name none: the platform's time
        limit, and a worker's wait on a peer."""
        return controls.replace(
            time_limit_s=controls.time_limit_s if controls.time_limit_s is not None else self.time_limit_s,
            wait_timeout_s=controls.wait_timeout_s if controls.wait_timeout_s is not None else WAIT_TIMEOUT_S)

    def _replanner(self, spec: RunSpec, controls: RunControls, iterations: int) -> Replanner | ElasticScaler | None:
        """The re-planner ``controls.replan`` or the elastic policy ``controls.elastic`` asks
        for, checked against the call (None: none)."""
        spec.check_schedule(replan=bool(controls.replan), elastic=controls.elastic is not None)
        if isinstance(controls.elastic, ElasticPolicy):
            return self._elastic_scaler(controls.elastic, spec, controls, iterations)
        if not controls.replan:
            return None
        policy = ReplanPolicy.of(controls.replan)
        check_replan(self, policy, elastic=controls.elastic is not None,
                     epoch_iterations=controls.epoch_iterations, iterations=iterations)
        return Replanner(policy)

    def _elastic_scaler(self, policy: ElasticPolicy, spec: RunSpec, controls: RunControls,
                        iterations: int) -> ElasticScaler:
        """The scaler an :class:`~flatpack.backends.elastic_policy.ElasticPolicy` asks for,
        checked against the call before any function starts."""
        if controls.replan:
            raise InputError("an elastic policy re-plans the cuts with the degrees (ElasticPolicy(cuts=True), "
                             "--elastic auto) and replan replaces the plan at the same boundaries; give one of them")
        check_switchable(self, "elastic", epoch_iterations=controls.epoch_iterations, iterations=iterations,
                         refits=True)
        check_elastic(self, policy, spec.micro_batches)
        assert controls.epoch_iterations is not None   # check_switchable refused a call without epochs
        return ElasticScaler(policy, controls.epoch_iterations)

    # calls and checkpoints ------------------------------------------------------------------
    def calls(self) -> list[CallRecord]:
        """The run's train() calls so far, oldest first (read from the store: a deployment
        opened by another process sees them too)."""
        return [CallRecord.loads(self.store.get(key)) for key in sorted(self.store.list(self.keys.calls()))]

    def next_iteration(self) -> int:
        """The first iteration number no call of this run has used (numbers are never reused)."""
        return max((call.first_iteration + call.iterations for call in self.calls()), default=0)

    def consistent_checkpoint(self) -> int | None:
        """The latest iteration after which every stage has a checkpoint: the weights a new
        call, a resumed call and inference start from (None: the compiled weights)."""
        common: set[int] | None = None
        for stage in range(len(self.compiled.plan.stages)):
            taken = set(checkpoints_taken(self.store, self.keys, stage))
            common = taken if common is None else common & taken
        return max(common) if common else None

    def parameters(self, iteration: int | None = None) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers (original names) after ``iteration``, by default
        the latest iteration every stage checkpointed; the compiled weights before any."""
        iteration = self.consistent_checkpoint() if iteration is None else iteration
        if iteration is None:
            return {name: tensor.detach().clone() for artifact in self.compiled.artifacts
                    for name, tensor in artifact.tensors.items()}
        return checkpoint_parameters(self.store, self.keys, len(self.compiled.plan.stages), iteration)

    def state_dict(self, iteration: int | None = None) -> dict[str, torch.Tensor]:
        """What the original model's ``load_state_dict`` takes: every key of its state dict
        (tied weights under each of their names, persistent buffers) after ``iteration``, by
        default the latest every stage checkpointed (:func:`flatpack.weights.state_dict_of`).
        Save it with :func:`flatpack.save_state_dict`."""
        return state_dict_of(self.compiled, self.parameters(iteration))

    def resume(self, batches: Sequence[Any] | Callable[[int], Any], controls: RunControls | None = None,
               **options: Unpack[TrainOptions]) -> TrainResult | None:
        """Continues the run's last train() call after any crash (a worker, the invoker, the
        store server) from the last checkpoint every stage has, with the settings the call
        recorded, on the same ``batches`` the call was given. ``controls`` (or their fields as
        keywords: ``timeout_s=120``) drive the resumed call; a training setting is refused,
        since the call's recorded ones are repeated (tests/unit/test_train_settings.py).
        Returns None when that call had finished."""
        settings, controls = resolve_options(None, controls, options, what="resume()")
        if settings != TrainSettings():
            raise InputError("resume() repeats the settings the call recorded; give it run controls only "
                             f"({', '.join(sorted(fields_of(TrainSettings, options)))} are training settings). "
                             "Start a new train() call to train otherwise")
        calls = self.calls()
        if not calls:
            raise InputError(f"run {self.keys.run} has no train() call to resume; call train() first")
        last = calls[-1]
        done = self.consistent_checkpoint()
        trained = 0 if done is None or done < last.first_iteration else done + 1 - last.first_iteration
        if trained >= last.iterations:
            return None
        batch_for = batches if callable(batches) else batches.__getitem__
        offset = last.batch_offset + trained
        return self.train(lambda index: batch_for(offset + index), last.settings,
                          controls.replace(iterations=last.iterations - trained, batch_offset=offset))

    def measure_latency(self, samples: int = 21) -> float:
        """Median seconds of one small store access (a put or a get) from this process: the
        t_lat the cost models add per transfer, measured instead of assumed."""
        key = f"{self.keys.run}/probe/latency"
        times = []
        for index in range(samples):
            started = time.perf_counter()
            if index % 2:
                self.store.get(key)
            else:
                self.store.put(key, b"x" * 64)
            times.append(time.perf_counter() - started)
        self.store.delete(key)
        return sorted(times)[len(times) // 2]

    # inference ----------------------------------------------------------------------------
    def infer(self, inputs: Any, settings: TrainSettings | None = None, controls: RunControls | None = None,
              **options: Unpack[TrainOptions]) -> Any:
        """Serves one request through Gillis's fork-join (``runtime.forkjoin``) and returns
        the model's outputs, structured as the model returns them. The first call starts
        the master and the workers (with ``threads`` and ``wait_timeout_s``); they stay warm
        for later requests. Any other setting is refused: a fork-join request has no
        micro-batches, optimizer or schedule."""
        settings, controls = resolve_options(settings, controls, options, what="infer()")
        refuse_unhonoured(settings, controls, ("threads", "wait_timeout_s"), what="infer() on functions",
                          why="it serves one fork-join request")
        threads = settings.threads or 1
        wait_timeout_s = controls.wait_timeout_s if controls.wait_timeout_s is not None else WAIT_TIMEOUT_S
        names = self.compiled.info.input_names
        values = dict(zip(names, self.compiled.input_leaves(inputs)))
        self._check_batch_splits(forkjoin.request_batch(values))
        if self._inference is None:
            self._inference = self._start_inference(threads, wait_timeout_s)
        request = self._requests
        self._requests += 1
        started = time.time()
        self.store.put(self.keys.infer(str(request), 0, 0, "request"), pack_values(values))
        raw = self._wait_response(request, wait_timeout_s)
        self.last_latency_s = time.time() - started
        outputs = forkjoin.unpack_values(raw)
        output_names = self.compiled.info.output_names
        return structure.rebuild(self.compiled.info.output_structure, lambda index: outputs[output_names[index]])

    def _wait_response(self, request: int, timeout_s: float) -> bytes:
        key = self.keys.infer(str(request), 0, 0, "response")
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.store.exists(key):
                return self.store.get(key)
            for worker in self.workers.values():
                code = worker.process.poll()
                if code is not None:
                    status = read_status(self.store, self.keys, worker.role)
                    if code == OUT_OF_MEMORY:
                        raise oom_error(worker.role, status, platform_tiers_mb(self.compiled))
                    if status.get("status") == "refused":
                        raise refused_error(worker.role, status)
                    if status.get("status") == "input":
                        raise input_error(worker.role, status)
                    raise RunFailure(f"inference function {worker.role.worker} ({worker.role.kind}) exited with code "
                                     f"{code}:\n{status.get('traceback', 'no status; see ' + str(self.workdir))}")
            time.sleep(0.002)
        raise RunFailure(f"request {request} got no response within {timeout_s:.0f} s; logs in {self.workdir}")

    def _check_batch_splits(self, batch: int) -> None:
        """InputError, before any function starts, when a group split by batch has more
        partitions than the request has samples."""
        for index, group in enumerate(ForkJoinPlan.from_plan(self.compiled.plan).groups):
            if group.workers and group.split == "batch" and group.partitions > batch:
                raise InputError(f"group {index} (layers {group.start}..{group.end}) splits the request's batch over "
                                 f"{group.partitions} partitions, but this request has {batch} sample(s); send at "
                                 "least that many, or compile the plan with split='channel' for this stage (or "
                                 "fewer replicas)")

    def _start_inference(self, threads: int, wait_timeout_s: float) -> str:
        spec = self.inference_spec(threads, wait_timeout_s)
        spec_key = self.keys.inference_spec()
        self.store.put(spec_key, spec.dumps())
        for role in forkjoin.roles(spec, spec_key, self.digest):
            self.workers[(role.kind, role.stage, role.replica)] = _Worker(role, self.launch(role))
        return spec_key

    def inference_spec(self, threads: int = 1, wait_timeout_s: float = WAIT_TIMEOUT_S) -> ForkJoinSpec:
        """What the fork-join functions of this deployment serve: the plan's groups, each
        channel split checked here, before any function starts."""
        plan = ForkJoinPlan.from_plan(self.compiled.plan)
        tier = get_platform(self.platform).tier(plan.memory_mb) if plan.memory_mb and self.emulate_tiers else None
        groups = []
        for index, (group, manifest) in enumerate(zip(plan.groups, self.manifests)):
            joins: tuple[str, ...] = ()
            if group.workers and group.split == "channel":
                # the same analysis the workers run: refused here, before any function starts
                where = f"group {index} (layers {group.start}..{group.end})"
                _, analysis = channel_split.analyse_stage(build_module(self.compiled.artifacts[index]), where)
                analysis.check_partitions(group.partitions, where)
                joins = channel_split.joins(analysis)
            groups.append(GroupSpec(index, group.workers, group.on_master,
                                    manifest.input_names, manifest.output_names, group.split, joins))
        return ForkJoinSpec(self.keys.run, tuple(groups), plan.memory_mb, tier.vcpus if tier else None,
                            tier.bandwidth_bytes_s if tier else None, self.compiled.info.input_names,
                            self.compiled.info.output_names, threads, wait_timeout_s,
                            checkpoint=self.consistent_checkpoint())

    def stop_inference(self) -> None:
        """Tells the warm inference functions to end (they exit after their current request)."""
        if self._inference is None:
            return
        request = str(self._requests)
        for worker in self.workers.values():
            role = worker.role
            if role.kind == "infer-worker":
                self.store.put(self.keys.infer(request, role.stage, role.replica, "in"), stop_message())
        self.store.put(self.keys.infer(request, 0, 0, "request"), stop_message())
        for key, worker in list(self.workers.items()):
            if worker.role.kind.startswith("infer"):
                try:
                    worker.process.wait(timeout=10)
                except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired or a platform's own timeout
                    worker.process.kill()
                del self.workers[key]
        self._inference = None
        # the next inference functions count requests from 0 again: they must not find this
        # session's requests (or its stop messages) under the same keys
        self.store.delete_prefix(f"{self.keys.run}/infer/")
        self._requests = 0

    # lifecycle ----------------------------------------------------------------------------
    def stop_workers(self) -> None:
        for worker in self.workers.values():
            if worker.process.poll() is None:
                worker.process.kill()
        for worker in self.workers.values():
            worker.process.wait()
        self.workers.clear()

    def teardown(self) -> None:
        """Stops every function and deletes the run's objects."""
        self.stop_inference()
        self.stop_workers()
        try:
            self.store.delete_prefix(self.keys.prefix)
        except Exception:  # noqa: BLE001 - the server may already be gone; nothing else to clean
            pass

    def __enter__(self) -> FunctionDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


def _open_with_env(url: str, env: dict[str, str]) -> Store:
    """The invoker's own client of the store its functions use; the credentials the
    functions get through their environment are handed to it in-process."""
    if url.startswith("s3://") and "AWS_ACCESS_KEY_ID" in env:
        return open_store(url, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
                          aws_session_token=env.get("AWS_SESSION_TOKEN"))
    return open_store(url)


def checkpoints_taken(store: Store, keys: RunKeys, stage: int) -> dict[int, str]:
    """The iterations after which ``stage`` has a checkpoint in the store, each with its key."""
    return {int(key.rsplit("/i", 1)[1]): key for key in store.list(keys.checkpoints(stage))}


def checkpoint_tensors(store: Store, keys: RunKeys, stage: int, iteration: int) -> dict[str, torch.Tensor]:
    """A stage's checkpoint after ``iteration``: its weights and buffers (``w/<name>``) and its
    optimizer state (``o/<position>/<key>``, ``training.StageTrainer.state_bytes``)."""
    tensors, _ = wire.loads(store.wait(keys.checkpoint(stage, iteration), 60))
    return tensors


def checkpoint_parameters(store: Store, keys: RunKeys, stages: int, iteration: int) -> dict[str, torch.Tensor]:
    """The weights in every stage's checkpoint after ``iteration``, by original name (a tied
    parameter several stages hold appears once)."""
    parameters: dict[str, torch.Tensor] = {}
    for stage in range(stages):
        for key, tensor in checkpoint_tensors(store, keys, stage, iteration).items():
            if key.startswith("w/"):
                parameters.setdefault(key[2:], tensor)
    return parameters


def read_status(store: Store, keys: RunKeys, role: Role) -> dict:
    """A function's final status record; empty when it left none (it was lost)."""
    try:
        return json.loads(store.get(keys.status(role.stage, role.replica, role.attempt, role.start_iteration)))
    except Exception:  # noqa: BLE001 - a lost function leaves no status
        return {}


def input_error(role: Role, status: dict) -> RunFailure:
    """The error for a function that refused a value its stage was not compiled for (the
    worker's check names the input, the shape or dtype expected and the one given)."""
    what = f"stage {role.stage}, replica {role.replica}" if role.kind == "train" else f"{role.kind}, stage {role.stage}"
    return RunFailure(f"function {role.worker} ({what}) stopped before running its stage on a wrong input: "
                      f"{status.get('error')}")


def refused_error(role: Role, status: dict) -> ArtifactRefused:
    """The error for a function whose status says it refused its stage artifact (never retried:
    the bytes in the store will not change back by themselves)."""
    cause = str(status.get("error")).rstrip(".")
    what = f"stage {role.stage}, replica {role.replica}" if role.kind == "train" else f"{role.kind}, stage {role.stage}"
    return ArtifactRefused(f"function {role.worker} ({what}) refused its stage artifact, and ran none of it: {cause}. "
                           f"The artifact in the store no longer matches what was deployed (digest "
                           f"{role.digest[:16]}…): deploy again from a verified artifact, and find out who can write "
                           "the store.")


MEMORY_HEADROOM = 1.1   # a measured peak varies run to run: the suggested tier holds 10% more


def memory_suggestion_mb(peak_bytes: int, tiers_mb: Sequence[int] = ()) -> int:
    """The memory tier to suggest for a function whose measured peak was ``peak_bytes``: the
    smallest of ``tiers_mb`` (the platform's) holding the peak plus headroom; without tiers,
    or when none holds it, that amount rounded up to 64 MB."""
    needed = peak_bytes * MEMORY_HEADROOM
    fitting = [tier for tier in tiers_mb if tier * MIB >= needed]
    if fitting:
        return min(fitting)
    return math.ceil(needed / (64 * MIB)) * 64


def oom_error(role: Role, status: dict, tiers_mb: Sequence[int] = ()) -> FunctionOutOfMemory:
    """The error for a function whose status says it passed its memory tier, with the tier to
    give it (:func:`memory_suggestion_mb` over the platform's ``tiers_mb``)."""
    peak, limit = int(status["peak_bytes"]), int(status["limit_bytes"])
    over = peak - limit
    suggestion = memory_suggestion_mb(peak, tiers_mb)
    what = f"stage {role.stage} replica {role.replica}" if role.kind == "train" else f"{role.kind} {role.worker}"
    return FunctionOutOfMemory(
        f"{what} ran out of memory: its peak was {peak / MIB:.0f} MB during "
        f"{status['task']}, and its tier is {limit / MIB:.0f} MB ({over / MIB:.0f} MB over). Give stage "
        f"{role.stage} a tier of at least {suggestion} MB (from the command line: run again with --memory "
        f"{suggestion}, the tiers the solver may choose from), or cut it into smaller stages (a new plan starts "
        "a new run: the checkpoints of this one fit its stages only).",
        stage=role.stage, replica=role.replica, peak_bytes=peak, limit_bytes=limit)


def platform_tiers_mb(compiled: Compiled) -> tuple[int, ...]:
    """The memory tiers of the platform ``compiled`` was planned for (none for an artifact
    loaded without its problem)."""
    problem = compiled.problem
    return tuple(tier.memory_mb for tier in problem.platform.tiers) if problem is not None else ()


def iteration_count(batches: Sequence[Any] | Callable[[int], Any], iterations: int | None) -> int:
    """How many iterations ``train`` runs: ``iterations``, else one per batch given."""
    if iterations is None:
        if callable(batches):
            raise InputError("train was given a function of the iteration but no iterations=; say how many")
        iterations = len(batches)
    if iterations < 1:
        raise InputError(f"train needs at least one iteration, got {iterations}")
    if not callable(batches) and iterations > len(batches):
        raise InputError(f"train was asked for {plural(iterations, 'iteration')} but given "
                         f"{plural(len(batches), 'batch', 'batches')}; pass "
                         "more batches, fewer iterations, or a function of the iteration")
    return iterations


def workload_of(compiled: Compiled) -> Workload | None:
    """The workload the plan was solved for; None for a model compiled without a problem."""
    return compiled.problem.workload if compiled.problem is not None else None


def resolve_settings(compiled: Compiled, settings: TrainSettings) -> TrainSettings:
    """``settings`` for ``compiled``'s plan: the micro-batches the call gives, else the plan's,
    else its workload's (``Plan.micro_batches_for``), and the sync method the call gives, else
    the workload's."""
    workload = workload_of(compiled)
    return settings.replace(micro_batches=compiled.plan.micro_batches_for(workload, settings.micro_batches),
                            sync=settings.sync or (workload.sync if workload else "pipelined"))


def loss_output(compiled: Compiled) -> str:
    """The output the loss reads: the model's first, which must come out of the last stage
    (the loss runs there)."""
    first = compiled.info.output_names[0]
    if first not in compiled.artifacts[-1].manifest.output_names:
        raise InputError(f"the model's first output {first!r} is not produced by the last stage; the loss runs in "
                         "the last stage")
    return first


def call_progress_line(iterations: int, batch_offset: int, samples_per_iteration: int, dollars_per_second: float,
                       stream: TextIO | None = None) -> ProgressLine:
    """The progress line of one ``train()`` call of ``iterations`` after the run's first
    ``batch_offset``: it counts the run's iterations, so a call that resumes a run after its
    10th of 40 shows 11/40 next, not 1/30 (issue 41)."""
    return ProgressLine(batch_offset + iterations, samples_per_iteration, dollars_per_second, stream,
                        start_iteration=batch_offset)


class _Run:
    """The invoker's side of one training run: launches the functions of each segment,
    watches them, restarts lost ones and relaunches stragglers, feeds data ahead of them,
    deletes finished iterations' tensors and prints the progress line."""

    def __init__(self, deployment: FunctionDeployment, spec: RunSpec, batch_for: Callable[[int], Any], first: int,
                 end: int, controls: RunControls, replanner: Replanner | ElasticScaler | None = None) -> None:
        self.deployment = deployment
        # a chaos run's faults reach the invoker's own requests too (data, progress, garbage)
        self.store = chaos.wrap(deployment.store, spec.store_faults, salt="invoker")
        self.keys = deployment.keys
        self.spec = spec
        self.batch_for = batch_for     # of the iteration number
        self.first = first             # the call's iterations are first..end-1 (numbers unique in the run)
        self.end = end
        self.elastic = controls.elastic
        self.epoch_iterations = controls.epoch_iterations or end - first
        self.straggler_ratio = controls.straggler_ratio
        self.progress = controls.progress
        self.batch_offset = controls.batch_offset   # the run's iterations before this call (a resumed call's)
        self.timeout_s = controls.timeout_s
        self.non_finite = controls.non_finite
        self.warned_non_finite = False
        self.restarts: list[Restart] = []
        self.uploaded = first
        self.collected = first - 1     # every worker reported up to here (losses recorded)
        self.released = first - 1      # tensors deleted up to here: a checkpoint every stage has covers them
        # the deletions run beside the poll loop: on the local S3 server deleting three
        # iterations' keys took 0.5 s, during which the loop fed no data and collected no
        # report, and the first stage's prefetch waited 0.1-0.4 s for its input
        self.garbage = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flatpack-garbage")
        self.deleting: Future | None = None
        self.next_release_at = 0.0     # time.monotonic() before which _release deletes nothing
        self.segment_begin = first
        self.losses: dict[int, float] = {}
        self.samples = 0
        self.peaks: dict[str, int] = {}
        self.segment_started = 0.0
        self.dollars = 0.0
        self.line = None
        self.watching: dict[tuple[int, int, str], float] = {}      # a stage's phase -> its peers' pace
        self.late_since: dict[tuple[int, int, int, str], float] = {}
        self.relaunched: set[tuple[int, int, int]] = set()
        # backends.replan.Replanner or elastic_policy.ElasticScaler: may switch plans at epoch boundaries
        self.replanner = replanner
        self.earlier_events: list[timeline.Event] = []    # the timelines of the plans switched from

    def execute(self) -> TrainResult:
        started = time.time()
        degrees_seen = []
        segment, begin = 0, self.first

        shared_line = isinstance(self.progress, ProgressLine)   # the caller's, spanning several calls
        if shared_line:
            self.line = self.progress
            if self.line.origin is None:
                self.line.origin = self.first
        elif self.progress:
            self.line = call_progress_line(self.end - self.first, self.batch_offset, self.spec.batch,
                                           self.deployment.dollars_per_second([s.replicas for s in self.spec.stages]),
                                           stream=None if self.progress is True else self.progress)
        try:
            while begin < self.end:
                end = min(begin + self.epoch_iterations, self.end)
                degrees_seen.append(tuple(stage.replicas for stage in self.spec.stages))
                self._segment(begin, end)
                self._release_now(end)
                begin = end
                segment += 1
                if begin < self.end and self.elastic is not None:
                    wanted = self.elastic(segment, degrees_seen[-1])
                    if wanted is not None:
                        self.spec = self.spec.with_replicas(list(wanted))
                if begin < self.end and self.replanner is not None:
                    self._replan(self.replanner, begin - 1)
        except BaseException:
            self.deployment.stop_workers()
            raise
        finally:
            self.garbage.shutdown(wait=True, cancel_futures=True)
            if self.line is not None and not shared_line:
                self.line.close()
        wall = time.time() - started
        if self.replanner is not None:
            self.replanner.finish(self._events(current_plan=True))
        events = self._events()
        self._price_stragglers(events)
        return TrainResult(parameters=self._final_parameters(), losses=[self.losses[i] for i in sorted(self.losses)],
                           events=events, restarts=self.restarts, degrees=degrees_seen, wall_s=wall,
                           samples=self.samples, dollars=self.dollars, peak_bytes=self.peaks,
                           switches=self.replanner.switches if self.replanner is not None else [],
                           decisions=self.replanner.decisions if isinstance(self.replanner, ElasticScaler) else [])

    def _replan(self, replanner: Replanner | ElasticScaler, last: int) -> None:
        """At the epoch boundary after ``last``, every function of the epoch ended: the
        replanner may move the run onto a new plan (new stages under a new run prefix, the
        checkpoints moved onto them); the next epoch then launches the new plan's functions."""
        events = self._events(current_plan=True)
        spec = replanner.after_epoch(self.deployment, self.spec, events, last)
        if spec is None:
            return
        self.earlier_events.extend(events)
        self.keys, self.spec = self.deployment.keys, spec
        # watches keyed by stage index describe the old plan's stages
        self.watching.clear()
        self.late_since.clear()
        self.relaunched.clear()

    def _price_stragglers(self, events: list[timeline.Event]) -> None:
        """What a straggler cost: its iteration's span beyond the median of the others."""
        spans = {summary.iteration: summary.seconds for summary in timeline.summarize(events, skip_first=0).iterations}
        for restart in self.restarts:
            if restart.reason != "straggler" or restart.iteration not in spans:
                continue
            others = sorted(span for iteration, span in spans.items() if iteration != restart.iteration)
            typical = others[len(others) // 2] if others else 0.0
            restart.cost_s = max(spans[restart.iteration] - typical, 0.0)

    # one segment: fixed degrees -------------------------------------------------------------
    def _segment(self, begin: int, end: int) -> None:
        spec_key = self.keys.spec(begin)
        self.store.put(spec_key, self.spec.dumps())
        self.segment_started = time.time()
        self.segment_begin = begin
        self._feed(begin, end)
        workers = self.deployment.workers
        for stage in self.spec.stages:
            for replica in range(stage.replicas):
                role = Role(spec_key, stage.index, replica, begin, end, digest=self.deployment.digest)
                workers[(stage.index, replica)] = _Worker(role, self.deployment.launch(role))
        price = self.deployment.dollars_per_second([s.replicas for s in self.spec.stages])
        deadline = time.time() + self.timeout_s
        last_tick = time.time()
        while workers:
            time.sleep(POLL_S)
            now = time.time()
            self.dollars += price * (now - last_tick)
            last_tick = now
            if now > deadline:
                raise RunFailure(f"the run did not finish within {self.timeout_s:.0f} s (iterations "
                                 f"{begin}..{end - 1}); worker logs are in {self.deployment.workdir}. Raise "
                                 "timeout_s for bigger models")
            for key, worker in list(workers.items()):
                code = worker.process.poll()
                if code is not None:
                    self._finished(key, worker, code, end)
            self._collect(end)
            self._feed(begin, end)
            if self.straggler_ratio is not None:
                self._watch_stragglers(end, self.straggler_ratio)

    def _finished(self, key: tuple[int, int], worker: _Worker, code: int, end: int) -> None:
        workers = self.deployment.workers
        status = read_status(self.store, self.keys, worker.role)
        if status.get("peak_bytes"):
            self.peaks[worker.role.worker] = max(self.peaks.get(worker.role.worker, 0), status["peak_bytes"])
        if code == 0:
            del workers[key]
            return
        if code == OUT_OF_MEMORY or status.get("status") == "oom":
            raise oom_error(worker.role, status, platform_tiers_mb(self.deployment.compiled))
        if code == REINVOKE:
            next_iteration = int(status["next_iteration"])
            self._relaunch(key, worker, next_iteration, "time limit")
            return
        if status.get("status") == "transient":
            # the function gave up on a store (or platform) fault that outlasted its retry budget
            self._relaunch(key, worker, self._resume_point(worker.role), "transient")
            return
        if status.get("status") == "refused":
            raise refused_error(worker.role, status)
        if status.get("status") == "input":
            raise input_error(worker.role, status)
        if status.get("status") == "error":
            raise RunFailure(f"function {worker.role.worker} (stage {worker.role.stage}, replica "
                             f"{worker.role.replica}) failed:\n{status['traceback']}")
        # no status: the process was lost (SIGKILL, a crash of the host): restart from the checkpoint
        self._relaunch(key, worker, self._resume_point(worker.role), "lost")

    def _relaunch(self, key: tuple[int, int], worker: _Worker, start: int, reason: str, behind_s: float = 0.0) -> None:
        role = worker.role
        restarts = sum(1 for r in self.restarts if r.worker == role.worker and r.reason != "time limit")
        if reason != "time limit" and restarts >= MAX_RESTARTS:
            failure = getattr(worker.process, "failure", "")
            raise RunFailure(f"function {role.worker} was lost {restarts + 1} times (last in iteration {start}); "
                             f"giving up. Its logs are in {self.deployment.workdir}"
                             + (f". The last invocation failed with {failure}" if failure else ""))
        new_role = dataclasses.replace(role, start_iteration=start, attempt=role.attempt + 1)
        self.restarts.append(Restart(role.worker, start, reason, new_role.attempt, behind_s=behind_s))
        self.deployment.workers[key] = _Worker(new_role, self.deployment.launch(new_role))

    def _resume_point(self, role: Role) -> int:
        """Where a lost function restarts: after the latest checkpoint of its stage in this
        segment (any replica's: they hold the same state) that it had itself reported past,
        else at the segment's start. The tensors its neighbours sent since are still in the
        store (``_release``), so it replays the iterations after the checkpoint, each replayed
        write the same bytes again, and reports every iteration it had not reported yet."""
        for checkpoint in sorted(checkpoints_taken(self.store, self.keys, role.stage), reverse=True):
            if not self.segment_begin <= checkpoint < role.end_iteration:
                continue
            if self.store.exists(self.keys.progress(checkpoint, role.stage, role.replica)):
                return checkpoint + 1
        return self.segment_begin

    # data, progress, garbage ----------------------------------------------------------------
    def _feed(self, begin: int, end: int) -> None:
        horizon = min(end, max(self.collected + 1, begin) + DATA_WINDOW)
        while self.uploaded < horizon:
            self._upload(self.uploaded)
            self.uploaded += 1

    def _upload(self, iteration: int) -> None:
        self.samples += self.deployment._upload_batch(iteration, self.batch_for(iteration), self.spec.micro_batches)

    def _collect(self, end: int) -> None:
        """Iterations every worker reported: record their losses and delete their tensors.
        Lists only the next iteration's reports, so a poll costs the same at iteration 10,000."""
        everyone = {(stage.index, r) for stage in self.spec.stages for r in range(stage.replicas)}
        while self.collected + 1 < end:
            iteration = self.collected + 1
            reported = {(int(key.split("/")[-2][1:]), int(key.split("/")[-1][1:]))
                        for key in self.store.list(self.keys.progresses_of(iteration))}
            if not reported >= everyone:
                return
            last = len(self.spec.stages) - 1
            loss = 0.0
            for replica in range(self.spec.stages[last].replicas):
                record = json.loads(self.store.get(self.keys.progress(iteration, last, replica)))
                loss += record["loss"] or 0.0
            self.losses[iteration] = loss
            self.collected = iteration
            if not math.isfinite(loss):
                self._non_finite_loss(iteration, loss)
            if self.line is not None and self.line.origin is not None:
                # a line spanning calls: the run's iterations and time since it began
                self.line.update(iteration + 1 - self.line.origin, loss)
            elif self.line is not None:
                # the call's own line counts the run's iterations: a resumed call goes on from where it stopped
                self.line.update(self.line.start_iteration + iteration + 1 - self.first, loss)
            self._release(end)

    def _non_finite_loss(self, iteration: int, loss: float) -> None:
        """An iteration whose loss is NaN or infinite: its gradients have made (or will make)
        the weights non-finite, and every later iteration trains on garbage."""
        if self.non_finite == "ignore" or (self.non_finite == "warn" and self.warned_non_finite):
            return
        message = (f"iteration {iteration - self.first} of this call (run iteration {iteration}) has loss {loss}: "
                   "the weights are no longer finite, so the iterations after it train nothing. Lower the learning "
                   "rate, check the data and targets, or clip the gradients; non_finite='error' stops a call at the "
                   "first such iteration (its last checkpoint stays), non_finite='ignore' trains on")
        if self.non_finite == "error":
            raise RunFailure(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        self.warned_non_finite = True

    def _release(self, end: int, *, now: bool = False) -> None:
        """Deletes the tensors of the iterations up to the last checkpoint every stage has
        taken (all workers reported it, and replica 0 of a stage writes its checkpoint before
        its report), and the checkpoints before it: a lost function never restarts earlier.
        The deletion runs on the garbage thread, one at a time and at most once every
        ``RELEASE_EVERY_S`` unless ``now``; a store error it met is raised here, at the next
        call."""
        if self.deleting is not None and not self.deleting.done():
            return
        self._finish_deletion()
        if not now and time.monotonic() < self.next_release_at:
            return
        covered = [i for i in range(self.released + 1, self.collected + 1) if self.spec.checkpoints_after(i, end)]
        if not covered:
            return
        checkpoint = covered[-1]
        self.deleting = self.garbage.submit(self._delete_through, checkpoint, self.keys,
                                            [stage.index for stage in self.spec.stages])
        self.released = checkpoint
        self.next_release_at = time.monotonic() + RELEASE_EVERY_S

    def _release_now(self, end: int) -> None:
        """Every deletion the iterations collected so far allow, done before returning (a
        segment's end: the next segment or a re-plan starts from a clean store)."""
        self._finish_deletion()
        self._release(end, now=True)       # what the finished one left: it covers every iteration collected
        self._finish_deletion()

    def _finish_deletion(self) -> None:
        """Waits for the deletion in flight, if any; a store error it met is raised here."""
        if self.deleting is not None:
            deleting, self.deleting = self.deleting, None
            deleting.result()

    def _delete_through(self, checkpoint: int, keys: RunKeys, stages: list[int]) -> None:
        """Deletes every per-iteration key of iterations up to ``checkpoint`` and the stages'
        checkpoints before it: one list per kind of key and per stage's checkpoints, however
        many iterations that covers (a list per kind and iteration took most of the
        invoker's CPU), then batched deletes. A key a replayed iteration wrote again after
        an earlier deletion goes too."""
        doomed = []
        for prefix in keys.intermediate_prefixes():
            for key in self.store.list(prefix):
                iteration = keys.iteration_of(key)
                if iteration is not None and iteration <= checkpoint:
                    doomed.append(key)
        for stage in stages:
            doomed += [key for taken, key in checkpoints_taken(self.store, keys, stage).items() if taken < checkpoint]
        self.store.delete_keys(doomed)

    def _watch_stragglers(self, end: int, ratio: float) -> None:
        """Dorylus's rule, per phase: once some replicas of a stage have finished an
        iteration's forwards (or forwards and backwards), a peer still at it ``ratio`` ×
        their time later is relaunched from the last checkpoint. A replica that waits on a
        late one is excused: in the forward phase on the replicas that feed its
        micro-batches, in the backward phase on those that send its gradients."""
        iteration = self.collected + 1
        if iteration >= end:
            return
        done: dict[str, dict[int, set[int]]] = {"forwarded": {}, "computed": {}}
        for key in self.store.list(self.keys.markers(iteration)):
            parts = key.split("/")
            done[parts[-1]].setdefault(int(parts[-3][1:]), set()).add(int(parts[-2][1:]))
        for phase in ("forwarded", "computed"):
            for stage in self.spec.stages:
                finished = done[phase].get(stage.index, set())
                if stage.replicas < 2 or not finished or len(finished) == stage.replicas:
                    continue
                watch = (iteration, stage.index, phase)
                if watch not in self.watching:
                    self.watching[watch] = self._pace(iteration, stage.index, finished)
                pace = self.watching[watch]
                for replica in range(stage.replicas):
                    clock = (iteration, stage.index, replica, phase)
                    if (replica in finished or (iteration, stage.index, replica) in self.relaunched
                            or self._waits_on_late_peer(stage, replica, phase, done)):
                        self.late_since.pop(clock, None)
                        continue
                    # the clock runs from when nothing it waits for is late any more
                    behind = time.time() - self.late_since.setdefault(clock, time.time())
                    if behind > ratio * pace:
                        self.relaunched.add((iteration, stage.index, replica))
                        self._relaunch_straggler(stage.index, replica, iteration, behind)

    def _waits_on_late_peer(self, stage: StageSpec, replica: int, phase: str, done: dict) -> bool:
        owned = stage.owned(self.spec.micro_batches, replica)
        if phase == "forwarded":
            neighbours = sorted({p for p in stage.sources.values() if p >= 0})
        else:
            if replica not in done["forwarded"].get(stage.index, set()):
                return True    # still in its forwards: the forward phase judges it
            neighbours = list(stage.consumers)
        for other in neighbours:
            degree = self.spec.stages[other].replicas
            if any(m % degree not in done[phase].get(other, set()) for m in owned):
                return True
        return False

    def _relaunch_straggler(self, stage: int, replica: int, iteration: int, behind: float) -> None:
        key = (stage, replica)
        worker = self.deployment.workers.get(key)
        if worker is None or worker.role.start_iteration > iteration:
            return
        worker.process.kill()
        worker.process.wait()
        self._relaunch(key, worker, self._resume_point(worker.role), "straggler", behind_s=behind)

    def _pace(self, iteration: int, stage: int, finished: set[int]) -> float:
        """Seconds the finished peers took for this iteration's micro-batches: from their
        previous report (or the segment's start) to now, when their finish was first seen."""
        starts = []
        for replica in finished:
            try:
                record = json.loads(self.store.get(self.keys.progress(iteration - 1, stage, replica)))
                starts.append(record["end"])
            except Exception:  # noqa: BLE001 - the first iteration has no previous report
                starts.append(self.segment_started)
        return max(time.time() - max(starts), 0.05)

    # results --------------------------------------------------------------------------------
    def _final_parameters(self) -> dict[str, torch.Tensor]:
        return checkpoint_parameters(self.store, self.keys, len(self.spec.stages), self.end - 1)

    def _events(self, current_plan: bool = False) -> list[timeline.Event]:
        """The run's timeline; ``current_plan``: only the iterations the current plan ran."""
        events = [] if current_plan else list(self.earlier_events)
        for key in self.store.list(self.keys.timelines()):
            events.extend(timeline.loads(self.store.get(key)))
        return sorted(events, key=lambda event: event.start)
