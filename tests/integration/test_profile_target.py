"""In-target profiling on the local backend with emulated tiers: one profiler function per
memory tier (a separate process sharing only the real local S3 server with the driver)
measures every layer, and the calibration file it yields is what plans for the target use.

The model has one layer too big for a 300 MB tier (its weights and gradients, with the
256 MB runtime, pass it) and small layers around it. No test asserts a wall-clock time:
the one ordering checked (a 0.29-vCPU tier is slower than a 1-vCPU one on the big layer)
has a margin far inside the 3.5x the emulated shares imply."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

import flatpack
from flatpack.backends import local
from flatpack.backends.profiling import profile_in_target
from flatpack.errors import InputError, RunFailure
from flatpack.partitioner.objective import evaluate
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.workload import Workload
from flatpack.platform.calibration import Calibration
from flatpack.profiler import ProfileOptions
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.profile_function import run_profile
from flatpack.runtime.store import FileStore
from flatpack.runtime.worker import write_status
from tests.helpers import layer_graph

pytestmark = pytest.mark.slow

WIDE = 2560            # 2560² float32 weights = 25 MB, and as much again in gradients
TIERS = (300, 512, 2048)
MICRO_BATCH = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, WIDE)
        self.big = nn.Linear(WIDE, WIDE)
        self.out = nn.Linear(WIDE, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.big(torch.relu(self.inp(x)))))


def make_model() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return Net(), (torch.randn(MICRO_BATCH, 32),)


class Recorder:
    """Deploys with the local backend onto the session's S3 server, remembering the run so
    that the test can look under its prefix afterwards."""

    def __init__(self, s3_server, workdir) -> None:
        self.deploy_local = partial(local.deploy, store_url=s3_server.url(""), env=s3_server.env(), workdir=workdir)
        self.runs: list[str] = []

    def __call__(self, compiled):
        deployment = self.deploy_local(compiled)
        self.runs.append(deployment.keys.run)
        return deployment


@pytest.fixture(scope="module")
def profiled(s3_server, tmp_path_factory):
    """One profile of the three tiers, shared by the tests below."""
    directory = tmp_path_factory.mktemp("profile")
    recorder = Recorder(s3_server, directory / "functions")
    model, inputs = make_model()
    calibration = profile_in_target(model, inputs, target="local", tiers=TIERS, batch_sizes=(1, 2, MICRO_BATCH),
                                    repeats=3, deploy=recorder, timeout_s=180, out=directory / "calibration.json")
    return calibration, directory / "calibration.json", recorder.runs


def test_the_calibration_file_loads_and_has_a_line_per_layer_per_tier(profiled):
    calibration, path, _ = profiled
    loaded = Calibration.load(path)
    assert loaded == calibration
    model, inputs = make_model()
    chain = layer_graph(flatpack.compile(model, inputs, target="local", stages=1))
    assert loaded.layer_names == tuple(layer.name for layer in chain.layers)
    assert loaded.platform == "local"
    assert loaded.tiers_mb == (512, 2048)
    for tier in loaded.tiers.values():
        assert len(tier.forward_s) == len(tier.backward_s) == len(chain.layers)
        assert all(line.at(MICRO_BATCH) > 0 for line in (*tier.forward_s, *tier.backward_s))
    assert loaded.provenance["cpu_share"] == "emulated"
    assert "emulated on the local backend" in loaded.provenance["where"]
    assert "timed alone" in loaded.provenance["method"]


def test_a_tier_too_small_for_a_layer_is_left_out_and_says_which_layer(profiled):
    calibration, _, _ = profiled
    assert 300 not in calibration.tiers
    big = calibration.layer_names[1]
    reason = calibration.provenance["tier 300 MB"]
    assert "does-not-fit" in reason and big in reason and "runtime 256.0 MB" in reason, reason


def test_a_smaller_cpu_share_measures_slower_on_the_compute_heavy_layer(profiled):
    calibration, _, _ = profiled
    small = sum(calibration.seconds(1, 512, MICRO_BATCH))      # 512/1769 = 0.29 vCPU
    large = sum(calibration.seconds(1, 2048, MICRO_BATCH))     # a whole vCPU for the one thread
    assert small > 1.2 * large, (small, large)


def test_compile_with_the_calibration_predicts_from_the_measured_lines(profiled, tmp_path):
    calibration, path, _ = profiled
    model, inputs = make_model()
    layers = len(calibration.layer_names)
    plan = Plan((StagePlan(0, layers - 1, memory_mb=512),), layers)
    compiled = flatpack.compile(model, inputs, target="local", plan=plan, calibration=path,
                                workload=Workload(batch=4 * MICRO_BATCH, micro_batches=4),
                                profile=ProfileOptions(batch_sizes=(1, 2), repeats=1, cache_dir=str(tmp_path)))
    problem = compiled.problem
    assert problem is not None  # compiled here, with a workload
    tier = problem.platform.tier(512)
    for index in range(layers):
        assert problem.layer_seconds(index, tier, MICRO_BATCH) == calibration.seconds(index, 512, MICRO_BATCH)
    stage = evaluate(problem, plan).detail.stages[0]
    measured_forward = sum(calibration.seconds(index, 512, MICRO_BATCH)[0] for index in range(layers))
    assert stage.forward_s == pytest.approx(problem.platform.overlap_slowdown * measured_forward)


def test_nothing_is_left_in_the_store(profiled, s3_server):
    _, _, runs = profiled
    assert len(runs) == 1
    with s3_server.store() as store:
        assert store.list(f"{runs[0]}/") == []


def test_when_no_tier_can_hold_the_model_the_error_names_tier_and_layer_and_cleans_up(s3_server, tmp_path):
    recorder = Recorder(s3_server, tmp_path / "functions")
    model, inputs = make_model()
    with pytest.raises(InputError) as error:
        profile_in_target(model, inputs, target="local", tiers=(128,), batch_sizes=(1,), repeats=1, deploy=recorder,
                          timeout_s=120, out=tmp_path / "calibration.json")
    message = str(error.value)
    assert "128 MB" in message and "before any activation" in message
    assert not (tmp_path / "calibration.json").exists()
    with s3_server.store() as store:
        assert store.list(f"{recorder.runs[0]}/") == []


class Activations(nn.Module):
    """A small layer whose activations grow 40 MB per sample: they fit a 512 MB tier (256 MB
    of it the runtime) at one sample and, extrapolated, not at eight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).repeat(1, 40 * 2**20 // 64).sum(dim=1)


class Ended:
    """A function that has ended, as the profiler sees one (``functions.Invocation``);
    ``failure``: what the platform said of the invocation, as ``ThreadInvocation`` keeps it."""

    def __init__(self, code: int, failure: str = "") -> None:
        self.code = code
        self.failure = failure

    def poll(self) -> int:
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        return self.code

    def kill(self) -> None:
        pass


class InProcess:
    """A deployment the profiler sees only through what it uses (store, keys, launch,
    teardown): a directory store, and each function run in this process."""

    def __init__(self, compiled, root) -> None:
        self.store = FileStore(root)
        self.keys = RunKeys("run-in-process")
        for key, data in local.package(compiled).items():
            self.store.put(f"{self.keys.run}/{key}", data)

    def launch(self, role):
        return Ended(run_profile(self.store, role, self.store.get(role.spec_key)))

    def teardown(self) -> None:
        self.store.delete_prefix(self.keys.prefix)


class OutOfMemoryOnThePlatform(InProcess):
    """Every function dies as Lambda kills one over its memory: a status record with a long
    traceback (as the worker writes it), no result, and the platform's own reason."""

    TRACEBACK = "Traceback (most recent call last):\n" + "".join(
        f'  File "frame{index}.py", line {index}, in f{index}\n    step({index})\n' for index in range(30)
    ) + "MemoryError: the last line"

    def launch(self, role):
        write_status(self.store, self.keys, role, {"status": "error", "traceback": self.TRACEBACK})
        return Ended(-9, "RuntimeError: flatpack-p00512 answered Unhandled: "
                         '{"errorType": "Runtime.OutOfMemory", "errorMessage": "signal: killed"}')


def test_sizes_whose_activations_pass_the_tier_are_left_out_of_the_fit(tmp_path):
    torch.manual_seed(0)
    deployments = []

    def deploy(compiled):
        deployments.append(InProcess(compiled, tmp_path / "store"))
        return deployments[-1]

    calibration = profile_in_target(Activations(), (torch.randn(2, 16),), target="local", tiers=(512,),
                                    batch_sizes=(1, 8), repeats=1, warmup=0, deploy=deploy,
                                    bandwidth_probe_bytes=1 << 20)
    assert calibration.tiers_mb == (512,)
    assert calibration.provenance["cpu_share"] == "platform"     # this deployment does not emulate tiers
    bandwidth_bytes_s = calibration.tiers[512].bandwidth_bytes_s
    assert bandwidth_bytes_s is not None and bandwidth_bytes_s > 0
    note = calibration.provenance["tier 512 MB"]
    assert "fitted over the smaller sizes only" in note and "from micro-batch 8" in note, note
    assert "micro-batch 8 and larger not run: predicted need" in note, note   # the layer's own note
    assert deployments[0].store.list(f"{deployments[0].keys.run}/") == []


def test_a_failed_function_says_the_platforms_reason_its_traceback_and_what_to_do(tmp_path):
    torch.manual_seed(0)
    with pytest.raises(RunFailure) as error:
        profile_in_target(Activations(), (torch.randn(2, 16),), target="local", tiers=(512,), batch_sizes=(1,),
                          repeats=1,
                          # a stand-in with only what the profiler uses of a FunctionDeployment
                          deploy=lambda compiled: OutOfMemoryOnThePlatform(  # pyright: ignore[reportArgumentType]
                              compiled, tmp_path / "store"))
    message = str(error.value)
    assert "exit code -9" in message and "Runtime.OutOfMemory" in message, message
    assert "MemoryError: the last line" in message and "frame29.py" in message and "frame0.py" not in message
    assert message.rstrip().endswith("re-run with --emulate (emulate=True): the same profiler functions then run "
                                     "as local processes, their full output kept."), message


def test_an_emulated_tiers_failed_function_keeps_its_log_folder_and_names_it():
    def fail(role):   # stands in for a function that dies before writing anything
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

    with pytest.raises(RunFailure) as error:
        profile_in_target(Activations(), (torch.randn(2, 16),), target="local", tiers=(512,), batch_sizes=(1,),
                          repeats=1, launch=fail, timeout_s=60)
    message = str(error.value)
    assert "exit code 3" in message, message
    folder = re.search(r"The profiler functions' logs are in (\S+): ", message)
    assert folder is not None, message
    try:
        assert Path(folder[1]).is_dir() and Path(folder[1]).name.startswith("flatpack-profile-")
    finally:
        shutil.rmtree(folder[1], ignore_errors=True)


@pytest.mark.parametrize("options, words", [
    ({"batch_sizes": (1, "2")}, "batch sizes must be positive integers"),
    ({"batch_sizes": ()}, "batch sizes must be positive integers"),
    ({"repeats": 0}, "repeats >= 1"),
    ({"bandwidth_probe_bytes": 1 << 20}, "localhost's bandwidth"),
])
def test_bad_settings_are_refused_before_anything_is_deployed(options, words):
    # the local target emulates its tiers: a bandwidth probe there would time localhost
    with pytest.raises(InputError, match=words):
        profile_in_target(Activations(), (torch.randn(2, 16),), target="local", tiers=(512,), **options)
