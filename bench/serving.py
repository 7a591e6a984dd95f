"""Serving benchmarks for the embedded engine, printed as ratios side by side in one run.

    .venv/bin/python bench/serving.py                 # SmolLM2, 32 requests, 16 clients, 64 new tokens
    .venv/bin/python bench/serving.py --skip-peer     # without `transformers serve`
    .venv/bin/python bench/serving.py --model tiny    # a quick smoke run

What it measures (each phase runs alone on the machine; servers are started and stopped in turn):
1. Batching: aggregate output tok/s of the same requests sent one at a time vs by 16 concurrent
   clients, against a real ``serve.py`` process. Target ≥ 5×.
2. Peer: the same 16-client load against ``transformers serve --continuous-batching`` (same model
   folder, fp32, CPU). Target loopwise / peer ≥ 1.0.
3. Batch-1 decode speed in process, as a fraction of the memory-bandwidth bound (read bandwidth
   measured here by summing a 512 MiB tensor, divided by the bytes of weights read per token).
4. HTTP overhead: p50/p95 latency of non-streamed ``/v1/chat/completions`` (16 new tokens) vs
   ``engine.generate`` in process for the same token ids, the two alternating request by request
   (the server idles while the in-process engine runs). Target p50 ratio ≤ 1.10.

Completion lengths can differ between servers (each stops at its own end-of-text), so throughput is
total completion tokens (from ``usage``) over wall time. Results also go to bench/results/serving.json.
Not here: GPU runs and SGLang (their own benchmarks), timed assertions (never in tests).
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
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOPICS = [
    "a lighthouse keeper",
    "a robot learning to paint",
    "a lost dog in the city",
    "the first snow of winter",
    "a dragon who hates fire",
    "a baker's secret recipe",
    "a train that never stops",
    "an old map",
    "a garden on the moon",
    "a clock that runs backwards",
    "a shy ghost",
    "a pirate's last voyage",
    "a library at midnight",
    "a village by the sea",
    "a young inventor",
    "a mountain rescue",
]


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}. Story #{i}." for i in range(n)]


def start_process(cmd: list[str], ready_url_of, log_path: Path, timeout: float = 600) -> tuple[subprocess.Popen, str]:
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited early; see {log_path}")
        url = ready_url_of(line)
        if url:
            return proc, url
    raise TimeoutError(f"{cmd} did not start")


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


async def run_load(base: str, model: str, texts: list[str], clients: int, max_tokens: int, extra: dict | None = None) -> dict:
    sem = asyncio.Semaphore(clients)
    tokens = 0

    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(text: str) -> None:
            nonlocal tokens
            async with sem:
                body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, **(extra or {})}
                r = await client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(t) for t in texts))
        wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(texts), "completion_tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 1)}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def in_process(model_path: Path, n: int, decode_tokens: int, http_base: str | None = None) -> dict:
    """Latency in process; with ``http_base``, each in-process request alternates with the same request
    over HTTP to the (otherwise idle) server, so machine noise hits both sides alike."""
    import torch

    from runtime.engine import GenerateRequest, SamplingParams
    from runtime.engines.embedded import EmbeddedEngine

    eng = EmbeddedEngine(model_path, model_id="bench", dtype="auto")
    await eng.start()
    tok = eng.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}], tokenize=False, add_generation_prompt=True)
    ids = tuple(tok.encode(text, add_special_tokens=False))
    req16 = GenerateRequest("lat", ids, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    await eng.generate(req16)
    lat, http_lat = [], []
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=http_base or "http://unused", timeout=120) as client:
        if http_base:
            (await client.post("/v1/chat/completions", json=body)).raise_for_status()  # warm-up
        for _ in range(n):
            t0 = time.perf_counter()
            await eng.generate(req16)
            lat.append(time.perf_counter() - t0)
            if http_base:
                t0 = time.perf_counter()
                r = await client.post("/v1/chat/completions", json=body)
                http_lat.append(time.perf_counter() - t0)
                r.raise_for_status()
                assert r.json()["usage"]["prompt_tokens"] == len(ids), "HTTP and in-process prompts differ"
    # batch-1 decode: time from first to last token
    req = GenerateRequest("dec", ids, SamplingParams(max_new_tokens=decode_tokens, temperature=0, ignore_eos=True))
    res = await eng.generate(req)
    decode_s = res.timings.total_s - res.timings.ttft_s
    decode_tps = (len(res.output_ids) - 1) / decode_s
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    dtype = eng.info.dtype
    await eng.close()
    # memory read bandwidth (a GEMV reads each weight once): sum a 512 MiB buffer, best of 5
    src = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    bandwidth = src.numel() * 4 / best  # bytes/s
    bound = bandwidth / weight_bytes
    return {
        "http_p50_s": statistics.median(http_lat) if http_lat else None,
        "http_p95_s": pct(http_lat, 0.95) if http_lat else None,
        "engine_p50_s": statistics.median(lat),
        "engine_p95_s": pct(lat, 0.95),
        "decode_tok_s": round(decode_tps, 1),
        "bandwidth_GBps": round(bandwidth / 1e9, 1),
        "weights_MB": round(weight_bytes / 1e6),
        "dtype": dtype,
        "bound_tok_s": round(bound, 1),
        "fraction_of_bound": round(decode_tps / bound, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--latency-samples", type=int, default=20)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--data-dir", default=str(ROOT / ".data"))
    args = ap.parse_args()

    from runtime.model_store import resolve_model

    model_path = resolve_model(args.model, Path(args.data_dir) / "models")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = prompts(args.requests)
    results: dict = {"model": str(model_path), "new_tokens": args.new_tokens}

    # 1 + 4 (HTTP side): loopwise server
    cmd = [
        sys.executable,
        "serve.py",
        "--model",
        str(model_path),
        "--served-model-name",
        "m",
        "--port",
        "0",
        "--data-dir",
        args.data_dir,
        "--log-level",
        "warning",
    ]
    proc, base = start_process(cmd, lambda line: (m := re.search(r"on (http://[\d.]+:\d+)/v1", line)) and m.group(1), out_dir / "loopwise.log")
    try:
        results["loopwise_sequential"] = asyncio.run(run_load(base, "m", texts, 1, args.new_tokens))
        print("loopwise, one at a time:", results["loopwise_sequential"], flush=True)
        results["loopwise_concurrent"] = asyncio.run(run_load(base, "m", texts, args.clients, args.new_tokens))
        print(f"loopwise, {args.clients} clients:", results["loopwise_concurrent"], flush=True)
        # 3 + 4: in process, alternating with the same request over HTTP to the idle server
        results["in_process"] = asyncio.run(in_process(model_path, args.latency_samples, args.new_tokens, http_base=base))
        results["http_p50_s"], results["http_p95_s"] = results["in_process"]["http_p50_s"], results["in_process"]["http_p95_s"]
        print("in process (and HTTP alternating):", results["in_process"], flush=True)
    finally:
        stop_process(proc)

    # 2: the peer
    if not args.skip_peer:
        port = 8911
        tf = str(Path(sys.executable).with_name("transformers"))
        cmd = [tf, "serve", "--continuous-batching", "--device", "cpu", "--dtype", "float32", "--port", str(port), str(model_path)]
        peer = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(out_dir / "peer.log", "w"))
        try:
            base_peer = f"http://localhost:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(base_peer + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    if time.monotonic() > deadline or peer.poll() is not None:
                        raise RuntimeError(f"transformers serve did not start; see {out_dir / 'peer.log'}") from None
                time.sleep(1)
            asyncio.run(run_load(base_peer, str(model_path), texts[:2], 2, 8))  # warm-up (model load)
            results["peer_concurrent"] = asyncio.run(run_load(base_peer, str(model_path), texts, args.clients, args.new_tokens))
            print(f"transformers serve --continuous-batching, {args.clients} clients:", results["peer_concurrent"], flush=True)
        finally:
            stop_process(peer)

    seq, conc, ip = results["loopwise_sequential"], results["loopwise_concurrent"], results["in_process"]
    print(f"\nmodel: {model_path.name}  dtype: {ip['dtype']}  requests: {args.requests}  new tokens: {args.new_tokens}  cores: {os.cpu_count()}")
    print(f"{'measure':48s} {'value':>12s} {'baseline':>12s} {'ratio':>8s}")
    print(
        f"{f'batching: tok/s {args.clients} clients vs one at a time':48s} {conc['tok_s']:12.1f} {seq['tok_s']:12.1f} {conc['tok_s'] / seq['tok_s']:8.2f}"
    )
    if "peer_concurrent" in results:
        peer = results["peer_concurrent"]
        print(
            f"{'peer: tok/s loopwise vs transformers serve --cb':48s} {conc['tok_s']:12.1f} {peer['tok_s']:12.1f} {conc['tok_s'] / peer['tok_s']:8.2f}"
        )
    print(f"{'batch-1 decode tok/s vs bandwidth bound':48s} {ip['decode_tok_s']:12.1f} {ip['bound_tok_s']:12.1f} {ip['fraction_of_bound']:8.2f}")
    print(f"   (read bandwidth {ip['bandwidth_GBps']} GB/s, {ip['weights_MB']} MB of weights read per token)")
    print(
        f"{'HTTP p50 latency (16 tokens) vs in-process':48s} {results['http_p50_s'] * 1000:10.1f}ms {ip['engine_p50_s'] * 1000:10.1f}ms {results['http_p50_s'] / ip['engine_p50_s']:8.2f}"
    )
    print(
        f"{'HTTP p95 latency (16 tokens) vs in-process':48s} {results['http_p95_s'] * 1000:10.1f}ms {ip['engine_p95_s'] * 1000:10.1f}ms {results['http_p95_s'] / ip['engine_p95_s']:8.2f}"
    )
    (out_dir / "serving.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
