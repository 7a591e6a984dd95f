#!/usr/bin/env bash
# The CUDA kernel tools on a GPU host, in one command (made for one H200; finishes within 8 minutes):
#
#     bench/gpu_kernels.sh
#
# 1. checks that torch sees a CUDA device;
# 2. bench/kernels.py --gpu-table: builds and checks every kernel task's known-good solution
#    (agents.tasks.kernels) with cuda_check, JOBS at a time, then times each with cuda_bench (CUDA events,
#    median of 50 after 10 warm-ups, against eager PyTorch); prints the table (compile rate, correct,
#    geomean speedup, fast_1.0, fast_1.2), also in bench/results/kernels_gpu.json;
# 3. a short LEAP probe: python -m learner.leap --probe on a recorded probe (recorded first with
#    bench/leap_probe.py when there is none), if learner/leap.py exists; otherwise it says it is skipped;
# 4. with GPU_TESTS=1, the tests marked gpu in tests/tools/test_cuda_tools.py (4 more builds, ~2 minutes).
# Environment: PYTHON (default .venv/bin/python, else python3), JOBS (default: CPU count, at most 16),
# BUDGET_S (seconds after which the table starts no new work, default 330), LEAP_TIMEOUT_S (default 90),
# LEAP_PROBE (a recorded probe, default bench/data/leap_probe.jsonl),
# LOOPWISE_CUDA_ARCH (default sm_90), LOOPWISE_CUDA_CACHE (extension build cache; default under /tmp).
# On a host where the tools' user namespace cannot open the GPU (seen on an H200 host: the table then says the
# host has a GPU the tool's process cannot use), run with LOOPWISE_CUDA_ISOLATION=none.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
CPUS=$(nproc)
JOBS=${JOBS:-$(( CPUS < 16 ? CPUS : 16 ))}
START=$(date +%s)
mkdir -p bench/results

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"
command -v nvcc > /dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] || { echo "nvcc not found (set CUDA_HOME)" >&2; exit 1; }
PATH="$(dirname "$PY"):$PATH" command -v ninja > /dev/null || { echo "ninja not found: torch.utils.cpp_extension needs it (pip install ninja)" >&2; exit 1; }

echo "== kernel tasks: check + bench of every known-good solution (jobs=$JOBS) =="
"$PY" bench/kernels.py --gpu-table --jobs "$JOBS" --budget-s "${BUDGET_S:-330}"

echo "== LEAP probe =="
# DCP over a recorded probe (LEAP_PROBE, default bench/data/leap_probe.jsonl); when none is recorded, record
# a short one first with bench/leap_probe.py (G=2, level 1; compile outcomes only), both under LEAP_TIMEOUT_S.
LEAP_PROBE=${LEAP_PROBE:-bench/data/leap_probe.jsonl}
if [ ! -f learner/leap.py ]; then
    echo "learner/leap.py is not there yet: LEAP probe skipped"
else
    if [ ! -f "$LEAP_PROBE" ] && [ -f bench/leap_probe.py ]; then
        LEAP_PROBE=bench/results/leap_probe_gpu_host.jsonl
        echo "no recorded probe: recording a short one into $LEAP_PROBE"
        timeout "${LEAP_TIMEOUT_S:-90}" "$PY" bench/leap_probe.py --out "$LEAP_PROBE" --g 2 --level 1 || echo "recording the probe failed or ran past ${LEAP_TIMEOUT_S:-90} s (exit $?)"
    fi
    if [ -f "$LEAP_PROBE" ]; then
        timeout "${LEAP_TIMEOUT_S:-90}" "$PY" -m learner.leap --probe "$LEAP_PROBE" || echo "LEAP probe failed or ran past ${LEAP_TIMEOUT_S:-90} s (exit $?)"
    else
        echo "no LEAP probe file ($LEAP_PROBE): LEAP probe skipped"
    fi
fi

if [ "${GPU_TESTS:-0}" = "1" ]; then
    echo "== tests marked gpu: tests/tools/test_cuda_tools.py =="
    "$PY" -m pytest -m gpu tests/tools/test_cuda_tools.py -q
fi
echo "done in $(( $(date +%s) - START )) s"
