#!/usr/bin/env bash
# loopwise in front of a real SGLang server, in one command, on a GPU host with SGLang installed
# (pip install -e '.[sglang,dev]'):
#
#     bench/gpu_sglang.sh [MODEL_DIR]
#
# 1. launches `python -m sglang.launch_server` with dynamic LoRA (--enable-lora, --max-lora-rank 64,
#    --lora-target-modules all, --max-loras-per-batch 9, --max-loaded-loras 16, one tokenizer worker)
#    on MODEL_DIR (default: SmolLM2-135M-Instruct, converted into .data/models on first use);
# 2. runs the tests marked `sglang` (tests/runtime/test_sglang_real.py) against it;
# 3. runs bench/sglang_overhead.py: 16 clients, the same token ids through loopwise and straight to
#    SGLang's /generate, alternating rounds; prints p50/p95 latency, throughput and the overhead ratios
#    (target p50 ratio <= 1.10), also in bench/results/sglang_overhead.json.
# SGLang is stopped when the script ends (also on failure or Ctrl-C). Its log: bench/results/sglang.log.
# Environment: SGLANG_PORT (default 30000), PYTHON (default .venv/bin/python, else python3),
# ROUNDS / MAX_TOKENS for the benchmark (default 12 / 64).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
PORT=${SGLANG_PORT:-30000}
URL="http://127.0.0.1:${PORT}"
MODEL=${1:-$("$PY" -c "from pathlib import Path; from runtime.model_store import resolve_model; print(resolve_model('default', Path('.data/models')))")}
mkdir -p bench/results

"$PY" -c "import sglang, torch; assert torch.cuda.is_available(), 'no CUDA device'; print('sglang', sglang.__version__)"

"$PY" -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --enable-lora --max-lora-rank 64 --lora-target-modules all \
    --max-loras-per-batch 9 --max-loaded-loras 16 --tokenizer-worker-num 1 \
    > bench/results/sglang.log 2>&1 &
SGLANG_PID=$!
trap 'kill "$SGLANG_PID" 2>/dev/null || true; wait "$SGLANG_PID" 2>/dev/null || true' EXIT

echo "waiting for SGLang at $URL (log: bench/results/sglang.log)"
for _ in $(seq 1 900); do
    if curl -fsS "$URL/health_generate" > /dev/null 2>&1; then break; fi
    if ! kill -0 "$SGLANG_PID" 2>/dev/null; then echo "SGLang exited; see bench/results/sglang.log" >&2; exit 1; fi
    sleep 1
done
curl -fsS "$URL/health_generate" > /dev/null

echo "== tests marked sglang =="
LOOPWISE_SGLANG_URL="$URL" LOOPWISE_SGLANG_MODEL="$MODEL" "$PY" -m pytest -m sglang tests/runtime/test_sglang_real.py -q

echo "== overhead: loopwise vs SGLang directly =="
"$PY" bench/sglang_overhead.py --sglang-url "$URL" --model "$MODEL" --clients 16 --rounds "${ROUNDS:-12}" --max-tokens "${MAX_TOKENS:-64}"
