#!/usr/bin/env bash
# The GPU issue's runs in one command on a GPU host (one H200, ~9 minutes): each part under its own timeout,
# so one that hangs cannot take the others' time, and every result lands in OUTDIR (default bench/results/gpu_host):
#
#     bench/gpu_host.sh [OUTDIR]
#
# 1. env.txt: the GPU, nvcc, and the torch / transformers / peft the host has;
# 2. learner_step_cuda.json: bench/learner_step_device.py on the GPU (SmolLM2-135M's shape, random weights;
#    compare with the same script's --device cpu line from the CPU machine);
# 3. gpu_kernels.log + kernels_gpu.json: bench/gpu_kernels.sh with GPU_TESTS=1 (every kernel task's known-good
#    solution through cuda_check and cuda_bench, the LEAP probe, the tests marked gpu).
# Environment: PYTHON (default: python3 on PATH), STEP_TIMEOUT_S (150), KERNELS_TIMEOUT_S (400), and what
# bench/gpu_kernels.sh reads (JOBS, BUDGET_S default 240 here, LEAP_TIMEOUT_S default 60 here).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-bench/results/gpu_host}
mkdir -p "$OUTDIR"
PY=${PYTHON:-$(command -v python3)}
export PYTHONUNBUFFERED=1
START=$(date +%s)
{
    nvidia-smi -L
    nvcc --version | tail -2
    "$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
    nproc
} 2>&1 | tee "$OUTDIR/env.txt"

echo "== learner step on the GPU =="
timeout "${STEP_TIMEOUT_S:-150}" "$PY" bench/learner_step_device.py --device cuda --steps 10 > "$OUTDIR/learner_step_cuda.log" 2>&1
echo "exit $?"
tail -1 "$OUTDIR/learner_step_cuda.log" | tee "$OUTDIR/learner_step_cuda.json"

echo "== kernels =="
PYTHON="$PY" GPU_TESTS=1 BUDGET_S=${BUDGET_S:-240} LEAP_TIMEOUT_S=${LEAP_TIMEOUT_S:-60} \
    timeout "${KERNELS_TIMEOUT_S:-400}" bash bench/gpu_kernels.sh > "$OUTDIR/gpu_kernels.log" 2>&1
echo "exit $?"
cp bench/results/kernels_gpu.json "$OUTDIR/" 2>/dev/null || echo "no kernels_gpu.json"
tail -60 "$OUTDIR/gpu_kernels.log"
echo "gpu_host done in $(( $(date +%s) - START )) s"
