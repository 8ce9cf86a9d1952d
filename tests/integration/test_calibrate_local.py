"""`flatpack calibrate --target local` for real: a calibration function per tier, each a
separate process held to its tier's CPU share and link, sharing only the local S3 server,
then the probe pipeline of each tier with 1, 2 and 4 workers and the served probe (the task
terms); then `flatpack compile --calibration` records the file's digest in the plan, and
reusing that plan without the calibration is refused (item 5). No wall-clock time is asserted
beyond orderings with wide margins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from flatpack.platform.calibration import TASK_KINDS, Calibration

ROOT = Path(__file__).resolve().parents[2]


def flatpack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flatpack", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def test_calibrate_local_then_compile_records_the_digest(tmp_path):
    out = tmp_path / "calibration.json"
    done = flatpack("calibrate", "--target", "local", "--tiers", "512,2048,4096", "--round-trips", "8", "--probe-mb",
                    "0.25", "--probe-iterations", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr
    calibration = Calibration.load(out)
    target, store_latency = calibration.target, calibration.store_latency
    assert target is not None and target.name == "local" and target.flatpack_version
    assert calibration.tiers_mb == (512, 2048, 4096)
    assert calibration.host_cores is not None and calibration.host_cores >= 1
    # the host CPU of a store request, client and server together (the host bound's figures):
    # a put or a get costs both processes something, and more bytes cost no less
    request_cpu = calibration.request_cpu
    assert request_cpu is not None
    assert min(request_cpu.put_s, request_cpu.get_s, request_cpu.miss_s) > 0
    assert min(request_cpu.put_s_per_byte, request_cpu.get_s_per_byte) >= 0
    # 8 round trips on each tier that times its requests: 512 and 2048 MB (4096 MB times its link alone)
    assert store_latency is not None and store_latency.samples == 2 * 2 * 8 and store_latency.mean_s > 0
    small, large = calibration.tiers[512], calibration.tiers[2048]
    # 0.29 of a vCPU against a whole one: ~3.4x slower; a wide margin for a shared host
    small_ratio, large_ratio = small.speed_ratio, large.speed_ratio
    assert small_ratio is not None and large_ratio is not None and small_ratio > 1.5 * large_ratio
    assert small.invoke_cold_s is not None and small.invoke_cold_s > 0
    assert small.invoke_warm_s is not None and small.invoke_warm_s > 0 and small.optimizer_s_per_byte["adam"] > 0
    assert small.burst_s is not None and small.burst_s >= 0    # fitted, or 0 where the small probe is all burst
    assert "skipped" in calibration.collective
    # the probe pipeline ran on each tier with 1, 2 and 4 workers (every training task kind,
    # the transfers only between two stages, the sync only where there is one) and served with
    # 1, 3 and 5 functions (the request alone, then a fork over 2 and 4 workers); none below 0,
    # and a worker's forward costs more than its layers' compute (seeding, the lanes'
    # hand-offs, a cold cache), a request more than Gillis's equations (its own round trips)
    training = set(TASK_KINDS) - {"request", "fork"}
    for tier in (small, large):
        assert set(tier.task_overhead_s) == {1, 2, 3, 4, 5}
        assert set(tier.task_overhead_s[2]) == training - {"sync"} and set(tier.task_overhead_s[4]) == training
        # one worker: one stage, no boundary (no upload, no sync); its downloads are its prefetches
        assert set(tier.task_overhead_s[1]) == {"forward", "backward", "download", "step", "iteration", "request"}
        assert set(tier.task_overhead_s[5]) == {"fork"}
        assert min(min(terms.values()) for terms in tier.task_overhead_s.values()) >= 0
    assert small.task_overhead_s[2]["forward"] > 0 and small.task_overhead_s[1]["request"] > 0
    assert "probe pipeline" in calibration.provenance["tasks"]
    # 4096 MB runs unthrottled at one thread as 2048 MB does: its starts, compute, optimizer
    # and task terms are 2048 MB's, measured once (target_calibration.alike_tiers); its link
    # is its own (faster)
    largest = calibration.tiers[4096]
    assert largest.task_overhead_s == large.task_overhead_s and largest.invoke_cold_s == large.invoke_cold_s
    assert largest.compute_ratio == large.compute_ratio and largest.optimizer_s_per_byte == large.optimizer_s_per_byte
    assert largest.upload_bytes_s is not None and large.upload_bytes_s is not None
    assert largest.upload_bytes_s != large.upload_bytes_s     # measured by its own function
    assert largest.invoke_warm_s is not None and "4096 MB" in calibration.provenance["alike"]
    assert f"digest {calibration.digest[:16]}" in done.stdout

    compiled_dir = tmp_path / "compiled"
    done = flatpack("compile", "mlp", "--stages", "2", "--out", str(compiled_dir), "--calibration", str(out))
    assert done.returncode == 0, done.stderr
    plan = json.loads((compiled_dir / "plan.json").read_text())
    assert plan["provenance"]["calibration_digest"] == calibration.digest
    assert plan["provenance"]["target"] == "local" and len(plan["provenance"]["graph_hash"]) == 32

    again = flatpack("compile", "mlp", "--out", str(tmp_path / "again"), "--plan", str(compiled_dir / "plan.json"))
    assert again.returncode == 2
    assert "calibration: made for" in again.stderr and "--force" in again.stderr
    forced = flatpack("compile", "mlp", "--out", str(tmp_path / "forced"), "--plan", str(compiled_dir / "plan.json"),
                      "--force")
    assert forced.returncode == 0, forced.stderr
    # the library's PlanReuseWarning, said once in the command line's words (cli.warnings_through_the_logger)
    assert "warning: the plan was made for something else" in forced.stderr and "calibration" in forced.stderr


def test_plan_from_run_refits_a_finished_run(tmp_path):
    import flatpack as fp
    from flatpack.examples import mlp
    from flatpack.compiler import replan_run
    from flatpack.partitioner.workload import Workload

    run = tmp_path / "run"
    done = flatpack("run", "mlp", "--iterations", "4", "--no-verify", "--out", str(run))
    assert done.returncode == 0, done.stderr
    assert (run / "events.json").exists()
    replanned = replan_run(run)
    assert replanned.new_predicted_s <= replanned.old_predicted_s and replanned.measured_s > 0
    shown = flatpack("plan", "--from-run", str(run), "--json", str(tmp_path / "new.json"))
    assert shown.returncode == 0, shown.stderr
    assert "old plan:" in shown.stdout and "new plan:" in shown.stdout
    # compile(measured=...) plans on the re-fit: the chain and tiers of that run
    model, example = mlp()
    compiled = fp.compile(model, example, measured=run, solver="dp", profile=True,
                          workload=Workload("train", batch=32, micro_batches=4, optimizer="adam"))
    assert compiled.problem is not None and compiled.problem.calibration is not None
    assert compiled.problem.calibration.provenance["measured"].startswith("re-fitted from the timeline")
    assert {stage.memory_mb for stage in compiled.plan.stages} <= set(compiled.problem.calibration.tiers)
