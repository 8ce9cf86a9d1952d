"""The function process: ``python -m flatpack.runtime.worker``.

A function receives only its role (``FLATPACK_ROLE``, JSON, which carries the artifact's
digest) and the store's address (``FLATPACK_STORE``, credentials from the standard
environment); everything else — the run's settings, its stage artifact, checkpoints, data,
the other stages' tensors — it reads from the store, and it runs no stage code before the
artifact's index matches the digest and the stage's files match the index. Like a
serverless function it is held to its tier:

* memory: the process's peak resident memory (``VmHWM``, what Lambda reports as "Max
  Memory Used") is checked after every task; past the tier the function fails as an
  out-of-memory function does, with a status record saying by how much;
* CPU: a tier with less than one vCPU per thread gets that share of the time (compute
  tasks are stretched to CPU time / share, as a CPU quota would);
* bandwidth: the store client's token buckets run at the tier's rate each way;
* time: near ``time_limit_s`` it checkpoints and asks to be invoked again (LambdaML's
  answer to Lambda's 15-minute limit).

A function ends with its invoker, also one started from a thread that is not the invoker's
main thread (``runtime.invoker_watch``, started before anything heavy loads).

Exit codes: 0 done, ``REINVOKE`` (75) checkpointed and wants to continue, ``OUT_OF_MEMORY``
(86) over its tier, 1 any other failure (the status record has the traceback).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING

from flatpack.runtime.invoker_watch import watch_invoker

if __name__ == "__main__":
    # first, before torch loads (seconds on a busy host): this function ends with its invoker,
    # whichever thread of the invoker started it (runtime/invoker_watch.py)
    watch_invoker()

import torch

from flatpack.errors import ArtifactError, InputError
from flatpack.runtime.function import OutOfMemory, Role, cpu_throttle, load_module, peak_rss_bytes, tier_link
from flatpack.runtime.function_env import ROLE_ENV, STORE_ENV
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store import Store, StoreUnavailable, is_transient_failure, open_plain_store
from flatpack.schedules import register_plugins
from flatpack.units import MIB

if TYPE_CHECKING:
    from flatpack.runtime.spec import RunSpec

REINVOKE = 75
OUT_OF_MEMORY = 86


def matching_faults(spec: RunSpec, role: Role, iteration: int, at: str, micro_batch: int | None) -> list[dict]:
    return [fault for fault in spec.faults
            if fault.get("stage") == role.stage and fault.get("replica", 0) == role.replica
            and fault.get("iteration") == iteration and fault.get("attempt", 0) == role.attempt
            and fault.get("at", "forward") == at
            and fault.get("micro_batch", micro_batch) == micro_batch]


_ballast: list[torch.Tensor] = []


def apply_fault(fault: dict) -> None:
    """Injected failures for tests and chaos runs: ``kill`` (SIGKILL, as a lost function),
    ``sleep`` (a straggler), ``allocate`` (a stage that needs more memory), ``raise``."""
    action = fault["action"]
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "sleep":
        time.sleep(float(fault["seconds"]))
    elif action == "allocate":
        _ballast.append(torch.ones(int(fault["bytes"]) // 4))
    elif action == "raise":
        raise RuntimeError(f"injected failure: {fault}")
    else:
        raise ValueError(f"unknown fault action {action!r}")


def write_status(store: Store, keys: RunKeys, role: Role, status: dict) -> None:
    try:
        store.put(keys.status(role.stage, role.replica, role.attempt, role.start_iteration),
                  json.dumps({**status, "role": json.loads(role.dumps())}).encode())
    except Exception:  # noqa: BLE001 - the exit code still tells the invoker
        pass


def train(store: Store, spec: RunSpec, role: Role, started: float) -> int:
    # start-up time: a function loads what its role runs (train: the trainer, its lanes and timeline)
    from flatpack.runtime import timeline
    from flatpack.runtime.lanes import Lanes
    from flatpack.runtime.training import StageTrainer

    keys = RunKeys(spec.run)
    stage = spec.stages[role.stage]
    limit = stage.memory_mb * MIB if stage.memory_mb else None
    recorder = timeline.Recorder(role.stage, role.replica, role.attempt)
    throttled = tier_link(store, stage.bandwidth_bytes_s)

    def after_task(kind: str, iteration: int, micro_batch: int | None) -> None:
        for fault in matching_faults(spec, role, iteration, kind, micro_batch):
            apply_fault(fault)
        if limit is not None:
            peak = peak_rss_bytes()
            if peak > limit:
                where = f"{kind} of micro-batch {micro_batch}" if micro_batch is not None else kind
                raise OutOfMemory(peak, limit, f"{where}, iteration {iteration}")

    def report(iteration: int, checkpoint: bytes | None, progress: dict) -> None:
        """Checkpoint (before the progress record: a restart resumes after the last
        reported iteration and needs its checkpoint), progress, then the timeline."""
        if checkpoint is not None:
            with recorder.task("checkpoint", iteration, lane="upload"):
                store.put(keys.checkpoint(role.stage, iteration), checkpoint)
        store.put(keys.progress(iteration, role.stage, role.replica), json.dumps(progress).encode())
        store.put(keys.timeline(role.stage, role.replica, iteration, role.attempt),
                  timeline.dumps(recorder.drain(iteration)))

    with recorder.task("load", role.start_iteration):
        module = load_module(store, keys, role.stage, role.digest)
        trainer = StageTrainer(spec, role, throttled, module, recorder, after_task=after_task,
                               throttle_compute=cpu_throttle(stage.vcpus, spec.threads))
        checkpoint = spec.checkpoint_before(role.start_iteration)
        if checkpoint is not None:
            trainer.load_state(store.wait(keys.checkpoint(role.stage, checkpoint), spec.wait_timeout_s))
    after_task("load", role.start_iteration, None)
    # torch, boto3 and the stage are loaded: move those objects out of the collector's sight,
    # or its full collections (tens of ms) land inside compute tasks at random
    gc.collect()
    gc.freeze()
    # OpenMP's thread count is per thread: the compute lane sets its own, or runs with the default
    with Lanes(on_compute_thread=lambda: torch.set_num_threads(spec.threads)) as lanes:
        for iteration in range(role.start_iteration, role.end_iteration):
            began = time.time()
            after_task("start", iteration, None)
            trainer.run_iteration(iteration, lanes)
            last = iteration == role.end_iteration - 1
            reinvoke = (not last and spec.time_limit_s is not None
                        and time.time() - started + 1.5 * (time.time() - began) + 1.0 > spec.time_limit_s)
            checkpoint = None
            if reinvoke or (role.replica == 0 and spec.checkpoints_after(iteration, role.end_iteration)):
                checkpoint = trainer.state_bytes(iteration)   # a snapshot: the next iteration changes the weights
            # the reports go out on their own lane, in order, while the next iteration starts
            lanes.submit("report", report, iteration, checkpoint, trainer.progress(iteration))
            if reinvoke:
                lanes.close()
                write_status(store, keys, role, {"status": "reinvoke", "next_iteration": iteration + 1,
                                                 "peak_bytes": peak_rss_bytes()})
                return REINVOKE
    write_status(store, keys, role, {"status": "ok", "peak_bytes": peak_rss_bytes()})
    return 0


def infer(store: Store, raw_spec: bytes, role: Role) -> int:
    from flatpack.runtime import forkjoin   # start-up time: only an inference role serves fork-join

    spec = forkjoin.ForkJoinSpec.loads(raw_spec)
    torch.set_num_threads(spec.threads)
    limit = spec.memory_mb * MIB if spec.memory_mb else None

    def after_task(kind: str, request: int, part: int | None) -> None:
        if limit is not None and peak_rss_bytes() > limit:
            raise OutOfMemory(peak_rss_bytes(), limit, f"{kind} of request {request}")

    link = tier_link(store, spec.bandwidth_bytes_s)
    return forkjoin.serve(store, raw_spec, role, after_task=after_task, throttled=link,
                          throttle_compute=cpu_throttle(spec.vcpus, spec.threads))


def run_role(role: Role, store: Store, started: float) -> int:
    """Runs one function invocation to its end and returns its exit code; every failure is
    reported in the role's status record (the invoker reads it), never raised: ``refused``
    when its stage artifact failed verification (nothing of it ran), ``oom``, or
    ``transient`` when the cause was transient (a store unreachable or throttled for its
    whole retry budget; the invoker relaunches the function), else ``error`` with the traceback."""
    keys = RunKeys(role.spec_key.split("/", 1)[0])
    try:
        raw = store.wait(role.spec_key, 120)
        if role.kind == "profile":
            # start-up time: only the profile role loads the layer timing (flatpack.measure)
            from flatpack.runtime.profile_function import run_profile
            return run_profile(store, role, raw)
        if role.kind == "calibrate":
            from flatpack.runtime.calibrate_function import run_calibrate   # start-up time: calibrate role only
            return run_calibrate(store, role, raw, started)
        if role.kind == "train":
            # start-up time: only the train role reads a RunSpec (its optimizer and precision modules, loaded
            # with it, stay out of the other roles)
            from flatpack.runtime.spec import RunSpec

            spec = RunSpec.loads(raw)
            if spec.store_faults:   # a chaos run: this worker's store requests fail and stall at the spec's rates
                from flatpack.runtime.chaos import for_role   # start-up time: chaos runs only
                store = for_role(store, spec.store_faults, role)
            torch.set_num_threads(spec.threads)
            return train(store, spec, role, started)
        return infer(store, raw, role)
    except ArtifactError as err:
        # a stage that fails verification is never retried: its bytes will not change by themselves
        write_status(store, keys, role, {"status": "refused", "error": str(err)})
        return 1
    except InputError as err:
        # a value the stage was not compiled for (flatpack/stage/tensor_check.py): the message names it
        write_status(store, keys, role, {"status": "input", "error": str(err)})
        return 1
    except OutOfMemory as err:
        write_status(store, keys, role, {"status": "oom", "peak_bytes": err.peak_bytes, "limit_bytes": err.limit_bytes,
                                         "task": err.task})
        return OUT_OF_MEMORY
    except BaseException as err:  # noqa: BLE001 - a function reports every failure to its invoker
        if isinstance(err, Exception) and is_transient_failure(err):
            link: BaseException | None = err
            while link is not None and not isinstance(link, StoreUnavailable):
                link = link.__cause__
            spent = link if isinstance(link, StoreUnavailable) else None
            write_status(store, keys, role, {
                "status": "transient", "error": f"{type(err).__name__}: {err}",
                "attempts": spent.attempts if spent else None,
                "retried_s": round(spent.elapsed_s, 3) if spent else None,
                "budget_s": spent.budget_s if spent else None,
                "traceback": traceback.format_exc()})
            return 1
        write_status(store, keys, role, {"status": "error", "traceback": traceback.format_exc()})
        return 1


def main() -> None:
    started = time.time()
    role = Role.loads(os.environ[ROLE_ENV])
    register_plugins()      # schedules the deployment defines outside flatpack (flatpack.schedules)
    code = run_role(role, open_plain_store(os.environ[STORE_ENV]), started)
    sys.stdout.flush()
    sys.stderr.flush()
    # lanes may still wait on keys a failed peer never writes; a function just ends
    os._exit(code)


if __name__ == "__main__":
    main()
