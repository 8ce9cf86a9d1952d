"""The gpu-container backend: every stage replica is a ``torch.distributed`` rank (its own OS
process here, on 127.0.0.1) and the ranks send activations and gradients to each other
directly. After N iterations the parameters must equal single-process training on the same
batches. The build context (Dockerfile, launcher, Kubernetes manifests) is checked
structurally; NCCL runs only where CUDA is."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import flatpack
from flatpack.analysis.reference import train_single_process
from flatpack.backends import gpu_container
from flatpack.runtime import forked
from flatpack.backends.lock import committed_lock
from flatpack.backends.protocol import Deployment
from flatpack.errors import ArtifactError, InputError, RunFailure
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.workload import MODES
from flatpack.platform.catalog import BASE_IMAGES
from flatpack.runtime.distributed import (RUN_MODES, Channels, DistributedRun, Layout, StageRank, data_file,
                                          iter_reports, stage_path, synthetic_generator, synthetic_tensor,
                                          with_overrides)
from flatpack.stage.artifact import load_stage
from flatpack.stage.wire import pack_values
from flatpack.runtime.training import TARGET
from flatpack.stage.artifact import load_stage

BATCH = 12
PASSES = "fuse-elementwise"   # keeps the layers apart, so cuts carry the skip and the mask
CUDA = torch.cuda.is_available()


class SkipNet(nn.Module):
    """Two inputs (x and a mask carried through the stages), a skip connection h0 that crosses
    the first cut beside the main path, and a weight tied between the first two stages
    (``proj.weight`` is read again after the skip), so stages share a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.proj(x))
        h1 = torch.tanh(self.b(h0))
        h2 = torch.tanh(self.c(h1)) + h0
        return self.d((h2 @ self.proj.weight) * mask)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return SkipNet()


def example() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 8), torch.ones(BATCH, 8)


def batches(count: int) -> list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [((torch.randn(BATCH, 8, generator=generator), (torch.rand(BATCH, 8, generator=generator) > 0.2).float()),
             torch.randint(0, 5, (BATCH,), generator=generator)) for _ in range(count)]


def compiled_with(replicas: tuple[int, ...], micro_batches: int, memory_mb: int | None = None) -> flatpack.Compiled:
    model = make_model()
    base = flatpack.compile(model, example(), stages=len(replicas), passes=PASSES)
    stages = tuple(StagePlan(start, end, memory_mb, degree) for (start, end), degree in zip(base.plan.ranges, replicas))
    plan = Plan(stages, base.plan.num_layers, micro_batches=micro_batches)
    return flatpack.compile(model, example(), plan=plan, passes=PASSES, target="gpu-container")


def assert_matches_reference(result, reference: nn.Module, losses: list[float], *, rtol: float = 1e-4,
                             atol: float = 1e-5) -> None:
    for name, expected in reference.state_dict().items():
        assert name in result.parameters, f"{name} missing from the ranks' final parameters"
        torch.testing.assert_close(result.parameters[name].cpu(), expected, rtol=rtol, atol=atol, msg=name)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def hybrid() -> flatpack.Compiled:
    """3 stages × (2, 1, 2) replicas: a 5-rank A×B plan whose first two stages share a weight."""
    return compiled_with((2, 1, 2), micro_batches=4)


def test_layout_maps_ranks_to_stage_replicas_in_stage_order():
    layout = Layout((2, 1, 3))
    assert layout.world_size == 6
    assert [(role.stage, role.replica) for role in layout.roles()] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    assert layout.rank(2, 1) == 4 and layout.ranks_of(2) == [3, 4, 5]


def test_package_is_a_consistent_build_context(hybrid):
    files = gpu_container.package(hybrid, gpus_per_pod=1, name="skipnet")
    gpu_container.check_package(files)
    for path in ("Dockerfile", "requirements.txt", "run.json", "launch.sh", "k8s/job.yaml",
                 "flatpack/runtime/distributed.py", "stages/stage_002/manifest.json"):
        assert path in files
    dockerfile = files["Dockerfile"].decode()
    base = BASE_IMAGES["gpu-container"]
    assert dockerfile.startswith("# Generated by flatpack") and f"FROM {base.reference}" in dockerfile
    assert f"USER {base.user}" in dockerfile and "--require-hashes" in dockerfile
    assert files["requirements.txt"].decode() == committed_lock("gpu")
    assert b"torch==2.13.0 \\" in files["requirements.txt"]

    service, job, policy = gpu_container.parse_yaml_documents(files["k8s/job.yaml"].decode())
    # the pod: non-root, read-only root, no escalation, no capabilities, no API token, bounded
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["automountServiceAccountToken"] is False
    security = pod["containers"][0]["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]} >= {"/tmp", "/app/out"}
    assert {"cpu", "memory", gpu_container.GPU_RESOURCE} <= set(pod["containers"][0]["resources"]["limits"])
    # the network: only the run's own pods in and out, and DNS out
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["podSelector"] == {"matchLabels": labels}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": labels}}]}]
    assert policy["spec"]["egress"][0] == {"to": [{"podSelector": {"matchLabels": labels}}]}
    assert {port["port"] for port in policy["spec"]["egress"][1]["ports"]} == {53}
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 5
    container = spec["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"][gpu_container.GPU_RESOURCE] == 1
    env = {entry["name"]: entry.get("value") for entry in container["env"]}
    assert env["MASTER_ADDR"] == "skipnet-0.skipnet" and env["NNODES"] == "5" and env["NPROC_PER_NODE"] == "1"
    command = container["command"]
    assert command[0] == "torchrun" and "--nnodes=$(NNODES)" in command and "flatpack.runtime.distributed" in command
    # block-style YAML (not JSON), which any YAML reader parses to the same three documents
    assert "kind: Job" in files["k8s/job.yaml"].decode()
    assert [doc["kind"] for doc in yaml.safe_load_all(files["k8s/job.yaml"])] == ["Service", "Job", "NetworkPolicy"]

    launch = files["launch.sh"].decode()
    assert "torchrun --nnodes=" in launch and "-ne 5 ]" in launch
    run = json.loads(files["run.json"])
    assert [stage["replicas"] for stage in run["spec"]["stages"]] == [2, 1, 2] and run["backend"] == "nccl"
    assert run["spec"]["shared"] == {"proj.weight": [0, 1]}

    two_per_pod = gpu_container.package(compiled_with((2, 2), micro_batches=2, memory_mb=16 * 1024), gpus_per_pod=2)
    gpu_container.check_package(two_per_pod)
    _, job, _ = gpu_container.parse_yaml_documents(two_per_pod["k8s/job.yaml"].decode())
    limits = job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert job["spec"]["completions"] == 2 and limits[gpu_container.GPU_RESOURCE] == 2
    assert limits["memory"] == f"{2 * 16 * 1024}Mi"
    assert job["metadata"]["annotations"]["flatpack.io/gpu-model"] == "V100"


def test_check_package_names_what_is_inconsistent(hybrid):
    files = gpu_container.package(hybrid)
    del files["stages/stage_001/weights.safetensors"]
    documents = gpu_container.parse_yaml_documents(files["k8s/job.yaml"].decode())
    documents[1]["spec"]["completions"] = 4
    files["k8s/job.yaml"] = yaml.safe_dump_all(documents).encode()
    with pytest.raises(ArtifactError) as caught:
        gpu_container.check_package(files)
    message = str(caught.value)
    assert "stage_001/weights.safetensors is missing" in message
    assert "completions = parallelism" in message and "4 pods x 1 ranks per pod = 4" in message
    with pytest.raises(InputError, match="does not divide the world of 5 ranks"):
        gpu_container.package(hybrid, gpus_per_pod=2)


def _pod(docs):
    return docs[1]["spec"]["template"]["spec"]


def _container(docs):
    return _pod(docs)["containers"][0]


@pytest.mark.parametrize(("weaken", "problem"), [
    (lambda d: _pod(d)["securityContext"].update(runAsNonRoot=False), "runAsNonRoot: true"),
    (lambda d: _container(d)["securityContext"].update(readOnlyRootFilesystem=False), "readOnlyRootFilesystem must be "
                                                                                      "true"),
    (lambda d: _container(d)["securityContext"].update(allowPrivilegeEscalation=True), "allowPrivilegeEscalation must "
                                                                                       "be false"),
    (lambda d: _container(d)["securityContext"].update(capabilities={"drop": []}), "capabilities must drop ALL"),
    (lambda d: _container(d)["securityContext"].update(capabilities={"drop": ["ALL"], "add": ["NET_ADMIN"]}),
     "capabilities must drop ALL and add none"),
    (lambda d: _pod(d).update(automountServiceAccountToken=True), "automountServiceAccountToken"),
    (lambda d: _container(d)["resources"]["limits"].pop("memory"), "no resource limit for memory"),
    (lambda d: _container(d)["volumeMounts"][1].update(mountPath="/scratch"), "/tmp must be an emptyDir"),
    (lambda d: d[2]["spec"].update(policyTypes=["Ingress"]), "must govern both Ingress and Egress"),
    (lambda d: d[2]["spec"]["ingress"].append({}), "ingress rule open to everything"),
    (lambda d: d[2]["spec"]["egress"].append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}), "names an address block"),
    (lambda d: d[2]["spec"]["ingress"].append({"from": [{"namespaceSelector": {}}]}), "opens whole namespaces"),
    (lambda d: d[2]["spec"]["egress"][0]["to"].append({"podSelector": {}}), "admits pods other than the run's"),
])
def test_check_package_refuses_a_weakened_pod_or_policy(hybrid, weaken, problem):
    files = gpu_container.package(hybrid)
    documents = gpu_container.parse_yaml_documents(files["k8s/job.yaml"].decode())
    weaken(documents)
    files["k8s/job.yaml"] = "\n---\n".join(json.dumps(document) for document in documents).encode()
    with pytest.raises(ArtifactError, match=re.escape(problem)):
        gpu_container.check_package(files)


def test_the_job_pins_the_artifact_digest(hybrid):
    """The Job hands the ranks compiled.digest through the manifest kubectl applies (not the
    image), and check_package refuses a Job whose digest is not the context index's."""
    files = gpu_container.package(hybrid)
    documents = gpu_container.parse_yaml_documents(files["k8s/job.yaml"].decode())
    env = {entry["name"]: entry.get("value") for entry in _container(documents)["env"]}
    assert env["FLATPACK_DIGEST"] == hybrid.digest
    _container(documents)["env"] = [entry for entry in _container(documents)["env"]
                                    if entry["name"] != "FLATPACK_DIGEST"] + [{"name": "FLATPACK_DIGEST",
                                                                              "value": "0" * 64}]
    files["k8s/job.yaml"] = "\n---\n".join(json.dumps(document) for document in documents).encode()
    with pytest.raises(ArtifactError, match="is not the digest of stages/flatpack.index.json"):
        gpu_container.check_package(files)


@pytest.mark.parametrize(("path", "old", "new", "problem"), [
    ("Dockerfile", "USER 10001:10001", "USER 0", "final USER is '0'"),
    ("Dockerfile", " --require-hashes", "", "without --require-hashes"),
    ("Dockerfile", "@sha256:dad7", "@sha256:zz", "not pinned by digest"),
    ("requirements.txt", "    --hash=sha256:", "    # ", "has no --hash"),
])
def test_check_package_refuses_a_weakened_image(hybrid, path, old, new, problem):
    files = gpu_container.package(hybrid)
    files[path] = files[path].decode().replace(old, new, 1 if path == "Dockerfile" else -1).encode()
    with pytest.raises(ArtifactError, match=re.escape(problem)):
        gpu_container.check_package(files)


def test_the_gpu_image_refuses_a_tag_only_base(hybrid):
    with pytest.raises(InputError, match="is a tag, not a digest"):
        gpu_container.package(hybrid, base_image="python:3.11-slim-bookworm")


def test_nccl_with_more_ranks_than_gpus_is_refused(hybrid, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InputError, match=r"5 stage replicas \(degrees \[2, 1, 2\]\).*1 GPU"):
        gpu_container.deploy(hybrid, backend="nccl")


@pytest.mark.skipif(CUDA, reason="checks the message given where there is no GPU")
def test_nccl_without_cuda_is_refused(hybrid):
    with pytest.raises(InputError, match="needs a GPU"):
        gpu_container.deploy(hybrid, backend="nccl")


def stage_rank(compiled: flatpack.Compiled, run, stage: int, context, data_dir) -> StageRank:
    """Replica 0 of ``stage`` as its rank builds itself, without a process group (nothing is sent)."""
    gpu_container.write_context(gpu_container.stage_files(compiled), context)
    role = run.layout.role(run.layout.rank(stage, 0))
    no_groups = Channels(None, None, None, None, None)
    return StageRank(run, role, load_stage(stage_path(context, stage)), torch.device("cpu"), no_groups, data_dir)


def test_a_rank_reads_its_micro_batches_and_refuses_a_wrong_batch_file(hybrid, tmp_path):
    run = gpu_container.build_run(hybrid, iterations=1, batch=BATCH, backend="gloo")
    data = tmp_path / "data"
    data.mkdir()
    rank = stage_rank(hybrid, run, 0, tmp_path / "context", data)
    [((x, mask), target)] = batches(1)

    data_file(data, 0).write_bytes(pack_values({"x": x, "mask": mask, TARGET: target}))
    micro_batches = rank._data(0)
    assert sorted(micro_batches) == [0, 2]            # replica 0 of 2 owns micro-batches 0 and 2 of 4
    torch.testing.assert_close(micro_batches[2]["x"], x[6:9])
    assert TARGET not in micro_batches[2]             # only the last stage reads the target

    data_file(data, 0).write_bytes(pack_values({"x": torch.cat([x, x]), "mask": torch.cat([mask, mask])}))
    with pytest.raises(InputError, match=r"holds a batch of 24 samples, but the run's batch is 12; pass --batch 24"):
        rank._data(0)
    data_file(data, 0).write_bytes(pack_values({"x": x}))
    with pytest.raises(InputError, match=r"iter_000000.safetensors has no input 'mask', which stage 0 reads"):
        rank._data(0)
    with pytest.raises(InputError, match=r"--batch 3 is smaller than the run's 4 micro-batches"):
        with_overrides(run, iterations=None, batch=3)


def test_synthetic_inputs_are_drawn_per_input_so_every_stage_sees_the_same(hybrid, tmp_path):
    run = gpu_container.build_run(hybrid, iterations=1, batch=BATCH, backend="gloo", seed=3)
    rank = stage_rank(hybrid, run, 0, tmp_path, None)
    entry = next(entry for entry in rank.manifest.inputs if entry.name == "mask")
    # what a stage reading only the mask would draw: it does not depend on x being drawn too
    alone = synthetic_tensor(entry, BATCH // 4, run.example_batch, synthetic_generator(3, 2, "mask", rank.device))
    torch.testing.assert_close(rank.synthetic_batches[2]["mask"], alone)
    assert not torch.equal(rank.synthetic_batches[0]["mask"], rank.synthetic_batches[2]["mask"])


def test_prepare_checks_before_writing_and_leaves_nothing_when_it_fails(hybrid, tmp_path):
    with gpu_container.deploy(hybrid, backend="gloo", workdir=tmp_path / "work") as deployment:
        assert not (tmp_path / "work" / "Dockerfile").exists(), "a local deploy writes only what the ranks load"
        data = batches(2)
        with pytest.raises(InputError, match="loss"):
            deployment.prepare(data, loss="no-such-loss")
        (x, mask), target = data[1]
        data[1] = ((x[:6], mask[:6]), target[:6])
        with pytest.raises(InputError, match="batch 1 has 6 samples, batch 0 has 12"):
            deployment.prepare(data)
        assert not list((tmp_path / "work" / "runs").glob("*")), "a failed prepare removes its run directory"


@pytest.mark.slow
def test_gloo_pipeline_equals_single_process(hybrid):
    data = batches(3)
    with gpu_container.deploy(hybrid, backend="gloo") as deployment:
        for schedule, optimizer in (("sync", {"name": "sgd", "lr": 0.1, "momentum": 0.9}),
                                    ("1f1b", {"name": "adam", "lr": 0.01})):
            reference, losses = train_single_process(make_model(), data, 3, optimizer=optimizer)
            result = deployment.train(data, iterations=3, optimizer=optimizer, schedule=schedule)
            assert_matches_reference(result, reference, losses)
            assert {"forward", "backward", "upload", "download", "sync", "update"} <= {e.kind for e in result.events}
            assert result.degrees == [(2, 1, 2)] and result.samples == 3 * BATCH
            assert set(result.peak_bytes) == {"s0r0", "s0r1", "s1r0", "s2r0", "s2r1"}
        assert not list(deployment.workdir.glob("runs/*/data")), "train removes the batches it wrote"
        workdir = deployment.workdir
    assert not workdir.exists(), "teardown removes the work directory deploy created"


@pytest.mark.slow
def test_gloo_inference_equals_the_model_before_and_after_training(hybrid):
    """infer sends the forwards through the same ranks: the outputs equal the original
    model's on the compiled weights, and after a train the trained model's."""
    inputs = batches(1)[0][0]
    data = batches(2)
    optimizer = {"name": "sgd", "lr": 0.1}
    with gpu_container.deploy(hybrid, backend="gloo") as deployment:
        assert isinstance(deployment, Deployment)
        model = make_model().eval()
        torch.testing.assert_close(deployment.infer(inputs), model(*inputs), rtol=1e-5, atol=1e-6)
        deployment.train(data, iterations=2, optimizer=optimizer)
        reference, _ = train_single_process(make_model(), data, 2, optimizer=optimizer)
        trained = deployment.infer(inputs)
        assert not list(deployment.workdir.glob("runs/*/data")), "infer removes the request it wrote"
    torch.testing.assert_close(trained, reference.eval()(*inputs), rtol=1e-4, atol=1e-5)


def test_inference_runs_forwards_only_and_writes_the_model_outputs(hybrid):
    run = gpu_container.build_run(hybrid, iterations=1, batch=BATCH, backend="gloo", mode="infer")
    assert run.mode == "infer" and run.outputs == hybrid.info.output_names
    assert DistributedRun.loads(run.dumps()) == run, "run.json carries the mode and the outputs"
    assert gpu_container.build_run(hybrid, iterations=1, batch=BATCH, backend="gloo").outputs == ()


def test_the_run_modes_are_the_workload_modes():
    assert RUN_MODES == MODES


def test_an_inference_request_smaller_than_the_micro_batches_is_refused_before_any_rank_starts(hybrid, tmp_path):
    small = (torch.randn(2, 8), torch.ones(2, 8))
    with gpu_container.deploy(hybrid, backend="gloo", workdir=tmp_path / "work") as deployment:
        with pytest.raises(InputError, match="cannot be cut into 4 micro-batches"):
            deployment.infer(small)
        assert deployment.current is None, "nothing was launched"
    with pytest.raises(InputError, match="run mode 'serve' is not one of train, infer"):
        gpu_container.build_run(hybrid, iterations=1, batch=BATCH, backend="gloo", mode="serve")


@pytest.mark.slow
def test_failing_rank_is_reported_with_its_stage_and_log(tmp_path):
    compiled = compiled_with((1, 1), micro_batches=2)
    wrong_targets = [(inputs, torch.randn(BATCH)) for inputs, _ in batches(1)]   # cross_entropy wants classes
    with gpu_container.deploy(compiled, backend="gloo", workdir=tmp_path / "ctx") as deployment:
        with pytest.raises(RunFailure) as caught:
            deployment.train(wrong_targets, iterations=1, timeout_s=120)
    message = str(caught.value)
    assert "rank 1 (stage 1, replica 0) exited with code 1" in message
    assert "flatpack rank 1 (stage 1, replica 0) failed" in message   # the tail of the rank's own log
    assert (tmp_path / "ctx").exists(), "a work directory the caller gave is kept"


def _processes_in(directory: Path) -> list[int]:
    """Pids of the processes whose working directory is ``directory``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(directory):
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("fork_server", ["1", "0"])
def test_local_ranks_run_the_packaged_rank_program_and_leave_no_process_behind(fork_server, tmp_path, monkeypatch):
    """Ranks on this machine run the flatpack deploy wrote to the work directory, not the
    invoker's, whether forked from the deployment's fork server (which imported the packaged
    rank program there) or started as fresh interpreters (``FLATPACK_FORK_SERVER=0``); the
    trained weights are single-process training's either way, and teardown leaves no process
    (ranks or server) behind."""
    monkeypatch.setenv(forked.FORK_SERVER_ENV, fork_server)
    compiled = compiled_with((1, 1), micro_batches=2)
    data = batches(2)
    optimizer = {"name": "sgd", "lr": 0.1}
    workdir = (tmp_path / "ctx").resolve()
    with gpu_container.deploy(compiled, backend="gloo", workdir=workdir) as deployment:
        packaged = workdir / "flatpack" / "runtime" / "distributed.py"
        marked = ("_main = main\n\n\ndef main(argv=None):\n    print('the packaged rank program', flush=True)\n"
                  "    return _main(argv)\n\n\nif __name__ == \"__main__\":")
        packaged.write_text(packaged.read_text().replace('if __name__ == "__main__":', marked))
        result = deployment.train(data, iterations=2, optimizer=optimizer)
        launch = deployment.current
        assert launch is not None
        logs = [launch.log(rank).read_text() for rank in range(2)]
        kinds = {type(process) for process in launch.processes.values()}
    reference, losses = train_single_process(make_model(), data, 2, optimizer=optimizer)
    assert_matches_reference(result, reference, losses)
    assert all("the packaged rank program" in log for log in logs), logs
    forking = fork_server == "1" and forked.unavailable_reason() is None
    assert kinds == ({forked.ForkedProcess} if forking else {subprocess.Popen})
    deadline = time.monotonic() + 15
    while (left := _processes_in(workdir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], "a rank or the fork server outlived the deployment"


@pytest.mark.slow
def test_launch_script_runs_the_context_under_torchrun(tmp_path):
    """The container's entry point, run here: torchrun starts both ranks on synthetic batches."""
    compiled = compiled_with((1, 1), micro_batches=2)
    context = gpu_container.write_context(gpu_container.package(compiled, backend="gloo", iterations=2),
                                          tmp_path / "context")
    torchrun = shutil.which("torchrun") or None
    # the digest the ranks check their stages against, as the Kubernetes Job sets it (a rank
    # started without one refuses: tests/security/test_run_records.py)
    env = {**os.environ, "MASTER_PORT": str(gpu_container._free_port()), "FLATPACK_OUT": str(tmp_path / "out"),
           "OMP_NUM_THREADS": "1", "FLATPACK_DIGEST": compiled.digest}
    if torchrun is None:   # the entry point of this interpreter's torch, where no script is on PATH
        env["PATH"] = f"{tmp_path}:{env.get('PATH', '')}"
        shim = tmp_path / "torchrun"
        shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m torch.distributed.run \"$@\"\n")
        shim.chmod(0o755)
    done = subprocess.run(["sh", str(context / "launch.sh"), "--warmup", "0"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    reports = list(iter_reports(tmp_path / "out"))
    assert [(report["stage"], len(report["iteration_seconds"])) for report in reports] == [(0, 2), (1, 2)]
    assert len(reports[1]["losses"]) == 2 and all(report["samples_per_s"] > 0 for report in reports)
    assert (tmp_path / "out" / "stage_000.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="NCCL needs CUDA; this machine has no GPU")
def test_nccl_pipeline_matches_cpu_reference():
    """One GPU per rank: as many ranks as there are GPUs (a 1-stage plan on a single GPU),
    compared with the CPU reference at a looser tolerance (GPU kernels sum in other orders)."""
    gpus = torch.cuda.device_count()
    replicas = (1, 1) if gpus >= 2 else (1,)
    compiled = compiled_with(replicas, micro_batches=2)
    data = batches(3)
    optimizer = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    reference, losses = train_single_process(make_model(), data, 3, optimizer=optimizer)
    with gpu_container.deploy(compiled, backend="nccl") as deployment:
        result = deployment.train(data, iterations=3, optimizer=optimizer)
    assert_matches_reference(result, reference, losses, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gloo_ranks_sharing_a_gpu_match_cpu_reference(hybrid):
    """With fewer GPUs than ranks, gloo ranks compute on the shared GPU and move tensors
    through the host: the 5-rank plan on one GPU still trains exactly."""
    data = batches(3)
    optimizer = {"name": "adam", "lr": 0.01}
    reference, losses = train_single_process(make_model(), data, 3, optimizer=optimizer)
    with gpu_container.deploy(hybrid, backend="gloo", device="cuda") as deployment:
        result = deployment.train(data, iterations=3, optimizer=optimizer, schedule="1f1b")
    assert_matches_reference(result, reference, losses, rtol=1e-3, atol=1e-4)
