"""Overhead of loopwise in front of SGLang: the same token ids through loopwise vs straight to SGLang.

    .venv/bin/python bench/sglang_overhead.py                     # against the fake SGLang (tiny model, CPU)
    .venv/bin/python bench/sglang_overhead.py --rounds 20 --max-tokens 32
    .venv/bin/python bench/sglang_overhead.py --sglang-url http://127.0.0.1:30000 --model /path/to/model   # a real SGLang

Both sides hit one SGLang server (by default the fake in ``tests/fakes/sglang_server.py``, backed by the
embedded engine): side A is ``POST /v1/chat/completions`` to a ``serve.py --backend sglang`` process
(templating, routing, recording on, logprobs, the SSE-free non-streamed path), side B is ``POST /generate``
straight to SGLang with the token ids loopwise would send (the chat template applied with the same
tokenizer; checked against loopwise's ``usage.prompt_tokens``), ``return_logprob`` on as loopwise asks.
Each round sends 16 concurrent requests (``--clients``) to one side, then 16 to the other, the order
alternating round by round, so machine noise hits both alike. Printed: p50/p95 latency per side, the
p50 ratio (target ≤ 1.10), and throughput. Results also go to bench/results/sglang_overhead.json.

On CPU against the fake this measures loopwise's HTTP + templating + recording cost relative to a
tiny model's generation time, so it is pessimistic; ``bench/gpu_sglang.sh`` runs it against a real
SGLang on a GPU, and ``bench/engines.py`` runs ``compare`` (the measurement, shared) against SGLang's CPU server.
Not here: timed assertions (never in tests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOPICS = ["the sea", "a lighthouse", "winter", "a robot", "bread", "trains", "maps", "the moon", "ghosts", "pirates", "libraries", "rivers"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def start_loopwise(model: Path, sglang_url: str, data_dir: Path, record: bool) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "serve.py", "--model", str(model), "--served-model-name", "m", "--port", "0", "--data-dir", str(data_dir)]
    cmd += ["--backend", "sglang", "--sglang-url", sglang_url, "--log-level", "warning", "--record" if record else "--no-record"]
    with open(data_dir / "loopwise.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"serve.py exited early; see {data_dir / 'loopwise.log'}")
        if m := re.search(r"on (http://[\d.]+:\d+)/v1", line):
            return proc, m.group(1)
    raise TimeoutError("serve.py did not start")


async def side_loopwise(client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int) -> tuple[float, int, int]:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = await client.post(base + "/v1/chat/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json()["usage"]
    return dt, usage["prompt_tokens"], usage["completion_tokens"]


async def side_direct(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int) -> tuple[float, int, int]:
    body = {  # what loopwise's SGLang engine sends for a recorded, greedy, non-streamed request (less its rid)
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "top_p": 1.0, "ignore_eos": True, "skip_special_tokens": True},
        "stream": False,
        "return_logprob": True,
        "top_logprobs_num": 0,
    }
    t0 = time.perf_counter()
    r = await client.post(url + "/generate", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return dt, meta["prompt_tokens"], meta["completion_tokens"]


def conversations(tok, n: int) -> tuple[list[list[dict]], list[list[int]]]:
    """``n`` one-message chats and the prompt token ids loopwise sends for each (the chat template, the same tokenizer)."""
    convs = [[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}. Request {i}."}] for i in range(n)]
    return convs, [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)) for c in convs]


async def compare(
    client: httpx.AsyncClient, base: str, sglang_url: str, convs: list[list[dict]], ids: list[list[int]], rounds: int, max_tokens: int
) -> dict:
    """Loopwise at ``base`` vs SGLang's ``/generate`` at ``sglang_url``: all of ``convs`` at once per round and side, alternating.

    Returns per side p50/p95 latency and completion tok/s, their ratios, and whether loopwise saw ``ids``'s prompt lengths."""
    lat: dict[str, list[float]] = {"loopwise": [], "direct": []}
    tokens = {"loopwise": 0, "direct": 0}
    wall = {"loopwise": 0.0, "direct": 0.0}
    # warm-up, and the check that both sides see the same prompt tokens
    check = await asyncio.gather(*(side_loopwise(client, base, c, 2) for c in convs))
    await asyncio.gather(*(side_direct(client, sglang_url, i, 2) for i in ids))
    mismatched = [k for k, (_, p, _) in enumerate(check) if p != len(ids[k])]
    if mismatched:
        print(f"warning: prompt token counts differ for {len(mismatched)} conversations (template differs from loopwise's)", flush=True)
    for rnd in range(rounds):
        order = ["loopwise", "direct"] if rnd % 2 == 0 else ["direct", "loopwise"]
        for side in order:
            t0 = time.perf_counter()
            if side == "loopwise":
                res = await asyncio.gather(*(side_loopwise(client, base, c, max_tokens) for c in convs))
            else:
                res = await asyncio.gather(*(side_direct(client, sglang_url, i, max_tokens) for i in ids))
            wall[side] += time.perf_counter() - t0
            lat[side] += [r[0] for r in res]
            tokens[side] += sum(r[2] for r in res)
    out: dict = {"clients": len(convs), "rounds": rounds, "max_tokens": max_tokens, "same_prompt_tokens": not mismatched}
    for side in lat:
        out[side] = {
            "p50_s": statistics.median(lat[side]),
            "p95_s": pct(lat[side], 0.95),
            "tok_s": tokens[side] / wall[side],
            "requests": len(lat[side]),
        }
    out["p50_ratio"] = out["loopwise"]["p50_s"] / out["direct"]["p50_s"]
    out["p95_ratio"] = out["loopwise"]["p95_s"] / out["direct"]["p95_s"]
    out["tok_s_ratio"] = out["loopwise"]["tok_s"] / out["direct"]["tok_s"]
    return out


async def run(args: argparse.Namespace, model: Path, sglang_url: str, base: str) -> dict:
    from transformers import AutoTokenizer

    convs, ids = conversations(AutoTokenizer.from_pretrained(model), args.clients)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.clients * 2)) as client:
        return await compare(client, base, sglang_url, convs, ids, args.rounds, args.max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny', 'default' or a local model folder (the one SGLang serves)")
    ap.add_argument("--sglang-url", default=None, help="a running SGLang server (default: start the fake)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-record", action="store_true", help="run loopwise without recording turns")
    ap.add_argument("--data-dir", default=str(ROOT / ".data"))
    args = ap.parse_args()

    from runtime.model_store import resolve_model

    model = resolve_model(args.model, Path(args.data_dir) / "models") if args.model in ("tiny", "default") else Path(args.model)
    work = Path(tempfile.mkdtemp(prefix="sglang-overhead-"))
    fake = None
    if args.sglang_url is None:
        from tests.fakes.sglang_process import FakeSGLang

        fake = FakeSGLang(model, work)
        sglang_url = fake.url
    else:
        sglang_url = args.sglang_url.rstrip("/")
    proc, base = start_loopwise(model, sglang_url, work, record=not args.no_record)
    try:
        res = asyncio.run(run(args, model, sglang_url, base))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if fake is not None:
            fake.stop()
    res["sglang"] = "fake (tests/fakes/sglang_server.py, embedded engine, CPU)" if fake else sglang_url
    res["model"] = str(model)
    res["recording"] = not args.no_record
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sglang_overhead.json").write_text(json.dumps(res, indent=2))
    lw, d = res["loopwise"], res["direct"]
    print(f"SGLang: {res['sglang']}; model {model.name}; {args.clients} clients x {args.rounds} rounds per side, {args.max_tokens} new tokens")
    print(f"{'measure':34s} {'loopwise':>12s} {'direct':>12s} {'ratio':>8s}")
    print(f"{'p50 latency':34s} {lw['p50_s'] * 1000:10.1f}ms {d['p50_s'] * 1000:10.1f}ms {res['p50_ratio']:8.3f}   (target <= 1.10)")
    print(f"{'p95 latency':34s} {lw['p95_s'] * 1000:10.1f}ms {d['p95_s'] * 1000:10.1f}ms {res['p95_ratio']:8.3f}")
    print(f"{'throughput (completion tok/s)':34s} {lw['tok_s']:12.1f} {d['tok_s']:12.1f} {res['tok_s_ratio']:8.3f}")


if __name__ == "__main__":
    main()
