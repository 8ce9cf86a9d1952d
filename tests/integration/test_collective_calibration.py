"""``flatpack calibrate --target gpu-container``: real ranks (gloo on the CPU here; the GPU
paths run where torch sees one) time messages and all-reduces, the fit lands in the file,
and a plan made with the file prices the all-reduce with it. Bad options are refused before
any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import flatpack
from flatpack import cli
from flatpack.backends import collective_calibration, gpu_container
from flatpack.backends.gpu_container import _free_port as free_port
from flatpack.backends.images import write_files
from flatpack.backends.collective_calibration import calibrate_collective, choose_transport
from flatpack.backends.target_calibration import calibrate_target, calibration_summary
from flatpack.errors import InputError, RunFailure
from flatpack.partitioner.cost.collectives import measured_terms, ring_allreduce_seconds
from flatpack.platform.calibration import Calibration
from flatpack.runtime import collective_probe

# 4 KB to 16 MB: three gloo ranks share this VM's two cores, and a small all-reduce's median
# reads up to 7 ms when a rank waits for a core; at 2 MB (5-9 ms) that now and then made the
# largest size read faster than the smallest. 16 MB takes 14-39 ms here.
SIZES = (1 << 12, 1 << 18, 1 << 24)
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Calibration:
    out = tmp_path_factory.mktemp("collective") / "calibration.json"
    return calibrate_collective("gpu-container", out=out, ranks=3, backend="gloo", device="cpu", sizes=SIZES,
                                repeats=3)


@pytest.mark.slow
def test_gloo_ranks_measure_the_link_and_the_all_reduce_among_each_count(measured, tmp_path):
    fit = measured.collective_fit
    assert fit is not None
    assert (fit.ranks, fit.backend, fit.device, fit.sizes_bytes) == (3, "gloo", "cpu", SIZES)
    assert sorted(fit.all_reduce_s) == [2, 3]
    every = (*fit.point_to_point_s, *(t for seconds in fit.all_reduce_s.values() for t in seconds))
    assert all(seconds > 0 for seconds in every)
    # a 16 MB message takes longer than a 4 KB one, over the wire and in the all-reduce
    assert fit.point_to_point_s[-1] > fit.point_to_point_s[0]
    assert all(seconds[-1] > seconds[0] for seconds in fit.all_reduce_s.values())
    assert fit.bandwidth_bytes_s > 0
    assert min(fit.alpha_s_per_byte, fit.beta_s, fit.per_call_s, fit.copy_s_per_byte) >= 0
    # the fitted equation meets every measured all-reduce within the error the file reports,
    # and the equation anchored to the measurements (what a plan is priced with) meets each
    # one that no smaller size undercuts
    terms = measured_terms(fit)
    for count, seconds in fit.all_reduce_s.items():
        for index, (nbytes, measured_s) in enumerate(zip(fit.sizes_bytes, seconds)):
            equation = terms.equation_seconds(nbytes, count, fit.bandwidth_bytes_s)
            assert abs(equation - measured_s) <= fit.ring_error * measured_s * (1 + 1e-9)
            assert terms.seconds(nbytes, count, fit.bandwidth_bytes_s) == pytest.approx(max(seconds[:index + 1]),
                                                                                       rel=1e-12)
    # every catalog tier takes the measured D, the platform the message latency
    assert set(measured.tiers) == {6144, 16384}
    assert all(tier.bandwidth_bytes_s == fit.bandwidth_bytes_s for tier in measured.tiers.values())
    assert measured.storage_latency_s == fit.latency_s
    assert "3 gloo ranks on cpu" in calibration_summary(measured)
    assert "among 2, 3 ranks" in calibration_summary(measured)


@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a GPU: the ranks' tensors live on it")
def test_ranks_on_the_gpu_time_the_transport_a_plan_s_ranks_would_use(tmp_path):
    """With a GPU the default is what ``gpu_container.deploy`` runs: NCCL with a GPU per
    rank, else gloo ranks sharing the GPU (each message staged through the host)."""
    calibration = calibrate_collective("gpu-container", out=tmp_path / "calibration.json", ranks=2, sizes=SIZES,
                                       repeats=3)
    fit = calibration.collective_fit
    assert fit is not None
    assert (fit.device, fit.backend) == ("cuda", "nccl" if torch.cuda.device_count() >= 2 else "gloo")
    assert fit.device_name == torch.cuda.get_device_name(0)
    assert fit.point_to_point_s[-1] > fit.point_to_point_s[0]
    assert fit.all_reduce_s[2][-1] > fit.all_reduce_s[2][0]
    assert fit.bandwidth_bytes_s > 0 and min(fit.alpha_s_per_byte, fit.beta_s) >= 0
    assert Calibration.load(tmp_path / "calibration.json").collective_fit == fit


@pytest.mark.slow
def test_a_plan_made_with_the_file_prices_the_all_reduce_it_measured(measured, tmp_path, capsys):
    path = measured.save(tmp_path / "calibration.json")
    fit = measured.collective_fit
    assert fit is not None
    common = ["plan", "resnet34", "--size", "tiny", "--target", "gpu-container", "--replicas", "2", "--batch", "8",
              "--micro-batches", "2", "--memory", "6144", "--json"]
    assert cli.main([*common, "--calibration", str(path)]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert cli.main(common) == 0
    catalog = json.loads(capsys.readouterr().out)
    for document in (calibrated, catalog):
        assert {plan["breakdown"]["data_parallel"] for plan in document["plans"]} == {2}
    for plan in calibrated["plans"]:
        for shard in plan["breakdown"]["shards"]:
            expected = measured_terms(fit).seconds(shard["sync_bytes"], 2, fit.bandwidth_bytes_s)
            assert shard["allreduce_s"] == pytest.approx(expected, rel=1e-12)
    # the catalog's 1 Gbit/s and no overheads give another figure for the same shard
    first = catalog["plans"][0]["breakdown"]["shards"][0]
    assert first["allreduce_s"] == pytest.approx(ring_allreduce_seconds(first["sync_bytes"], 2, 1e9 / 8), rel=1e-12)
    calibrated_first = measured_terms(fit).seconds(first["sync_bytes"], 2, fit.bandwidth_bytes_s)
    assert first["allreduce_s"] != pytest.approx(calibrated_first, rel=1e-3)


@pytest.mark.parametrize("arguments,message", [
    (["--ranks", "1"], "--ranks 1: an all-reduce and a message need two ranks or more"),
    (["--ranks", "0"], "--ranks 0: an all-reduce and a message need two ranks or more"),
    (["--emulate"], "--emulate place calibration functions; gpu-container is measured by ranks"),
    (["--region", "us-east-1"], "--region place calibration functions"),
    (["--tiers", "512"], "512 MB"),
] + ([] if CUDA else [
    (["--backend", "nccl"], "needs a GPU"),
    (["--device", "cuda"], "needs a GPU"),
]))
def test_bad_options_are_refused_before_any_rank_starts(arguments, message, monkeypatch, capsys, tmp_path):
    def no_ranks(**_):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(collective_calibration, "measure", no_ranks)
    out = tmp_path / "calibration.json"
    assert cli.main(["calibrate", "--target", "gpu-container", "--out", str(out), *arguments]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_rank_options_on_a_function_target_are_refused(capsys):
    assert cli.main(["calibrate", "--target", "local", "--ranks", "2"]) == 2
    assert "--ranks choose the ranks of a GPU-container calibration" in capsys.readouterr().err
    with pytest.raises(InputError, match="talk to each other directly"):
        calibrate_target("gpu-container")


@pytest.mark.parametrize("gpus,ranks,given,expected", [
    (0, 2, (None, None), ("gloo", "cpu")),
    (1, 2, (None, None), ("gloo", "cuda")),    # one GPU: the ranks share it, as gpu_container.deploy advises
    (2, 2, (None, None), ("nccl", "cuda")),
    (4, 3, (None, "cpu"), ("gloo", "cpu")),
])
def test_the_default_transport_is_what_a_plan_s_ranks_would_run_with(gpus, ranks, given, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert choose_transport(ranks, *given) == expected


def test_nccl_with_fewer_gpus_than_ranks_says_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InputError, match="NCCL needs one GPU per rank: 2 ranks, 1 GPU.*--backend gloo"):
        choose_transport(2, "nccl", None)


def test_a_rank_that_fails_is_reported_with_its_log(monkeypatch):
    # one rank alone refuses to start (WORLD_SIZE 1): the error and the rank's log come back
    monkeypatch.setattr(collective_calibration, "choose_transport", lambda ranks, backend, device: ("gloo", "cpu"))
    with pytest.raises(RunFailure, match="rank 0 failed:(.|\n)*WORLD_SIZE is 1"):
        collective_calibration.measure(ranks=1, sizes=SIZES, repeats=1, timeout_s=60)


def test_the_probe_refuses_one_rank(monkeypatch, tmp_path):
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "1")
    with pytest.raises(InputError, match="start two or more"):
        collective_probe.main(["--out", str(tmp_path / "probe.json")])


@pytest.fixture(scope="module")
def cluster_probe(tmp_path_factory) -> Path:
    """What the probe writes in a cluster, produced the way a cluster would: two ranks started
    from the gpu-container image's own files (its build context, nothing else of flatpack)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = flatpack.compile(model, (torch.randn(2, 8),), stages=1, target="gpu-container")
    files = gpu_container.package(compiled, backend="gloo", name="probe")
    gpu_container.check_package(files)
    assert "flatpack/runtime/collective_probe.py" in files
    app = tmp_path_factory.mktemp("image") / "app"
    write_files({path: data for path, data in files.items() if path.startswith("flatpack/")}, app)
    out = app.parent / "probe.json"
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-m", "flatpack.runtime.collective_probe", "--sizes",
                               ",".join(map(str, SIZES)), "--repeats", "2", "--out", str(out)],
                              env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(app),
                                   "OMP_NUM_THREADS": "1"},
                              cwd=app.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(2)]
    for process in ranks:
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output.decode()[-2000:]
    return out


@pytest.mark.slow
def test_the_image_s_probe_measures_a_cluster_and_calibrate_reads_what_it_wrote(cluster_probe, tmp_path, capsys):
    out = tmp_path / "calibration.json"
    assert cli.main(["calibrate", "--target", "gpu-container", "--from-probe", str(cluster_probe),
                     "--out", str(out)]) == 0
    assert "2 gloo ranks on cpu" in capsys.readouterr().out
    calibration = Calibration.load(out)
    fit = calibration.collective_fit
    assert fit is not None
    result = json.loads(cluster_probe.read_text())
    assert fit == collective_calibration.fitted(result)
    assert (fit.ranks, fit.sizes_bytes, fit.point_to_point_s) == (2, SIZES, tuple(result["point_to_point_s"]))
    assert "measured elsewhere" in calibration.provenance["where"]
    assert all(tier.bandwidth_bytes_s == fit.bandwidth_bytes_s for tier in calibration.tiers.values())


@pytest.mark.parametrize("edit,message", [
    (lambda text: text[: len(text) // 2], "is not JSON"),
    (lambda text: json.dumps({**json.loads(text), "format": "other"}), "is not a flatpack-collective-probe result"),
    (lambda text: json.dumps({key: value for key, value in json.loads(text).items() if key != "point_to_point_s"}),
     "lacks 'point_to_point_s'"),
    (lambda text: json.dumps({**json.loads(text), "all_reduce_s": {"2": [1e-3, -1.0, 2e-3]}}), "positive"),
    (lambda text: json.dumps({**json.loads(text), "point_to_point_s": [1e-3, 1e-3, 1e-3]}),
     "do not grow with the message size"),
    (lambda text: json.dumps({**json.loads(text), "all_reduce_s": {"5": [1e-3, 2e-3, 3e-3]}}), "rank counts"),
])
def test_an_edited_probe_result_is_refused_naming_the_file(cluster_probe, edit, message, tmp_path, capsys):
    edited = tmp_path / "probe.json"
    edited.write_text(edit(cluster_probe.read_text()))
    out = tmp_path / "calibration.json"
    assert cli.main(["calibrate", "--target", "gpu-container", "--from-probe", str(edited), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert message in error and str(edited) in error
    assert not out.exists()


def test_from_probe_with_local_ranks_or_on_a_function_target_is_refused(tmp_path, capsys):
    probe = tmp_path / "probe.json"
    assert cli.main(["calibrate", "--target", "gpu-container", "--from-probe", str(probe), "--ranks", "2"]) == 2
    assert "--ranks choose ranks to start here, and --from-probe reads" in capsys.readouterr().err
    assert cli.main(["calibrate", "--target", "gpu-container", "--from-probe", str(probe)]) == 2
    assert f"cannot read the probe's result {probe}" in capsys.readouterr().err
    assert cli.main(["calibrate", "--target", "local", "--from-probe", str(probe)]) == 2
    assert "--from-probe choose the ranks of a GPU-container calibration" in capsys.readouterr().err
