#!/usr/bin/env bash
# The GPU checks that CI cannot run (it has no GPU), in one pass that fits a short lease on a
# GPU machine: the tests that skip without CUDA, the collective fidelity benchmark with gloo
# ranks sharing the GPU, and `flatpack calibrate --target gpu-container` as a user runs it.
# Each step has its own time limit, so one that hangs still leaves the others their time;
# logs go to $LOGS (default gpu-checks/). Run from the repository root:
#
#     LOGS=/some/dir bash benchmarks/gpu_checks.sh
#
# The machine needs torch with CUDA, pytest, hypothesis, scipy, PyYAML, safetensors and
# cryptography on PYTHONPATH; the cloud SDKs and solvers (boto3, ortools, optuna) are not used.
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${LOGS:-gpu-checks}"
mkdir -p "$logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
status=0

step() {   # step NAME SECONDS COMMAND...: runs COMMAND under a time limit, its output to $logs/NAME.log
    local name="$1" seconds="$2"
    shift 2
    echo "== $name (at most ${seconds} s)"
    timeout "$seconds" "$@" 2>&1 | tee "$logs/$name.log"
    local code="${PIPESTATUS[0]}"
    echo "== $name: exit $code"
    [ "$code" -eq 0 ] || status=1
}

nvidia-smi -L 2>&1 | tee "$logs/gpu.log"
python3 -c "import torch; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count())" | tee -a "$logs/gpu.log"

step pytest-collective 60 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" \
    "tests/integration/test_collective_calibration.py::test_ranks_on_the_gpu_time_the_transport_a_plan_s_ranks_would_use" \
    "tests/unit/test_profiler.py::test_profiling_on_the_gpu_records_it"
step fidelity "${FIDELITY_SECONDS:-150}" python3 benchmarks/collective_fidelity.py --device cuda \
    --replicas "${REPLICAS:-2,4}" --widths "${WIDTHS:-512,2048}" --iterations 8 --warmup 3
step calibrate 60 python3 -m flatpack calibrate --target gpu-container --out "$logs/gpu-container-calibration.json"
step pytest-gpu "${PYTEST_SECONDS:-180}" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" \
    "tests/integration/test_gpu_container.py::test_gloo_ranks_sharing_a_gpu_match_cpu_reference" \
    "tests/integration/test_gpu_container.py::test_nccl_pipeline_matches_cpu_reference" \
    "tests/integration/test_precision_knobs.py::test_16_bit_on_cuda_ranks_follows_the_cpu_reference"
exit "$status"
