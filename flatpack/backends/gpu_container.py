"""The ``gpu-container`` backend: Hydrozoa's setting. Every stage replica is a container
with a GPU (one ``torch.distributed`` rank), the containers talk to each other directly —
point-to-point sends of activations and gradients, ring all-reduce of gradients among a
stage's replicas — and the plan's A stages × B replicas become ``sum(degrees)`` ranks
(``flatpack.runtime.distributed`` is the rank program).

``package(compiled)`` is a build context: a Dockerfile, the flatpack source, the stage
artifacts, ``run.json``, a ``torchrun`` launcher and Kubernetes manifests (an Indexed Job
and a headless Service for the rendezvous); ``check_package`` validates one statically.
``deploy`` writes what the ranks load (the flatpack source and the stage artifacts) to a
work directory, and the deployment's ``train`` runs there on this machine — one process
per rank on 127.0.0.1, gloo on the CPU or NCCL on GPUs — returning the same
:class:`~flatpack.backends.functions.TrainResult` as the ``local`` backend.

Hardening (issue 17): the base is pinned by digest (``catalog.BASE_IMAGES``), pip installs the
committed hash lock (``flatpack/backends/locks/gpu.txt``) with ``--require-hashes``, the image
runs as an unprivileged user over root-owned files, and the Job's pods run non-root with a
read-only root filesystem (``/tmp`` and ``out/`` are emptyDirs), no privilege escalation, every
capability dropped, no service-account token, CPU, memory and GPU limits, and a NetworkPolicy
that admits only the run's own pods (and DNS). :func:`check_package` checks all of it.

Base image: ``python:3.11-slim-bookworm`` with ``torch==2.13.0`` from PyPI. The PyPI
wheel of torch for Linux x86-64 is the CUDA build (the CUDA runtime, cuDNN and NCCL come as
``nvidia-*`` wheels), so the node needs only the NVIDIA driver and container toolkit; the
torch in the image is then exactly the one flatpack compiles with, which a
``pytorch/pytorch:*-runtime`` tag would not pin (and no tag of that image could be checked
from here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Unpack

import torch
import yaml
from safetensors.torch import load_file

from flatpack.version import __version__
from flatpack.runtime import forked
from flatpack.backends.batch_checks import batch_values
from flatpack.backends.functions import iteration_count, loss_output, resolve_settings, workload_of
from flatpack.backends.results import TrainResult
from flatpack.backends.images import (PIP_INSTALL, TORCH_REQUIREMENT, base_comment, check_lock, copy_problems,
                                      hardening_problems, runtime_sources, write_files)
from flatpack.backends.lock import committed_lock, lock_problems
from flatpack.backends.protocol import Capability
from flatpack.compiler import Compiled
from flatpack.errors import ArtifactError, InputError, RunFailure
from flatpack.ir import structure
from flatpack.platform.catalog import BaseImage, Tier, base_image as pinned_base_image, get_platform
from flatpack.runtime import timeline
from flatpack.runtime.distributed import (DATA_DIR, DIGEST_ENV, INFER, RUN_FILE, STAGES_DIR, TRAIN, DistributedRun,
                                          Layout, RankRole, data_file, error_file, iter_reports, output_key,
                                          outputs_file, parameters_file, stage_path, timeline_file)
from flatpack.runtime.forkjoin import join_batch
from flatpack.runtime.forkserver import RANK_MODULE
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.settings import (RunControls, TrainOptions, TrainSettings, refuse_unhonoured,
                                       resolve_options)
from flatpack.runtime.spec import RunSpec, micro_batch_size, shared_holders, stage_specs
from flatpack.runtime.training import TARGET
from flatpack import schedules
from flatpack.schedules import Setup
from flatpack.stage.artifact import MANIFEST_FILE, SOURCE_FILE, WEIGHTS_FILE, parse_stage
from flatpack.stage.integrity import INDEX_FILE, Index, check_digest, sha256_hex, verify_files
from flatpack.stage.wire import pack_values, unpack_values
from flatpack.table import plural

NAME = "gpu-container"
CAPABILITIES = frozenset(Capability) - {Capability.RESUME}
LIMITS = {
    Capability.RESUME: "its ranks keep no checkpoints between calls (a failed train() is run again from the start)",
}
# what the image installs: lock.LOCKS['gpu'] (PyPI's torch, the CUDA build, and the rank program's numpy and
# safetensors), committed as flatpack/backends/locks/gpu.txt
APP_DIR = "/app"
MASTER_PORT = 29500
# what torchrun starts: the rank program on every rank, and the collective probe that measures
# the cluster's link and all-reduce (flatpack calibrate --target gpu-container); the image ships
# what they import
RANK_ENTRIES = (RANK_MODULE, "flatpack.runtime.collective_probe")
GPU_RESOURCE = "nvidia.com/gpu"
JOB_FILE = "k8s/job.yaml"
LAUNCH_FILE = "launch.sh"
COMMANDS_FILE = "commands.sh"
POLICY_KIND = "NetworkPolicy"
RUN_UID = 10001          # the image's USER and the pods' runAsUser (catalog.BASE_IMAGES' user)
POLL_S = 0.05
FAILURE_GRACE_S = 3.0   # how long the peers of a failed rank get to fail too, before the first is named
LOG_TAIL_LINES = 40
SCHEMA_NOTE = "YAML documents (yaml.safe_dump) separated by '---'; kubectl apply -f reads them as they are"


# -- the run ---------------------------------------------------------------------------------

def _tier(memory_mb: int | None) -> Tier | None:
    """The gpu-container configuration of a stage; None when the plan names none (or one of
    another platform's sizes: the plan was solved for another target)."""
    if not memory_mb:
        return None
    try:
        return get_platform(NAME).tier(memory_mb)
    except InputError:
        return None


def example_batch(compiled: Compiled) -> int | None:
    """Rows of the first data input at compile time: what ``--synthetic`` scales from."""
    names = set(compiled.info.input_names)
    for artifact in compiled.artifacts:
        for entry in artifact.manifest.inputs:
            if entry.name in names and entry.is_tensor and entry.shape:
                return entry.shape[0]
    return None


# what a gpu-container run acts on; every other setting or control is refused, not ignored
HONOURED_SETTINGS = ("optimizer", "loss", "micro_batches", "schedule", "threads", "precision", "loss_scaling")
HONOURED_CONTROLS = ("iterations", "timeout_s", "wait_timeout_s")
NOT_HONOURED = ("its ranks keep no checkpoints, run no faults and all-reduce their gradients "
                "in one process group for the whole job")


def build_run(compiled: Compiled, settings: TrainSettings | None = None, controls: RunControls | None = None, *,
              batch: int, backend: str = "nccl", device: str | None = None, seed: int = 0, run: str | None = None,
              mode: str = TRAIN, **options: Unpack[TrainOptions]) -> DistributedRun:
    """The ``run.json`` document of a run of ``compiled`` with ``settings`` and ``controls``
    (or their fields as keywords): ``iterations`` global batches of ``batch`` samples;
    ``wait_timeout_s`` bounds each wait on a peer. A setting
    or control the ranks do not act on is refused. The loss and ``precision`` are checked by
    ``RunSpec``; a stage the plan lets recompute its activations recomputes them on its ranks
    (``training.stage_backward``). ``mode`` "infer": forward passes only, the model's outputs
    written back."""
    settings, controls = resolve_options(settings, controls, options, what="a gpu-container run")
    refuse_unhonoured(settings, controls, HONOURED_SETTINGS + HONOURED_CONTROLS, what="a gpu-container run",
                      why=NOT_HONOURED)
    if controls.iterations is None:
        raise InputError("a gpu-container run needs iterations=: the ranks are started for a fixed number")
    training = mode == TRAIN
    schedules.get(settings.schedule).check(Setup(ranks=True))
    settings = resolve_settings(compiled, settings)
    micro_batches = settings.micro_batch_count
    if batch < micro_batches:
        raise InputError(f"a batch of {plural(batch, 'sample')} cannot be cut into "
                         f"{plural(micro_batches, 'micro-batch', 'micro-batches')}; use a "
                         "larger batch or fewer micro-batches")
    manifests = [artifact.manifest for artifact in compiled.artifacts]
    # no tiers: the containers' own resources bound them, nothing is emulated (``_tier`` prices the run)
    stages = stage_specs(manifests, compiled.info.input_names, [stage.replicas for stage in compiled.plan.stages],
                         [stage.memory_mb for stage in compiled.plan.stages], None,
                         [stage.recompute for stage in compiled.plan.stages])
    output_names = compiled.info.output_names
    # an inference computes no loss: any stage may produce the first output
    read_by_loss = loss_output(compiled) if training else output_names[0]
    spec = RunSpec.of(settings, controls, run=run or f"run-{uuid.uuid4().hex[:10]}", stages=stages,
                      shared=shared_holders(manifests), batch=batch, loss_output=read_by_loss)
    return DistributedRun(spec=spec, iterations=controls.iterations, backend=backend,
                          device=device or ("cuda" if backend == "nccl" else "cpu"),
                          example_batch=example_batch(compiled), seed=seed, mode=mode,
                          outputs=() if training else output_names)


# -- the build context -----------------------------------------------------------------------

def torchrun_command(*, nnodes: int | str, nproc_per_node: int | str, node_rank: int | str, master_addr: str,
                     master_port: int | str, data: str | None, out: str, context: str = APP_DIR,
                     data_option: bool = True) -> list[str]:
    """The command every node runs: torchrun's static rendezvous (rank = node rank × nproc +
    local rank, so ranks follow the Layout) around the rank program. ``data``: the batches'
    directory (None: synthetic batches); ``data_option=False`` leaves both options off, for a
    launcher that chooses at run time."""
    command = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", f"--node-rank={node_rank}",
               f"--master-addr={master_addr}", f"--master-port={master_port}",
               "-m", "flatpack.runtime.distributed", "--context", context, "--out", out]
    if not data_option:
        return command
    return command + (["--data", data] if data else ["--synthetic"])


def stage_files(compiled: Compiled) -> dict[str, bytes]:
    """The whole artifact and its index below ``stages/``, by path relative to the context:
    each stage where the rank program loads it (``distributed.stage_path``), verified against
    ``stages/flatpack.index.json`` and the digest the rank is started with."""
    files = {f"{STAGES_DIR}/{name}": content for name, content in compiled.files().items()}
    files[f"{STAGES_DIR}/{INDEX_FILE}"] = compiled.index.raw
    return files


def _stage_dir(index: int) -> str:
    return stage_path(".", index).as_posix()


def package(compiled: Compiled, *, backend: str = "nccl", iterations: int = 100, batch: int | None = None,
            micro_batches: int | None = None, optimizer: OptimizerSpec | str | dict = "sgd",
            loss: str = "cross_entropy", schedule: str = "sync", gpus_per_pod: int = 1, name: str = "flatpack-train",
            image: str | None = None, data: str | None = None, timeout_s: float = 1800.0,
            base_image: str | None = None, lock: str | None = None, precision: str = "fp32") -> dict[str, bytes]:
    """The build context, by relative path: ``Dockerfile``, ``requirements.txt``, the
    ``flatpack/`` source, ``stages/stage_NNN/``, ``run.json``, ``launch.sh`` and
    ``k8s/job.yaml``.

    ``batch``: the global batch of a synthetic run (default: the workload's, else the
    compile-time batch). ``gpus_per_pod``: ranks (GPUs) per pod; it must divide the world
    size. ``data``: a directory in the container holding ``iter_NNNNNN.safetensors``
    batches (mount it); without it the Job trains on synthetic batches (a throughput run).
    ``base_image``: ``name:tag@sha256:<digest>`` instead of the catalog's; ``lock``: a hash-locked
    requirements text instead of the committed ``gpu`` lock (an unhashed pin is refused).
    ``precision``: "fp32", "bf16" (autocast, float32 master weights, bfloat16 between stages)
    or "fp16" (float16, with GradScaler's default loss scaling).
    """
    _check_name(name)
    pinned = pinned_base_image(NAME, base_image)
    lock_text = committed_lock("gpu") if lock is None else lock
    check_lock(lock_text)
    layout = Layout(tuple(stage.replicas for stage in compiled.plan.stages))
    world = layout.world_size
    if gpus_per_pod < 1 or world % gpus_per_pod:
        raise InputError(f"gpus_per_pod={gpus_per_pod} does not divide the world of {world} ranks (degrees "
                         f"{list(layout.degrees)}); use a divisor of {world}")
    workload = workload_of(compiled)
    batch = batch or (workload.batch if workload else None) or example_batch(compiled)
    if batch is None:
        raise InputError("the model has no batched tensor input to size a synthetic batch by; pass batch=")
    settings = TrainSettings(optimizer=OptimizerSpec.of(optimizer), loss=loss, micro_batches=micro_batches,
                             schedule=schedule, precision=precision)
    run = build_run(compiled, settings, RunControls(iterations=iterations, wait_timeout_s=timeout_s), batch=batch,
                    backend=backend, run=name)
    pods = world // gpus_per_pod
    image = image or f"{name}:latest"
    files: dict[str, bytes] = {
        "Dockerfile": _dockerfile(pinned).encode(),
        "requirements.txt": lock_text.encode(),
        RUN_FILE: run.dumps(),
        LAUNCH_FILE: _launch_script(world, data).encode(),
        JOB_FILE: _job_yaml(compiled, name=name, image=image, pods=pods, nproc=gpus_per_pod, backend=backend,
                            data=data).encode(),
    }
    files.update(stage_files(compiled))
    files.update(runtime_sources(RANK_ENTRIES))
    files[COMMANDS_FILE] = _commands(name, image, world, pods).encode()
    return files


def _commands(name: str, image: str, world: int, pods: int) -> str:
    """What a user runs to start the Job (flatpack calls no cluster API itself)."""
    return f"""\
#!/usr/bin/env bash
# generated by flatpack {__version__}: {name}, {world} ranks in {pods} pod(s) on a Kubernetes cluster with GPUs
set -euo pipefail
cd "$(dirname "$0")"
docker build --platform linux/amd64 -t {image} .
docker push {image}
kubectl apply -f {JOB_FILE}
kubectl wait --for=condition=complete --timeout=24h job/{name}
kubectl logs -l job-name={name} --prefix --tail=20
# to remove the Job and its Service: kubectl delete -f {JOB_FILE}
# every rank on this one machine instead: ./{LAUNCH_FILE}
"""


def write_context(files: Mapping[str, bytes], directory: str | os.PathLike) -> Path:
    """Writes a build context from :func:`package` into ``directory`` (``launch.sh`` executable)."""
    directory = write_files(files, directory)
    if LAUNCH_FILE in files:
        (directory / LAUNCH_FILE).chmod(0o755)
    return directory


def _check_name(name: str) -> None:
    # a Job's pods are named NAME-INDEX and the Service NAME: both must be DNS labels
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?", name):
        raise InputError(f"{name!r} cannot name a Kubernetes Job and Service: use lowercase letters, digits and "
                         "'-', starting with a letter, at most 42 characters")


def _dockerfile(base: BaseImage) -> str:
    comments = "\n".join(base_comment(base))
    return f"""\
# Generated by flatpack {__version__}: one image for every rank of a gpu-container run.
# Base: {base.name} with {TORCH_REQUIREMENT} from PyPI, whose Linux x86-64 wheel is the CUDA build
# (CUDA runtime, cuDNN and NCCL arrive as nvidia-* wheels); the node supplies only the NVIDIA driver.
# requirements.txt is a hash lock: pip installs exactly those files or nothing.
{comments}
FROM {base.reference}
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH={APP_DIR} HOME=/tmp
WORKDIR {APP_DIR}
COPY requirements.txt {APP_DIR}/requirements.txt
RUN {PIP_INSTALL} -r {APP_DIR}/requirements.txt
COPY flatpack {APP_DIR}/flatpack
COPY {STAGES_DIR} {APP_DIR}/{STAGES_DIR}
COPY {RUN_FILE} {LAUNCH_FILE} {APP_DIR}/
# root owns the files (COPY without --chown); the ranks read them and write only to the mounted out/ and /tmp
RUN chmod -R go-w {APP_DIR} && chmod 0755 {APP_DIR}/{LAUNCH_FILE}
USER {base.user}
ENTRYPOINT ["{APP_DIR}/{LAUNCH_FILE}"]
"""


def _launch_script(world: int, data: str | None) -> str:
    # the data option is chosen at run time (FLATPACK_DATA), so it is left off here
    command = torchrun_command(nnodes='"$NNODES"', nproc_per_node='"$NPROC_PER_NODE"', node_rank='"$NODE_RANK"',
                               master_addr='"$MASTER_ADDR"', master_port='"$MASTER_PORT"', data=None,
                               out='"$OUT"', context=".", data_option=False)
    return f"""\
#!/bin/sh
# Generated by flatpack {__version__}: starts this node's ranks of the run ({world} in all).
# NNODES, NPROC_PER_NODE, NODE_RANK (else JOB_COMPLETION_INDEX), MASTER_ADDR and MASTER_PORT come
# from the environment (the Kubernetes Job sets them); alone, every rank starts on this machine.
# FLATPACK_DATA: a directory of iter_NNNNNN.safetensors batches; unset, batches are synthetic.
# Extra arguments go to the rank program (--iterations N, --batch B, --warmup K).
set -eu
cd "$(dirname "$0")"
export PYTHONPATH="$PWD${{PYTHONPATH:+:$PYTHONPATH}}"
NNODES="${{NNODES:-1}}"
NPROC_PER_NODE="${{NPROC_PER_NODE:-{world}}}"
NODE_RANK="${{NODE_RANK:-${{JOB_COMPLETION_INDEX:-0}}}}"
MASTER_ADDR="${{MASTER_ADDR:-127.0.0.1}}"
MASTER_PORT="${{MASTER_PORT:-{MASTER_PORT}}}"
OUT="${{FLATPACK_OUT:-out}}"
DATA="${{FLATPACK_DATA:-{data or ''}}}"
if [ "$((NNODES * NPROC_PER_NODE))" -ne {world} ]; then
  echo "launch.sh: NNODES x NPROC_PER_NODE = $((NNODES * NPROC_PER_NODE)), but the plan has {world} stage replicas" >&2
  exit 2
fi
if [ -n "$DATA" ]; then set -- --data "$DATA" "$@"; else set -- --synthetic "$@"; fi
exec {" ".join(command)} "$@"
"""


def _pod_tier(compiled: Compiled) -> Tier | None:
    """One pod template serves every stage, so it asks for the largest stage tier."""
    tiers = [tier for tier in (_tier(stage.memory_mb) for stage in compiled.plan.stages) if tier is not None]
    return max(tiers, key=lambda tier: (tier.memory_mb, tier.vcpus)) if tiers else None


def _job_yaml(compiled: Compiled, *, name: str, image: str, pods: int, nproc: int, backend: str,
              data: str | None) -> str:
    labels = {"app.kubernetes.io/name": "flatpack", "flatpack.io/run": name}
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        # headless: each pod of the Job gets a DNS name NAME-INDEX.NAME; rank 0's is the rendezvous
        "spec": {"clusterIP": "None", "selector": labels, "publishNotReadyAddresses": True,
                 "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT}]},
    }
    tier = _pod_tier(compiled)
    if tier is None:
        # the plan names no gpu-container tier: bound the pod by the catalog's smallest, so that a
        # runaway rank cannot take a node (the annotation below says the limit was not planned)
        tier = min(get_platform(NAME).tiers, key=lambda t: (t.memory_mb, t.vcpus))
        planned = False
    else:
        planned = True
    limits: dict[str, Any] = {"cpu": f"{tier.vcpus * nproc:g}", "memory": f"{tier.memory_mb * nproc}Mi"}
    if backend == "nccl":
        limits[GPU_RESOURCE] = nproc
    env = [
        {"name": "NNODES", "value": str(pods)},
        {"name": "NPROC_PER_NODE", "value": str(nproc)},
        {"name": "NODE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        # the artifact's digest reaches the ranks through the manifest kubectl applies, not
        # through the image: a stage changed in the registry fails the rank's check
        {"name": DIGEST_ENV, "value": compiled.digest},
    ]
    command = torchrun_command(nnodes="$(NNODES)", nproc_per_node="$(NPROC_PER_NODE)", node_rank="$(NODE_RANK)",
                               master_addr="$(MASTER_ADDR)", master_port="$(MASTER_PORT)", data=data,
                               out=f"{APP_DIR}/out")
    annotations = {"flatpack.io/degrees": json.dumps([stage.replicas for stage in compiled.plan.stages]),
                   "flatpack.io/backend": backend}
    if planned and tier.gpu_model:
        annotations["flatpack.io/gpu-model"] = tier.gpu_model
    if not planned:
        annotations["flatpack.io/limits"] = "the catalog's smallest gpu-container tier (the plan names none)"
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            "completionMode": "Indexed", "completions": pods, "parallelism": pods,
            # one lost rank stalls all of them: fail the Job rather than restart a lone pod
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "subdomain": name, "restartPolicy": "Never",
                    # a rank never calls the Kubernetes API: no token for a compromised one to use
                    "automountServiceAccountToken": False, "enableServiceLinks": False,
                    "securityContext": POD_SECURITY,
                    "containers": [{
                        "name": "rank", "image": image, "command": command, "env": env,
                        "ports": [{"containerPort": MASTER_PORT, "name": "rendezvous"}],
                        "resources": {"limits": limits, "requests": dict(limits)},
                        "securityContext": CONTAINER_SECURITY,
                        # NCCL moves intra-pod traffic through shared memory (the default 64 MB is too
                        # small); the root filesystem is read-only, so /tmp and out/ are volumes
                        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                                         {"name": "tmp", "mountPath": "/tmp"},
                                         {"name": "out", "mountPath": f"{APP_DIR}/out"}],
                    }],
                    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                                {"name": "tmp", "emptyDir": {}}, {"name": "out", "emptyDir": {}}],
                },
            },
        },
    }
    documents = yaml.safe_dump_all([service, job, network_policy(name, labels)], sort_keys=False,
                                   explicit_start=True)
    return f"# Generated by flatpack {__version__}. {SCHEMA_NOTE}.\n# {POLICY_NOTE}\n" + documents


POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_UID, "runAsGroup": RUN_UID, "fsGroup": RUN_UID,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "privileged": False, "capabilities": {"drop": ["ALL"]}}
POLICY_NOTE = ("The NetworkPolicy admits only the run's own pods: gloo's and NCCL's world-wide groups (the "
               "control channel, the final barrier) connect every pair of ranks, so a pod cannot be limited to "
               "its neighbouring stages without breaking them")
DNS_PORTS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]


def network_policy(name: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """Ingress only from the run's pods; egress only to them and to DNS (the rendezvous address
    is a DNS name). A gpu-container run has no store: batches come from a mounted directory."""
    peers = [{"podSelector": {"matchLabels": dict(labels)}}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": POLICY_KIND,
            "metadata": {"name": f"{name}-peers", "labels": dict(labels)},
            "spec": {"podSelector": {"matchLabels": dict(labels)}, "policyTypes": ["Ingress", "Egress"],
                     "ingress": [{"from": peers}],
                     "egress": [{"to": peers},
                                {"to": [{"namespaceSelector": {}}], "ports": DNS_PORTS}]}}


# -- static check ----------------------------------------------------------------------------

def parse_yaml_documents(text: str) -> list[dict[str, Any]]:
    """The documents of a ``job.yaml`` written by :func:`package` (empty documents skipped)."""
    try:
        return [document for document in yaml.safe_load_all(text) if document is not None]
    except yaml.YAMLError as err:
        raise ArtifactError(f"{JOB_FILE} is not valid YAML: {err}") from None


def check_package(files: Mapping[str, bytes]) -> None:
    """Validates a build context from :func:`package`: everything the Dockerfile COPYs is
    there, every stage verifies against ``stages/flatpack.index.json``, ``run.json`` and the
    manifests parse, the world size is the sum of the degrees, and the pods × ranks per pod and GPU limits agree. Raises
    ArtifactError listing every problem."""
    problems = copy_problems(files)
    dockerfile = [line.strip() for line in files.get("Dockerfile", b"").decode().splitlines()
                  if line.strip() and not line.lstrip().startswith("#")]
    problems += hardening_problems(dockerfile)
    problems += [f"requirements.txt: {problem}"
                 for problem in lock_problems(files.get("requirements.txt", b"").decode())]
    try:
        run = DistributedRun.loads(files[RUN_FILE])
    except (KeyError, ValueError, InputError) as err:
        raise ArtifactError(f"the context's {RUN_FILE} is missing or unreadable: {err}") from None
    layout = run.layout
    index: Index | None = None
    try:
        index = Index.parse(files[f"{STAGES_DIR}/{INDEX_FILE}"], f"{STAGES_DIR}/{INDEX_FILE}")
    except KeyError:
        problems.append(f"the context lacks {STAGES_DIR}/{INDEX_FILE}, which the ranks verify their stages against")
    except ArtifactError as err:
        problems.append(str(err))
    for stage in range(len(layout.degrees)):
        where = _stage_dir(stage)
        contents = {name: files[f"{where}/{name}"] for name in (MANIFEST_FILE, SOURCE_FILE, WEIGHTS_FILE)
                    if f"{where}/{name}" in files}
        try:
            if index is not None:
                verify_files(index, {f"{where.split('/', 1)[1]}/{name}": data for name, data in contents.items()},
                             STAGES_DIR)
            parse_stage(contents, where)
        except ArtifactError as err:
            problems.append(str(err))
    if not any(path == "flatpack/runtime/distributed.py" for path in files):
        problems.append("the flatpack source lacks flatpack/runtime/distributed.py, the rank program")
    launch = files.get(LAUNCH_FILE, b"").decode()
    if "torchrun" not in launch or "flatpack.runtime.distributed" not in launch:
        problems.append(f"{LAUNCH_FILE} does not start flatpack.runtime.distributed under torchrun")
    if f"-ne {layout.world_size} ]" not in launch:
        problems.append(f"{LAUNCH_FILE} does not check for the world size {layout.world_size}")
    problems += _check_job(files, run)
    if problems:
        raise ArtifactError("the gpu-container context is inconsistent:\n  " + "\n  ".join(problems))


def _check_job(files: Mapping[str, bytes], run: DistributedRun) -> list[str]:
    try:
        documents = parse_yaml_documents(files[JOB_FILE].decode())
    except (KeyError, ValueError, ArtifactError) as err:
        return [f"{JOB_FILE} is missing or does not parse: {err}"]
    by_kind = {document.get("kind"): document for document in documents}
    if set(by_kind) != {"Service", "Job", POLICY_KIND}:
        return [f"{JOB_FILE} should hold a Service, a Job and a {POLICY_KIND}, it holds {sorted(map(str, by_kind))}"]
    service, job = by_kind["Service"], by_kind["Job"]
    problems = _check_pod_security(job) + _check_network_policy(by_kind[POLICY_KIND], job)
    spec = job["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    env = {entry["name"]: entry.get("value") for entry in container.get("env", [])}
    name = job["metadata"]["name"]
    if spec.get("completionMode") != "Indexed" or spec.get("completions") != spec.get("parallelism"):
        problems.append("the Job must be Indexed with completions = parallelism (every rank at once)")
    pods, nproc = int(spec.get("completions", 0)), int(env.get("NPROC_PER_NODE") or 0)
    if pods * nproc != run.layout.world_size:
        problems.append(f"{pods} pods x {nproc} ranks per pod = {pods * nproc}, but the plan has "
                        f"{run.layout.world_size} stage replicas (degrees {list(run.layout.degrees)})")
    if env.get("NNODES") != str(pods):
        problems.append(f"NNODES is {env.get('NNODES')} but the Job runs {pods} pods")
    gpus = container.get("resources", {}).get("limits", {}).get(GPU_RESOURCE)
    if run.backend == "nccl" and gpus != nproc:
        problems.append(f"each pod runs {nproc} NCCL ranks, one GPU each, but asks for {gpus} {GPU_RESOURCE}")
    if service["spec"].get("clusterIP") != "None" or pod.get("subdomain") != service["metadata"]["name"]:
        problems.append("the Service must be headless and the pods' subdomain, so that pods have DNS names")
    if service["spec"].get("selector", {}).items() - spec["template"]["metadata"].get("labels", {}).items():
        problems.append("the Service's selector does not select the Job's pods")
    index_bytes = files.get(f"{STAGES_DIR}/{INDEX_FILE}")
    if index_bytes is not None and env.get(DIGEST_ENV) != sha256_hex(index_bytes):
        problems.append(f"the Job's {DIGEST_ENV} ({env.get(DIGEST_ENV)!r}) is not the digest of "
                        f"{STAGES_DIR}/{INDEX_FILE}: the ranks would refuse their stages, or check them against "
                        "nothing")
    if env.get("MASTER_ADDR") != f"{name}-0.{service['metadata']['name']}":
        problems.append(f"MASTER_ADDR {env.get('MASTER_ADDR')!r} is not the index-0 pod's DNS name")
    command = container.get("command", [])
    if not command or command[0] != "torchrun" or "flatpack.runtime.distributed" not in command:
        problems.append("the container does not run flatpack.runtime.distributed under torchrun")
    return problems


def _check_pod_security(job: Mapping[str, Any]) -> list[str]:
    """The pod runs non-root, read-only, unprivileged, without capabilities or an API token, and bounded."""
    problems = []
    pod = job["spec"]["template"]["spec"]
    security = pod.get("securityContext", {})
    if security.get("runAsNonRoot") is not True or security.get("runAsUser") in (None, 0):
        problems.append("the pod's securityContext must set runAsNonRoot: true and a non-zero runAsUser")
    if pod.get("automountServiceAccountToken") is not False:
        problems.append("the pod must set automountServiceAccountToken: false (ranks never call the API server)")
    mounts_by_pod = {volume["name"] for volume in pod.get("volumes", []) if "emptyDir" in volume}
    for container in pod.get("containers", []):
        where = f"container {container.get('name')!r}"
        context = container.get("securityContext", {})
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation must be false")
        if context.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: readOnlyRootFilesystem must be true")
        if context.get("privileged"):
            problems.append(f"{where}: must not be privileged")
        if "ALL" not in context.get("capabilities", {}).get("drop", []) or context.get("capabilities", {}).get("add"):
            problems.append(f"{where}: capabilities must drop ALL and add none")
        limits = container.get("resources", {}).get("limits", {})
        missing = [key for key in ("cpu", "memory") if key not in limits]
        if missing:
            problems.append(f"{where}: no resource limit for {', '.join(missing)}")
        writable = {mount["mountPath"] for mount in container.get("volumeMounts", []) if mount["name"] in mounts_by_pod}
        if "/tmp" not in writable:
            problems.append(f"{where}: /tmp must be an emptyDir (the root filesystem is read-only)")
    return problems


def _check_network_policy(policy: Mapping[str, Any], job: Mapping[str, Any]) -> list[str]:
    """The policy selects the run's pods, governs both directions, and lets in and out only
    the run's pods (and DNS out): no empty peer, no address block, no namespace-wide ingress."""
    problems = []
    spec = policy.get("spec", {})
    labels = job["spec"]["template"]["metadata"].get("labels", {})
    selected = spec.get("podSelector", {}).get("matchLabels", {})
    if not selected or selected.items() - labels.items():
        problems.append(f"the {POLICY_KIND} does not select the Job's pods")
    if sorted(spec.get("policyTypes", [])) != ["Egress", "Ingress"]:
        problems.append(f"the {POLICY_KIND} must govern both Ingress and Egress")
    for direction, key in (("ingress", "from"), ("egress", "to")):
        for rule in spec.get(direction, []):
            peers = rule.get(key)
            if not peers:
                problems.append(f"the {POLICY_KIND} has an {direction} rule open to everything")
                continue
            for peer in peers:
                if "ipBlock" in peer:
                    problems.append(f"the {POLICY_KIND}'s {direction} names an address block: {peer['ipBlock']}")
                elif "namespaceSelector" in peer:
                    dns = direction == "egress" and rule.get("ports") and all(
                        port.get("port") == 53 for port in rule["ports"])
                    if not dns:
                        problems.append(f"the {POLICY_KIND}'s {direction} opens whole namespaces beyond DNS")
                elif peer.get("podSelector", {}).get("matchLabels", {}) != selected:
                    problems.append(f"the {POLICY_KIND}'s {direction} admits pods other than the run's")
    return problems


# -- running here ----------------------------------------------------------------------------

@dataclass
class RunLaunch:
    """One prepared run: its directory (run.json, out/, logs), its batches' directory (None
    for synthetic batches) and rendezvous."""

    run: DistributedRun
    directory: Path
    master_port: int
    data: Path | None
    warmup: int
    threads: int
    processes: dict[int, subprocess.Popen | forked.ForkedProcess] = field(default_factory=dict)
    parameters: Path | None = None   # a finished run's out/: the weights the ranks start from

    @property
    def out(self) -> Path:
        return self.directory / "out"

    def log(self, rank: int) -> Path:
        return self.directory / f"rank_{rank:05d}.log"


def deploy(compiled: Compiled, *, backend: str | None = None, device: str | None = None,
           workdir: str | os.PathLike | None = None, python: str | None = None,
           digest: str | None = None) -> GpuContainerDeployment:
    """Writes what the ranks load — the flatpack source and the stage artifacts, not the
    cluster's build context (:func:`package`) — to ``workdir`` (a fresh temporary directory
    when None, removed by ``teardown``) for runs on this machine. ``backend``: "gloo",
    "nccl", or None for NCCL when CUDA is available. ``device``: where ranks compute ("cuda" for NCCL; gloo
    may use "cuda" too, ranks sharing the GPUs and transfers staged through the host).
    ``digest``: refuse unless ``compiled.digest`` is this; the ranks are started with
    ``FLATPACK_DIGEST`` = ``compiled.digest`` and check their stage against it."""
    if digest is not None:   # before anything is written: this must be the artifact that was compiled
        check_digest(compiled.index.raw, digest, "the artifact to deploy")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = device or ("cuda" if backend == "nccl" else "cpu")
    degrees = [stage.replicas for stage in compiled.plan.stages]
    world = sum(degrees)
    if backend not in ("gloo", "nccl"):
        raise InputError(f"backend {backend!r} is not one of gloo, nccl")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(f"backend {backend} on device cuda needs a GPU, and torch sees none here "
                         f"(torch {torch.__version__}); use backend='gloo' on the CPU")
    if backend == "nccl":
        available = torch.cuda.device_count()
        if world > available:
            raise InputError(f"the plan has {world} stage replicas (degrees {degrees}) and NCCL needs one GPU per "
                             f"rank, but this machine has {available} GPU(s). Use a plan of at most {available} "
                             "replicas in all, or backend='gloo' (device='cuda' shares the GPUs)")
    created = workdir is None
    directory = Path(tempfile.mkdtemp(prefix="flatpack-gpu-")) if created else Path(workdir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # and the fork server the ranks here are forked from (not part of a container's image)
        write_files({**runtime_sources((*RANK_ENTRIES, forked.SERVER_MODULE)), **stage_files(compiled)}, directory)
    except BaseException:
        if created:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    return GpuContainerDeployment(compiled, directory, created, backend, device, python or sys.executable)


def invoke(deployment: GpuContainerDeployment, role: RankRole,
           launch: RunLaunch | None = None) -> subprocess.Popen | forked.ForkedProcess:
    """Starts one rank of ``launch`` (default: the deployment's last prepared run) on the
    packaged flatpack, the way a container would: forked from the deployment's fork server,
    which imported torch and the packaged rank program from the work directory
    (``runtime.forked``), or as a fresh interpreter where ranks are not forked (another
    ``python``, ``FLATPACK_FORK_SERVER=0``, not Linux)."""
    launch = launch or deployment.current
    if launch is None:
        raise InputError("no run is prepared: call deployment.prepare(...) (or train) before invoking a rank")
    layout = launch.run.layout
    env = {**os.environ, "RANK": str(role.rank), "WORLD_SIZE": str(layout.world_size),
           "LOCAL_RANK": str(role.rank), "LOCAL_WORLD_SIZE": str(layout.world_size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(launch.master_port), "PYTHONPATH": str(deployment.workdir), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(launch.threads), DIGEST_ENV: deployment.compiled.digest}
    command = [deployment.python, "-m", RANK_MODULE, "--context", str(deployment.workdir),
               "--run", str(launch.directory / RUN_FILE), "--out", str(launch.out), "--warmup", str(launch.warmup)]
    command += ["--synthetic"] if launch.data is None else ["--data", str(launch.data)]
    if launch.parameters is not None:
        command += ["--parameters", str(launch.parameters)]
    if deployment.python == sys.executable:
        workdir = str(deployment.workdir)
        rank = forked.spawn(env, launch.log(role.rank), cwd=workdir, program="rank", argv=tuple(command[3:]),
                            server_cwd=workdir)
        if rank is not None:
            launch.processes[role.rank] = rank
            return rank
    with open(launch.log(role.rank), "wb") as log:   # the child holds its own copy of the descriptor
        process = subprocess.Popen(command, cwd=deployment.workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    launch.processes[role.rank] = process
    return process


def teardown(deployment: GpuContainerDeployment) -> None:
    deployment.teardown()


@dataclass
class RankReport:
    """What one rank wrote: its losses (last stage), samples/s and peak memory."""

    role: RankRole
    losses: list[float]
    samples_per_s: float
    peak_bytes: int


class GpuContainerDeployment:
    def __init__(self, compiled: Compiled, workdir: Path, created: bool, backend: str, device: str,
                 python: str) -> None:
        self.compiled = compiled
        self.workdir = workdir
        self.created = created
        self.backend = backend
        self.device = device
        self.python = python
        self.current: RunLaunch | None = None
        self.reports: list[RankReport] = []
        self.trained: Path | None = None     # the last finished training run's out/: what infer computes with
        self.last_latency_s: float | None = None

    # data -----------------------------------------------------------------------------------
    def _write_batches(self, directory: Path, first: tuple[dict[str, Any], Any, int],
                       batch_for: Callable[[int], Any], iterations: int) -> None:
        """Writes every iteration's global batch; ``first`` is batch 0's, already read (its
        rows are the run's batch)."""
        directory.mkdir(parents=True, exist_ok=True)
        rows = first[2]
        for iteration in range(iterations):
            values, target, size = first if iteration == 0 else batch_values(self.compiled, batch_for(iteration),
                                                                               iteration)
            if size != rows:
                raise InputError(f"batch {iteration} has {plural(size, 'sample')}, batch 0 has {rows}; every "
                                 "iteration of a run must have the same batch size (the loss is scaled by "
                                 "micro-batch / batch)")
            if isinstance(target, torch.Tensor):
                values = {**values, TARGET: target}
            data_file(directory, iteration).write_bytes(pack_values(values))

    # running --------------------------------------------------------------------------------
    def prepare(self, batches: Sequence[Any] | Callable[[int], Any] | None, settings: TrainSettings | None = None,
                controls: RunControls | None = None, *, batch: int | None = None, warmup: int = 1, seed: int = 0,
                mode: str = TRAIN, parameters: Path | None = None, **options: Unpack[TrainOptions]) -> RunLaunch:
        """Writes a run's ``run.json`` and data under ``runs/`` without starting it. The run is
        checked (batch 0's size included) before any data is written, and a run that fails
        to be written leaves nothing behind. ``mode`` "infer": a forward-only run
        (:meth:`infer`); ``parameters``: a finished run's output directory to start from."""
        settings, controls = resolve_options(settings, controls, options, what="prepare()")
        first = None
        batch_for: Callable[[int], Any] | None = None
        iterations = controls.iterations
        if batches is None:
            if not iterations or not batch:
                raise InputError("a synthetic run (batches=None) needs iterations= and batch=")
        else:
            iterations = iteration_count(batches, iterations)
            batch_for = batches if callable(batches) else batches.__getitem__
            first = batch_values(self.compiled, batch_for(0), 0)
            batch = first[2]     # measured once: the run's batch, which every later batch must match
        run = build_run(self.compiled, settings, controls.replace(iterations=iterations), batch=batch,
                        backend=self.backend, device=self.device, seed=seed, mode=mode)
        directory = self.workdir / "runs" / run.spec.run
        directory.mkdir(parents=True)
        data = directory / DATA_DIR if first is not None else None
        try:
            if data is not None and first is not None and batch_for is not None:   # given batches, not synthetic
                self._write_batches(data, first, batch_for, iterations)
            (directory / RUN_FILE).write_bytes(run.dumps())
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        threads = settings.threads or max(1, (os.cpu_count() or 1) // run.layout.world_size)
        self.current = RunLaunch(run, directory, _free_port(), data=data, warmup=warmup, threads=threads,
                                 parameters=parameters)
        return self.current

    def train(self, batches: Sequence[Any] | Callable[[int], Any] | None, settings: TrainSettings | None = None,
              controls: RunControls | None = None, *, batch: int | None = None, warmup: int = 1, seed: int = 0,
              **options: Unpack[TrainOptions]) -> TrainResult:
        """Trains ``iterations`` global batches with one process per rank on this machine and
        returns the final parameters, the losses and the timeline, as the local backend does.

        ``settings`` and ``controls`` (or their fields as keywords) as ``FunctionDeployment.train``
        takes them; a gpu-container run acts on :data:`HONOURED_SETTINGS` and
        :data:`HONOURED_CONTROLS` and refuses the others. ``batches``: ``(inputs, target)``
        global batches (or a function of the iteration); None trains on synthetic batches of
        ``batch`` samples (a throughput run; the losses are of random data). ``timeout_s``
        bounds the whole run, ``wait_timeout_s`` each rank's wait on a peer. ``warmup``:
        iterations left out of each rank's median. ``threads``: None shares the machine's
        cores among the ranks. ``precision`` "bf16": autocast on the ranks' device, bfloat16
        between stages; "fp16": float16, with ``torch.amp.GradScaler``'s loss scaling
        (``loss_scaling``). The batches written for the run are removed when it ends; its logs
        and outputs stay under the work directory until ``teardown``. ``replan`` is refused:
        the ranks hold their stages in one process group for the whole job.
        """
        settings, controls = resolve_options(settings, controls, options, what="train()")
        if controls.replan:
            raise InputError("replan switches plans between epochs on the local backend; gpu-container ranks hold "
                             "their stages in one process group for the whole job. Re-plan after the run (flatpack "
                             "plan --from-run RUN_DIR) and deploy the new plan")
        launch = self.prepare(batches, settings, controls, batch=batch, warmup=warmup, seed=seed)
        wall = self._execute(launch, controls.timeout_s)
        result = self._result(launch, wall)
        self.trained = launch.out
        return result

    def infer(self, inputs: Any, settings: TrainSettings | None = None, controls: RunControls | None = None,
              **options: Unpack[TrainOptions]) -> Any:
        """Runs one request through the ranks, forwards only, and returns the model's outputs,
        structured as the model returns them. The ranks compute with the weights of the last
        ``train`` on this deployment, else the compiled ones. ``micro_batches`` cuts the
        request as a training batch is cut (default: the plan's), so every replica of a
        stage takes its share; the request needs at least that many samples. Every call
        starts the ranks afresh (a container job, not a warm server)."""
        settings, controls = resolve_options(settings, controls, options, what="infer()")
        refuse_unhonoured(settings, controls, ("micro_batches", "threads", "precision", "timeout_s", "wait_timeout_s"),
                          what="infer() on gpu-container", why="it runs forward passes only")
        launch = self.prepare([(inputs, None)], settings, controls.replace(iterations=1), warmup=0, mode=INFER,
                              parameters=self.trained)
        self.last_latency_s = self._execute(launch, controls.timeout_s)
        return self._outputs(launch)

    def _execute(self, launch: RunLaunch, timeout_s: float) -> float:
        """Starts every rank of ``launch``, waits for them all and returns the seconds it took;
        the batches written for it are removed whatever happens."""
        started = time.time()
        try:
            for role in launch.run.layout.roles():
                invoke(self, role, launch)
            self._wait(launch, timeout_s)
        finally:
            self.stop(launch)
            if launch.data is not None:
                # every iteration's global batch: as large as the data trained on
                shutil.rmtree(launch.data, ignore_errors=True)
        return time.time() - started

    def _outputs(self, launch: RunLaunch) -> Any:
        """The model's outputs of an inference run's one request: each micro-batch's pieces as
        the ranks wrote them, joined along the batch in micro-batch order."""
        spec = launch.run.spec
        written: dict[str, Any] = {}
        for rank in range(launch.run.layout.world_size):
            path = outputs_file(launch.out, rank)
            if path.is_file():
                written.update(unpack_values(path.read_bytes()))
        names = launch.run.outputs
        missing = [output_key(0, m, name) for m in range(spec.micro_batches) for name in names
                   if output_key(0, m, name) not in written]
        if missing:
            raise RunFailure(f"the ranks finished but wrote no {', '.join(missing)} to {launch.out}; the logs are "
                             f"{launch.directory}/rank_*.log")
        parts = [{name: written[output_key(0, m, name)] for name in names} for m in range(spec.micro_batches)]
        sizes = [micro_batch_size(spec.batch, spec.micro_batches, m) for m in range(spec.micro_batches)]
        outputs = join_batch(parts, sizes)
        return structure.rebuild(self.compiled.info.output_structure, lambda index: outputs[names[index]])

    def _wait(self, launch: RunLaunch, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        layout = launch.run.layout
        running = dict(launch.processes)
        while running:
            time.sleep(POLL_S)
            failed = [rank for rank, process in launch.processes.items() if process.poll() not in (None, 0)]
            if failed:
                raise self._failure(launch, failed)
            running = {rank: process for rank, process in running.items() if process.poll() is None}
            if running and time.time() > deadline:
                late = ", ".join(f"rank {rank} ({layout.role(rank).worker})" for rank in sorted(running))
                first = min(running)
                raise RunFailure(f"the run did not finish within {timeout_s:.0f} s: {late} still running; raise "
                                 "timeout_s= (whole run) or wait_timeout_s= (per peer) for a longer run. The end of "
                                 f"rank {first}'s log {launch.log(first)}:\n{_tail(launch.log(first))}")

    def _failure(self, launch: RunLaunch, failed: list[int]) -> RunFailure:
        """Names the rank that failed first: its peers then fail too, on closed connections,
        so the ranks are given a moment and the earliest recorded failure is the cause."""
        grace = time.time() + FAILURE_GRACE_S
        while time.time() < grace and any(process.poll() is None for process in launch.processes.values()):
            time.sleep(POLL_S)
        # every rank that has exited, and not cleanly, with its exit code
        codes = {rank: code for rank, process in launch.processes.items()
                 if (code := process.poll()) is not None and code != 0}
        failed = sorted(codes)
        times = {}
        for rank in failed:
            try:
                times[rank] = json.loads(error_file(launch.out, rank).read_text())["time"]
            except (OSError, ValueError, KeyError):
                times[rank] = float("inf")   # killed without a record (a signal, out of memory)
        # a rank killed by a signal (SIGKILL when out of memory) left no record but is the likelier cause
        first = min(failed, key=lambda rank: (codes[rank] >= 0, times[rank], rank))
        role = launch.run.layout.role(first)
        code = codes[first]
        others = [rank for rank in failed if rank != first]
        echo = f" Ranks {', '.join(map(str, others))} failed after it." if others else ""
        return RunFailure(f"rank {first} (stage {role.stage}, replica {role.replica}) exited with code {code}.{echo} "
                          f"The end of its log {launch.log(first)}:\n{_tail(launch.log(first))}")

    def _result(self, launch: RunLaunch, wall: float) -> TrainResult:
        run = launch.run
        layout = run.layout
        reports = list(iter_reports(launch.out))
        reported = {report["rank"] for report in reports}
        missing = [rank for rank in range(layout.world_size) if rank not in reported]
        if missing:
            logs = "; ".join(f"rank {rank} ({layout.role(rank).worker}): {launch.log(rank)}" for rank in missing)
            raise RunFailure(f"{len(reports)} of {layout.world_size} ranks wrote a report to {launch.out}; none from "
                             f"{logs}. The end of rank {missing[0]}'s log:\n{_tail(launch.log(missing[0]))}")
        self.reports = [RankReport(layout.role(report["rank"]), report["losses"], report["samples_per_s"],
                                    report["peak_bytes"]) for report in reports]
        last = len(layout.degrees) - 1
        losses = [0.0] * run.iterations
        for report in self.reports:
            if report.role.stage == last:
                losses = [total + value for total, value in zip(losses, report.losses)]

        parameters: dict[str, torch.Tensor] = {}
        for stage in range(len(layout.degrees)):
            for name, tensor in load_file(str(parameters_file(launch.out, stage))).items():
                parameters.setdefault(name, tensor)   # a tied parameter: every holder's copy is equal
        events = []
        for rank in range(layout.world_size):
            events.extend(timeline.loads(timeline_file(launch.out, rank).read_bytes()))
        events.sort(key=lambda event: event.start)
        price = sum(tier.price_per_s * degree for tier, degree in
                    ((_tier(stage.memory_mb), stage.replicas) for stage in self.compiled.plan.stages) if tier)
        return TrainResult(parameters=parameters, losses=losses, events=events, restarts=[],
                           degrees=[layout.degrees], wall_s=wall, samples=run.spec.batch * run.iterations,
                           dollars=price * wall,
                           peak_bytes={report.role.worker: report.peak_bytes for report in self.reports})

    def steady_samples_per_s(self) -> float:
        """The last run's throughput: the global batch over the slowest rank's median
        seconds per iteration after warm-up (every rank runs at the pipeline's period)."""
        if not self.reports:
            raise InputError("no run has finished on this deployment yet")
        return min(report.samples_per_s for report in self.reports)

    # lifecycle ------------------------------------------------------------------------------
    def stop(self, launch: RunLaunch | None = None) -> None:
        launch = launch or self.current
        if launch is None:
            return
        for process in launch.processes.values():
            if process.poll() is None:
                process.kill()
        for process in launch.processes.values():
            process.wait()

    def teardown(self) -> None:
        """Stops the ranks and the fork server they came from, and removes the work directory
        if ``deploy`` created it."""
        self.stop()
        forked.close_servers(str(self.workdir))
        if self.created:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> GpuContainerDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


def backend() -> Any:
    """This module, as the backend registry hands it out."""
    return sys.modules[__name__]
