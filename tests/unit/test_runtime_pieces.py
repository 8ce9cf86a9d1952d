"""The runtime's pure parts: schedules, chunking, routing, lanes, keys, specs, and the two
scatter-reduce schedules over a real (filesystem) store with threads as replicas."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from flatpack.runtime.collectives import chunk_bounds, scatter_reduce
from flatpack.runtime.function import Role
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.lanes import Lanes
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.spec import DATA_SOURCE, RunSpec, StageSpec, routing
from flatpack.stage.manifest import Manifest, ValueEntry
from flatpack.runtime.store import FileStore
from flatpack.runtime.timeline import Recorder
from flatpack.stage.wire import pack_values, unpack_values


@pytest.mark.parametrize(("numel", "parts"), [(10, 3), (3, 3), (2, 3), (100, 7), (0, 2)])
def test_chunk_bounds_tile_the_vector(numel, parts):
    bounds = chunk_bounds(numel, parts)
    assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


def _manifest(index: int, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Manifest:
    """A stage manifest that says only what crosses its boundaries (routing reads no more)."""
    def values(names: tuple[str, ...]) -> tuple[ValueEntry, ...]:
        return tuple(ValueEntry(name, "tensor", 4, (1,), "float32") for name in names)

    return Manifest(index, 3, (index, index), (f"l{index}",), "fx", False, True, (), values(inputs), values(outputs),
                    (), "test")


def test_routing_finds_the_nearest_producer_and_the_consumers():
    manifests = [
        _manifest(0, ("x",), ("a", "mask")),
        _manifest(1, ("a", "mask"), ("b", "mask")),
        _manifest(2, ("b", "mask", "x"), ("y",)),
    ]
    sources, consumers = routing(manifests, ["x"])
    assert sources == [{"x": DATA_SOURCE}, {"a": 0, "mask": 0}, {"b": 1, "mask": 1, "x": DATA_SOURCE}]
    assert consumers == [(1,), (2,), ()]


def test_routing_refuses_an_input_nobody_produces():
    with pytest.raises(Exception, match="no earlier stage outputs"):
        routing([_manifest(0, ("ghost",), ())], ["x"])


def _spec(replicas: int = 2, micro_batches: int = 4) -> RunSpec:
    stage = StageSpec(0, replicas, 1024, 0.5, 1e6, ("x",), ("y",), {"x": DATA_SOURCE}, ())
    return RunSpec("run", (stage,), micro_batches, 8, OptimizerSpec("adam", lr=0.1), "mse", "y",
                   shared={"w": (0, 2)}, faults=({"stage": 0, "action": "kill"},))


def test_run_spec_and_role_round_trip_through_json():
    spec = _spec()
    assert RunSpec.loads(spec.dumps()) == spec
    role = Role("run/spec/g000000", 1, 2, 3, 9, attempt=4)
    assert Role.loads(role.dumps()) == role and role.worker == "s1r2"


def test_spec_refuses_more_replicas_than_micro_batches():
    with pytest.raises(Exception, match="some replicas would idle"):
        _spec(replicas=5, micro_batches=4)


def test_micro_batches_go_round_robin_over_replicas():
    stage = _spec(replicas=3, micro_batches=7).stages[0]
    assert [stage.owned(7, r) for r in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]


def test_keys_order_by_number_and_stay_under_the_run_prefix():
    keys = RunKeys("r1")
    assert keys.activation(2, 1, 10) > keys.activation(2, 1, 9)
    every = [keys.data(0, 0), keys.activation(0, 0, 0), keys.checkpoint(0, 0), keys.timeline(0, 0, 0, 0),
             keys.progress(0, 0, 0), keys.spec(0), keys.sync_chunk(0, 0, 0, 0)]
    assert all(key.startswith(keys.prefix) for key in every)
    with pytest.raises(ValueError):
        RunKeys("a/b")


def test_lanes_run_concurrently_and_respect_dependencies():
    events: list[str] = []
    gate = threading.Event()
    with Lanes() as lanes:
        slow = lanes.submit("download", lambda: (gate.wait(5), events.append("download"))[1])
        fast = lanes.submit("upload", lambda: events.append("upload"))
        fast.result(timeout=5)
        assert events == ["upload"], "the upload lane did not wait for the download lane"
        after = lanes.submit("compute", lambda: events.append("compute"), after=[slow])
        time.sleep(0.05)
        assert "compute" not in events
        gate.set()
        after.result(timeout=5)
    assert events == ["upload", "download", "compute"]


def test_a_failed_dependency_fails_its_dependents():
    with Lanes() as lanes:
        broken = lanes.submit("download", lambda: 1 / 0)
        dependent = lanes.submit("compute", lambda: "ran", after=[broken])
        with pytest.raises(ZeroDivisionError):
            dependent.result(timeout=5)


def test_values_pack_tensors_and_plain_values_without_pickle():
    values = {"h": torch.randn(3, 4), "mask": torch.ones(3, dtype=torch.bool), "size": 7}
    back = unpack_values(pack_values(values))
    torch.testing.assert_close(back["h"], values["h"])
    assert back["size"] == 7 and back["mask"].dtype == torch.bool


@pytest.mark.parametrize("method", ["pipelined", "lambdaml"])
@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
def test_scatter_reduce_sums_over_replicas_identically_everywhere(tmp_path, method, replicas):
    store = FileStore(tmp_path)
    keys = RunKeys("run")
    grads = [torch.randn(23, generator=torch.Generator().manual_seed(r)) for r in range(replicas)]
    results: dict[int, torch.Tensor] = {}
    recorders = [Recorder(0, r) for r in range(replicas)]

    def replica(r: int) -> None:
        def record(lane: str, kind: str, nbytes: int):
            return recorders[r].task(kind, 0, nbytes=nbytes, lane=lane)
        results[r] = scatter_reduce(grads[r], store=store, keys=keys, iteration=0, stage=0, replica=r,
                                    replicas=replicas, method=method, timeout_s=10, record=record)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    expected = torch.stack(grads).sum(0)
    assert sorted(results) == list(range(replicas))
    for r in range(replicas):
        torch.testing.assert_close(results[r], expected)
        assert torch.equal(results[r], results[0]), "replicas must apply bit-identical gradients"
    if replicas > 1:
        uploads = [e for e in recorders[0].drain() if e.lane == "upload"]
        assert len(uploads) == replicas   # d − 1 chunks, then the reduced one


def test_every_backend_exports_the_backend_functions():
    from flatpack.backends import BACKEND_FUNCTIONS, BACKENDS, get_backend

    for name in BACKENDS.names():
        module = get_backend(name)
        assert name == module.NAME
        for function in BACKEND_FUNCTIONS:
            assert callable(getattr(module, function)), f"backend {name} lacks {function}"


def test_an_unknown_backend_lists_the_known_ones():
    from flatpack.backends import get_backend
    from flatpack.errors import InputError

    with pytest.raises(InputError, match="known backends: alibaba-fc, aws-lambda, gpu-container, local"):
        get_backend("aws-lambada")


def test_optimizer_spec_refuses_unknown_names_and_bad_rates():
    from flatpack.errors import InputError

    with pytest.raises(InputError, match="'lamb' is not known.*the optimizers are: adadelta.*adamw.*sgd"):
        OptimizerSpec("lamb")
    with pytest.raises(InputError, match="positive"):
        OptimizerSpec("sgd", lr=0)
    assert OptimizerSpec.of({"name": "adam", "lr": 0.5}) == OptimizerSpec("adam", lr=0.5)


def test_doubling_policy_grows_chosen_stages_up_to_the_cap():
    from flatpack.runtime.elastic import doubling

    policy = doubling(4, every=2, stages=[1])
    assert policy(1, (1, 1)) is None
    assert policy(2, (1, 1)) == (1, 2)
    assert policy(4, (1, 4)) is None


def _tiny_compiled():
    import flatpack
    from flatpack.partitioner.plan import Plan, StagePlan

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    base = flatpack.compile(model, (torch.randn(4, 4),), stages=2)
    return flatpack.compile(model, (torch.randn(4, 4),), plan=Plan(
        tuple(StagePlan(s.start, s.end, None, 2) for s in base.plan.stages), base.plan.num_layers, micro_batches=2))


@pytest.mark.parametrize(("options", "message"), [
    ({"iterations": 5}, "asked for 5 iterations but given 2 batches"),
    ({"loss": "hinge"}, "loss 'hinge' is not one of"),
    ({"schedule": "gpipe"}, "unknown schedule 'gpipe'; known schedules: 1f1b, 1f1b-async, 2bw, sync"),
    ({"micro_batches": 1}, "2 replicas but an iteration has only 1 micro-batch;"),
    ({"optimizer": "lamb"}, "optimizer 'lamb' is not known"),
])
def test_train_refuses_bad_requests_before_starting_functions(tmp_path, options, message):
    from flatpack.backends import local
    from flatpack.errors import InputError

    batches = [(torch.randn(4, 4), torch.randint(0, 3, (4,))) for _ in range(2)]
    with local.deploy(_tiny_compiled(), store_url=f"file://{tmp_path}") as deployment:
        with pytest.raises(InputError, match=message):
            deployment.train(batches, **options)
        assert not deployment.workers


def test_the_memory_suggestion_is_the_smallest_tier_holding_the_peak_with_headroom():
    from flatpack.backends.functions import memory_suggestion_mb

    mb = 1 << 20
    assert memory_suggestion_mb(900 * mb, (512, 1024, 2048)) == 1024
    assert memory_suggestion_mb(1000 * mb, (512, 1024, 2048)) == 2048      # 1100 MB with headroom
    # no tiers known, or none large enough: the peak plus headroom rounded up to 64 MB
    assert memory_suggestion_mb(1000 * mb) == 1152
    assert memory_suggestion_mb(5000 * mb, (512, 1024)) == 5504


def test_torch_threads_restores_the_count_after_an_error():
    from flatpack.job import torch_threads

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with torch_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
