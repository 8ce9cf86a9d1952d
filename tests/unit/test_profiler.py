"""The profiler: what it measures per layer, its fits, its cache and its bad-input errors."""

from __future__ import annotations

import logging

import json
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import flatpack
from flatpack.errors import InputError
from flatpack.ir import meta
from flatpack.ir.profile import ChainProfile, LayerProfile, Linear
from flatpack.measure import saved_tensors
from flatpack.profiler import ProfileOptions, cache_path, optimizer_state_bytes
from tests.unit.narrowing import graph_of, problem_of, profile_of

FAST: dict[str, Any] = dict(repeats=1, warmup=0, batch_sizes=(1, 2, 4), progress=False)


class Chain(nn.Module):
    """linear → exp → linear: each op's saved tensors are known from autograd's formulas."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.exp(self.first(x)))


def compiled_with_profile(tmp_path, model=None, inputs=None, passes=None, **options):
    model = model or Chain()
    inputs = inputs if inputs is not None else (torch.randn(4, 8),)
    return flatpack.compile(model, inputs, stages=1, passes=passes,
                            profile=ProfileOptions(cache_dir=str(tmp_path), **{**FAST, **options}))


# --- the fit -------------------------------------------------------------------------------------


@given(st.floats(0, 1e3), st.floats(0, 1e3), st.lists(st.integers(1, 64), min_size=2, max_size=6, unique=True))
def test_linear_fit_recovers_an_exact_line(per_sample, fixed, batches):
    line = Linear.fit(batches, [per_sample * b + fixed for b in batches])
    assert line.per_sample == pytest.approx(per_sample, rel=1e-6, abs=1e-6)
    assert line.fixed == pytest.approx(fixed, rel=1e-6, abs=1e-4)


def test_linear_fit_never_predicts_negative_values():
    falling = Linear.fit([1, 2, 4], [3.0, 2.0, 1.0])  # noise on a constant cost
    assert falling.per_sample == 0 and falling.fixed == pytest.approx(2.0)
    below_origin = Linear.fit([1, 2, 4], [0.5, 2.0, 5.0])
    assert below_origin.fixed == 0 and below_origin.per_sample > 0
    assert Linear.fit([2], [6.0]) == Linear(3.0, 0.0)


# --- what is measured ----------------------------------------------------------------------------


def test_every_layer_gets_a_profile_with_its_parameters_and_gradients(tmp_path):
    compiled = compiled_with_profile(tmp_path)
    profile = profile_of(compiled)
    assert len(profile.layers) == len(graph_of(compiled).layers) == 2
    for layer, measured in zip(graph_of(compiled).layers, profile.layers):
        assert layer.meta[meta.PROFILE] == measured
        assert measured.name == layer.name
        assert measured.param_bytes == layer.meta[meta.PARAM_BYTES] > 0
        assert measured.grad_bytes == measured.param_bytes
        assert measured.forward_s.at(1) > 0 and measured.backward_s.at(1) > 0
        assert measured.inference_s is not None and measured.inference_s.at(1) > 0
    assert problem_of(compiled).profiled


def test_saved_activation_bytes_are_what_autograd_keeps(tmp_path):
    compiled = compiled_with_profile(tmp_path)
    first, second = profile_of(compiled).layers
    # layer 0 = linear + exp on the raw input: the input needs no gradient, so linear saves
    # x for the weight gradient (8 floats per sample) and exp saves its result (16 floats).
    assert first.saved_bytes.per_sample == pytest.approx((8 + 16) * 4)
    # layer 1 = linear on exp's output: saves its input (16 floats per sample).
    assert second.saved_bytes.per_sample == pytest.approx(16 * 4)
    assert first.saved_bytes.fixed == pytest.approx(0, abs=1e-6)


def whole_model_saved_bytes(model: nn.Module, inputs: tuple) -> int:
    """What autograd keeps for the unpartitioned model: unique storages, parameters excluded."""
    with saved_tensors(exclude=[*model.parameters(), *model.buffers()]) as saved:
        model(*inputs)
    return sum(saved.values())


@pytest.mark.parametrize("name", ["chain", "vgg11", "resnet50"])
def test_stage_saved_bytes_match_what_autograd_keeps_for_the_whole_model(tmp_path, name):
    from flatpack import zoo
    from flatpack.ir.profile import stage_saved_bytes

    model, inputs = (Chain(), (torch.randn(4, 8),)) if name == "chain" else zoo.build(name, "tiny", batch=4)
    model.train()
    compiled = compiled_with_profile(tmp_path, model, inputs)
    expected = whole_model_saved_bytes(model, inputs)
    assert stage_saved_bytes(profile_of(compiled).layers, 4) == pytest.approx(expected, rel=1e-6)
    # measured alone, the layers double-count the tensors two neighbours both keep
    assert sum(layer.saved_bytes.at(4) for layer in profile_of(compiled).layers) >= expected


def test_output_bytes_are_the_boundary_bytes_at_each_batch(tmp_path):
    compiled = compiled_with_profile(tmp_path)
    example_batch = 4
    for index, measured in enumerate(profile_of(compiled).layers):
        assert measured.output_bytes.at(example_batch) == pytest.approx(graph_of(compiled).boundary(index).nbytes)
        assert measured.output_bytes.fixed == pytest.approx(0, abs=1e-6)


def test_peak_bytes_cover_the_saved_activations_and_gradients(tmp_path):
    for measured in profile_of(compiled_with_profile(tmp_path)).layers:
        for batch in (1, 4):
            assert measured.peak_bytes.at(batch) >= measured.saved_bytes.at(batch) + measured.grad_bytes - 1


def test_optimizer_state_is_read_from_the_optimizers():
    params = [nn.Parameter(torch.randn(10, 3)), nn.Parameter(torch.randn(3))]
    param_bytes = (30 + 3) * 4
    state = optimizer_state_bytes(params)
    assert state["sgd"] == 0
    assert state["sgd-momentum"] == param_bytes
    # Adam keeps two moments per parameter plus a scalar step counter per tensor.
    assert 2 * param_bytes <= state["adam"] <= 2 * param_bytes + 8 * len(params)
    assert all(torch.equal(p, p.detach()) for p in params)


def test_inputs_with_masks_and_several_tensors_are_resized_together(tmp_path):
    from tests.models import MaskedEncoder

    model = MaskedEncoder()
    inputs = (torch.randn(3, 5, 8), torch.randint(0, 2, (3, 5)))
    compiled = flatpack.compile(model, inputs, stages=1,
                                profile=ProfileOptions(cache_dir=str(tmp_path), **FAST))
    assert all(layer.forward_s.at(1) > 0 for layer in profile_of(compiled).layers)


def test_profiling_leaves_the_model_and_its_buffers_unchanged(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 2))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = torch.randn(2, 3, 8, 8)
    compiled = compiled_with_profile(tmp_path, model, (inputs,))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    from tests.helpers import assert_equivalent
    assert_equivalent(model, (inputs,), compiled=compiled)


# --- the cache -----------------------------------------------------------------------------------


def test_second_profile_of_the_same_graph_is_a_reported_cache_hit(tmp_path):
    first = compiled_with_profile(tmp_path)
    assert not profile_of(first).cache_hit
    second = compiled_with_profile(tmp_path)
    saved_json = second.info.to_json()   # what flatpack.json records
    assert profile_of(second).cache_hit and saved_json["profile"]["cache_hit"]
    assert second.profile == first.profile


def test_cache_key_changes_with_input_shape_repeats_and_graph(tmp_path):
    compiled_with_profile(tmp_path)
    assert profile_of(compiled_with_profile(tmp_path, inputs=(torch.randn(4, 8),))).cache_hit  # new values, same shape
    assert not profile_of(compiled_with_profile(tmp_path, inputs=(torch.randn(6, 8),))).cache_hit
    assert not profile_of(compiled_with_profile(tmp_path, repeats=2)).cache_hit
    wider = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    assert not profile_of(compiled_with_profile(tmp_path, wider)).cache_hit
    assert len(list(tmp_path.glob("*.json"))) == 4


class WideChain(Chain):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 64)
        self.second = nn.Linear(64, 4)


def test_a_wider_model_with_the_same_code_is_not_a_cache_hit(tmp_path):
    compiled_with_profile(tmp_path)
    wider = compiled_with_profile(tmp_path, WideChain())
    assert not profile_of(wider).cache_hit
    assert profile_of(wider).layers[1].param_bytes == (64 * 4 + 4) * 4


def test_a_corrupt_cache_entry_is_measured_again(tmp_path):
    compiled = compiled_with_profile(tmp_path)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{not json")
    again = compiled_with_profile(tmp_path)
    assert not profile_of(again).cache_hit
    assert json.loads(entry.read_text())["profile"]["graph_hash"] == profile_of(compiled).graph_hash


def test_use_cache_false_measures_and_writes_nothing(tmp_path):
    compiled_with_profile(tmp_path, use_cache=False)
    assert not list(tmp_path.iterdir())


def test_profile_survives_save_and_load(tmp_path):
    compiled = compiled_with_profile(tmp_path / "cache")
    compiled.save(tmp_path / "out")
    loaded = flatpack.load(tmp_path / "out")
    assert loaded.profile == compiled.profile
    assert ChainProfile.from_json(json.loads(json.dumps(profile_of(compiled).to_json()))) == compiled.profile


def test_progress_bar_is_shown_on_request(tmp_path, capsys, caplog):
    compiled_with_profile(tmp_path, progress=True)
    err = capsys.readouterr().err      # not a terminal: plain lines, no \r frames
    assert err.startswith("profiling 0/") and "s  done" in err.splitlines()[-1] and "\r" not in err
    with caplog.at_level(logging.DEBUG, logger="flatpack"):
        compiled_with_profile(tmp_path, progress=True)
    assert "loaded from cache" in caplog.text


def test_a_time_budget_still_measures_every_layer(tmp_path):
    compiled = compiled_with_profile(tmp_path, repeats=50, max_seconds=0.001, use_cache=False)
    assert all(layer.forward_s.at(1) > 0 for layer in profile_of(compiled).layers)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [dict(batch_sizes=(0,)), dict(batch_sizes=(-2, 4)), dict(batch_sizes=()),
                                     dict(repeats=0), dict(max_seconds=0)])
def test_bad_profile_options_are_refused(options):
    with pytest.raises(InputError):
        ProfileOptions(**options)


def test_a_model_without_batched_tensor_inputs_cannot_be_profiled(tmp_path):
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return x * self.weight

    with pytest.raises(InputError, match="batch dimension"):
        flatpack.compile(Scale(), (torch.tensor(2.0),), stages=1,
                         profile=ProfileOptions(cache_dir=str(tmp_path), **FAST))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_profiling_on_a_missing_gpu_is_refused(tmp_path):
    with pytest.raises(InputError, match="no CUDA device"):
        compiled_with_profile(tmp_path, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profiling_on_the_gpu_records_it(tmp_path):
    compiled = compiled_with_profile(tmp_path, device="cuda")
    assert profile_of(compiled).host.device == "cuda" and profile_of(compiled).host.gpu
    assert all(layer.forward_s.at(1) > 0 for layer in profile_of(compiled).layers)


def test_cache_path_is_under_the_chosen_directory(tmp_path):
    assert cache_path("abc", tmp_path) == tmp_path / "abc.json"


def test_a_layer_larger_than_the_largest_tier_is_reported_before_solving(tmp_path):
    from flatpack.errors import PlanError
    from flatpack.partitioner.workload import Workload

    # ~400 GB of saved activations per layer: no tier holds it even with 4 replicas (µ = 1)
    huge_batch = Workload(batch=4_000_000_000, micro_batches=4)
    with pytest.raises(PlanError) as caught:
        flatpack.compile(Chain(), (torch.randn(4, 8),), stages=1, target="aws-lambda", workload=huge_batch,
                         profile=ProfileOptions(cache_dir=str(tmp_path), **FAST))
    message = str(caught.value)
    assert "layer 0 (first:linear)" in message and "10240" in message
    assert "smaller micro-batch" in message


# --- calibration through compile ------------------------------------------------------------------


def calibration_for(compiled, names=None, graph_hash=None, platform="aws-lambda"):
    from flatpack.platform.calibration import Calibration, TierCalibration

    names = tuple(names or (layer.name for layer in profile_of(compiled).layers))
    lines = tuple(Linear(0.5, 0.25) for _ in names)
    return Calibration(platform, names, {1024: TierCalibration(lines, lines)},
                       graph_hash or profile_of(compiled).graph_hash)


def test_a_calibration_file_overrides_the_host_model_for_its_tiers(tmp_path):
    profiled = compiled_with_profile(tmp_path)
    path = calibration_for(profiled).save(tmp_path / "cal.json")
    compiled = flatpack.compile(Chain(), (torch.randn(4, 8),), stages=1, target="aws-lambda",
                                profile=ProfileOptions(cache_dir=str(tmp_path), **FAST), calibration=str(path))
    problem = problem_of(compiled)
    assert problem.layer_seconds(0, problem.platform.tier(1024), 2) == (1.25, 1.25)
    host = problem.layer_seconds(0, problem.platform.tier(2048), 2)  # not calibrated: the host model
    assert host != (1.25, 1.25) and host[0] > 0


@pytest.mark.parametrize("change, message", [
    (dict(names=("first:linear", "other")), "layer 1"),
    (dict(graph_hash="0" * 32), "hashes to"),
    (dict(platform="alibaba-fc"), "measured on 'alibaba-fc'"),
])
def test_a_calibration_file_for_another_graph_or_platform_is_refused(tmp_path, change, message):
    profiled = compiled_with_profile(tmp_path)
    path = calibration_for(profiled, **change).save(tmp_path / "cal.json")
    with pytest.raises(InputError, match=message):
        flatpack.compile(Chain(), (torch.randn(4, 8),), stages=1, target="aws-lambda",
                         profile=ProfileOptions(cache_dir=str(tmp_path), **FAST), calibration=str(path))


# --- coarsening a profiled chain --------------------------------------------------------------


def test_coarsen_by_time_runs_on_measured_seconds_and_merges_the_profiles(tmp_path):
    from flatpack import zoo
    from flatpack.ir.profile import stage_saved_bytes
    from flatpack.profiler import graph_hash

    model, inputs = zoo.build("vgg11", "tiny", batch=4)
    model.train()
    fine = compiled_with_profile(tmp_path, model, inputs)
    coarse = compiled_with_profile(tmp_path, model, inputs,
                                   passes="fuse-elementwise,merge-branches,coarsen{max-layers=4,by=time}")
    assert profile_of(coarse).cache_hit  # the chain was profiled before coarsen: the same graph as `fine`
    layers = profile_of(coarse).layers
    assert len(layers) == len(graph_of(coarse).layers) == 4
    assert all(layer.meta[meta.PROFILE] == merged for layer, merged in zip(graph_of(coarse).layers, layers))
    assert profile_of(coarse).graph_hash == graph_hash(graph_of(coarse)) != profile_of(fine).graph_hash
    total = sum(layer.forward_s.at(4) for layer in profile_of(fine).layers)
    assert sum(layer.forward_s.at(4) for layer in layers) == pytest.approx(total)
    assert sum(layer.param_bytes for layer in layers) == sum(layer.param_bytes for layer in profile_of(fine).layers)
    # merged saved bytes stay exact: the whole chain as one stage keeps what autograd keeps
    assert stage_saved_bytes(layers, 4) == pytest.approx(whole_model_saved_bytes(model, inputs), rel=1e-6)
    assert layers[-1].output_bytes == profile_of(fine).layers[-1].output_bytes
    for merged in layers:
        assert merged.peak_bytes.at(4) >= merged.saved_bytes.at(4)


def test_a_pass_that_drops_profiles_after_coarsen_gets_the_chain_profiled_again(tmp_path):
    compiled = compiled_with_profile(tmp_path, passes="coarsen{max-layers=1,by=time},fuse-elementwise")
    assert len(profile_of(compiled).layers) == len(graph_of(compiled).layers) == 1
    assert graph_of(compiled).layers[0].meta[meta.PROFILE] == profile_of(compiled).layers[0]


# --- profiles that can be trusted ---------------------------------------------------------------


def _layer(name: str, forward: Linear, backward: Linear) -> LayerProfile:
    zero = Linear(0.0, 0.0)
    return LayerProfile(name=name, forward_s=forward, backward_s=backward, param_bytes=0, grad_bytes=0,
                        buffer_bytes=0, saved_bytes=zero, output_bytes=zero, peak_bytes=zero)


def test_a_time_that_does_not_grow_with_the_batch_is_reported_not_used_silently():
    from flatpack.ir.profile import HostInfo, ProfileWarning
    from flatpack.profiler import _warn_flat_slopes, flat_slopes

    falling = Linear.fit([1, 2, 4], [3e-3, 2e-3, 1e-3])  # clamped to a zero slope
    layers = [_layer("grows", Linear(1e-3, 1e-4), Linear(2e-3, 0.0)), _layer("flat", falling, Linear(1e-3, 0.0))]
    flat = flat_slopes(layers, [1, 2, 4])
    assert flat == ("layer 1 (flat): forward",)
    assert flat_slopes(layers, [4]) == (), "one batch size cannot show a slope"
    profile = ChainProfile(tuple(layers), HostInfo("cpu", 1, "cpu", torch.__version__), (1, 2, 4), "h", "float32", 1,
                           flat_slopes=flat)
    assert not profile.slopes_trusted
    assert ChainProfile.from_json(json.loads(json.dumps(profile.to_json()))).flat_slopes == flat
    with pytest.warns(ProfileWarning, match=r"layer 1 \(flat\): forward"):
        _warn_flat_slopes(profile)
    whole = ChainProfile((layers[1],), profile.host, (1, 2, 4), "h", "float32", 1, flat_slopes=flat)
    with pytest.warns(ProfileWarning, match="whole chain"):
        _warn_flat_slopes(whole)


class FixedBatch(nn.Module):
    """Flattens the whole batch into one row: it runs at the example's batch size only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, batch):
        return self.linear(batch["x"].reshape(1, 8))


def test_a_graph_with_a_fixed_batch_is_refused_with_the_reason(tmp_path):
    model, inputs = FixedBatch(), ({"x": torch.randn(1, 8)},)
    compiled = flatpack.compile(model, inputs, stages=1)
    assert compiled.frontend == "export" and not graph_of(compiled).traced.dynamic_batch
    assert any("batch 1" in note for note in compiled.info.trace_notes)
    with pytest.raises(InputError, match=r"fixes the batch.*batch_sizes=\(1,\)"):
        flatpack.compile(model, inputs, stages=1, profile=ProfileOptions(cache_dir=str(tmp_path), **FAST))
    one = flatpack.compile(model, inputs, stages=1,
                           profile=ProfileOptions(cache_dir=str(tmp_path), **{**FAST, "batch_sizes": (1,)}))
    assert profile_of(one).batch_sizes == (1,)


def test_an_example_of_batch_one_is_traced_with_a_dynamic_batch_and_profiled_over_sizes(tmp_path):
    """Zoo BERT's example has batch 1, which torch.export specializes: flatpack traces the
    example repeated to batch 2, so the stages run at any batch and the profile varies it."""
    pytest.importorskip("transformers")
    from flatpack.zoo import build

    model, inputs = build("bert-large", "tiny", batch=1)
    compiled = flatpack.compile(model, inputs, stages=2,
                                profile=ProfileOptions(cache_dir=str(tmp_path), **FAST))
    assert graph_of(compiled).traced.dynamic_batch
    assert any("repeated to batch 2" in note for note in compiled.info.trace_notes)
    assert profile_of(compiled).batch_sizes == (1, 2, 4)
    from transformers import PretrainedConfig

    config = model.config
    assert isinstance(config, PretrainedConfig)
    ids = torch.randint(0, config.vocab_size, (3, 8))
    torch.testing.assert_close(compiled.as_module()(ids).last_hidden_state, model(ids).last_hidden_state)


def test_a_one_thread_cpu_profile_is_timed_by_the_threads_cpu_seconds():
    """The host's other load does not stretch a layer's CPU seconds, and a function worker's
    throttle stretches exactly those (runtime.worker.cpu_throttle times by thread_time)."""
    import time

    from flatpack.profiler import host_clock

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert host_clock(torch.device("cpu")) is time.thread_time
        torch.set_num_threads(2)
        assert host_clock(torch.device("cpu")) is time.perf_counter    # other threads' CPU would be missed
    finally:
        torch.set_num_threads(previous)
    assert host_clock(torch.device("cuda")) is time.perf_counter
