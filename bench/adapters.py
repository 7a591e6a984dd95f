"""LoRA adapter benchmarks against one real ``serve.py`` process, printed as ratios side by side.

    .venv/bin/python bench/adapters.py                 # SmolLM2, 48 requests per round, 2 rounds each way
    .venv/bin/python bench/adapters.py --model tiny    # a quick smoke run

Adapters are built here with peft (r=8 on q/k/v/o_proj, random non-zero weights, one seed each) into
a temporary adapter root, and loaded through the admin API (``POST /admin/adapters``,
``PUT /admin/aliases/{family}``).

What it measures:
1. Hot-swap latency: while 16 background clients keep sending requests to the family alias ``fam``
   (16 new tokens each), a new version is loaded (``POST``, no alias) and the alias flipped to it
   (``PUT``); a separate client then polls ``fam`` (1 new token) until a response's
   ``loopwise.adapter`` names the new version. Latency = that response's arrival − the time before
   the ``POST``, repeated 5 times. Target median and max ≤ 1 s. Failed background requests (any non-200
   or transport error) are counted; target 0. As a control for machine load, the same 1-token request
   is timed right before each swap (no swap going on); its median is printed beside the swap latency,
   since on a loaded machine most of the swap latency is that wait for a decode slot. The engine's own
   part (read + prepare on a worker thread, then the wait for the attach between two decode steps) is
   read from the server log.
2. Throughput, three loads alternated round by round (base, single, mixed, base, single, mixed, …) so
   machine noise hits every side alike: 16 concurrent clients, ``--requests`` requests per round (32 new
   tokens, ``ignore_eos``, temperature 0) all to the base model (``base``), all to one adapter
   (``single``), or cycling over 4 adapter versions and the base (``mixed``). Aggregate tok/s
   (``usage.completion_tokens`` / wall) is the median over rounds. Targets: mixed / single ≥ 0.8, and
   single / base as close to 1 as we can (the LoRA path's cost over the base model).

Results also go to bench/results/adapters.json (server log: bench/results/adapters.log).
Not here: GPU runs and SGLang, adapter eviction under capacity pressure, A/B experiments, timed
assertions (never in tests).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.serving import prompts, start_process, stop_process  # noqa: E402

ADMIN = "bench"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build_adapters(base: Path, root: Path, n: int, r: int = 8, std: float = 0.05) -> list[Path]:
    """``n`` peft LoRA folders under ``root`` (a0, a1, …), each with its own random non-zero weights.

    The base model is loaded once; the LoRA weights are re-drawn per seed and saved."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, init_lora_weights=False)
    )
    out = []
    for k in range(n):
        torch.manual_seed(1000 + k)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, std)
        path = root / f"a{k}"
        model.save_pretrained(path)
        out.append(path)
    return out


def chat_body(model: str, text: str, max_tokens: int, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **extra}


def load_adapter(base: str, path: Path, family: str, **kw) -> str:
    r = httpx.post(base + "/admin/adapters", json={"path": str(path), "family": family, **kw}, headers=AUTH, timeout=120)
    r.raise_for_status()
    return r.json()["name"]


def swap_latency(base: str, paths: list[Path], swaps: int, clients: int) -> dict:
    first = load_adapter(base, paths[0], "fam", alias=True)
    stop = threading.Event()
    lock = threading.Lock()
    stats = {"ok": 0, "failed": 0, "errors": [], "seen": set()}

    def background(i: int) -> None:
        with httpx.Client(base_url=base, timeout=120) as c:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    r = c.post("/v1/chat/completions", json=chat_body("fam", f"Tell me a story, client {i} request {n}.", 16, temperature=0.7))
                    ok = r.status_code == 200
                    info = r.json().get("loopwise", {}).get("adapter") if ok else f"{r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    ok, info = False, repr(exc)
                with lock:
                    if ok:
                        stats["ok"] += 1
                        stats["seen"].add(info)
                    else:
                        stats["failed"] += 1
                        stats["errors"].append(info)

    latencies, versions = [], [first]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        futs = [pool.submit(background, i) for i in range(clients)]
        try:
            time.sleep(3.0)  # let the load reach steady state
            with httpx.Client(base_url=base, timeout=120) as poll:
                for k in range(swaps):
                    c0 = time.perf_counter()
                    poll.post("/v1/chat/completions", json=chat_body("fam", "ping", 1, temperature=0)).raise_for_status()
                    control = time.perf_counter() - c0
                    t0 = time.perf_counter()
                    name = load_adapter(base, paths[(k + 1) % len(paths)], "fam", alias=False)
                    t_loaded = time.perf_counter()
                    flip = poll.put("/admin/aliases/fam", json={"target": name}, headers=AUTH)
                    flip.raise_for_status()
                    t_flipped = time.perf_counter()
                    polls = 0
                    while True:
                        polls += 1
                        r = poll.post("/v1/chat/completions", json=chat_body("fam", "ping", 1, temperature=0))
                        r.raise_for_status()
                        if r.json()["loopwise"]["adapter"] == name:
                            break
                    t_seen = time.perf_counter()
                    versions.append(name)
                    latencies.append(
                        {
                            "version": name,
                            "total_s": t_seen - t0,
                            "load_s": t_loaded - t0,
                            "flip_s": t_flipped - t_loaded,
                            "first_response_s": t_seen - t_flipped,
                            "polls": polls,
                            "control_s": control,
                        }
                    )
                    print(
                        f"  swap to {name}: {t_seen - t0:.3f}s (load {t_loaded - t0:.3f}s, flip {t_flipped - t_loaded:.3f}s, first response "
                        f"{t_seen - t_flipped:.3f}s, {polls} polls); control request without a swap {control:.3f}s",
                        flush=True,
                    )
                    time.sleep(1.0)
        finally:
            stop.set()
            for f in futs:
                f.result()
    totals = [x["total_s"] for x in latencies]
    return {
        "clients": clients,
        "swaps": latencies,
        "median_s": statistics.median(totals),
        "control_median_s": statistics.median(x["control_s"] for x in latencies),
        "max_s": max(totals),
        "background_ok": stats["ok"],
        "background_failed": stats["failed"],
        "background_errors": stats["errors"][:10],
        "versions_seen": sorted(stats["seen"], key=str),
        "versions": versions,
    }


async def run_load(base: str, models: list[str], texts: list[str], clients: int, max_tokens: int) -> dict:
    """Like bench/serving.run_load, with request i going to ``models[i % len(models)]``."""
    sem = asyncio.Semaphore(clients)
    tokens = 0
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(i: int, text: str) -> None:
            nonlocal tokens
            async with sem:
                body = chat_body(models[i % len(models)], text, max_tokens, temperature=0, ignore_eos=True)
                r = await client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                assert r.json()["loopwise"]["adapter"] == (None if models[i % len(models)] == "m" else models[i % len(models)])
                tokens += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
        wall = time.perf_counter() - t0
    return {"requests": len(texts), "completion_tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 1)}


def engine_load_times(log: Path) -> list[tuple[float, float]]:
    """(prepare, attach wait) seconds of each adapter load, from the embedded engine's log lines."""
    pat = re.compile(r"prepared in ([\d.]+)s, attached ([\d.]+)s later")
    return [(float(m.group(1)), float(m.group(2))) for m in map(pat.search, log.read_text().splitlines()) if m]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=48, help="requests per throughput round")
    ap.add_argument("--rounds", type=int, default=2, help="throughput rounds each way (alternating); 0: swap latency only")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--swaps", type=int, default=5)
    ap.add_argument("--data-dir", default=str(ROOT / ".data"), help="where the model cache is (the server records into a temp dir)")
    args = ap.parse_args()

    from runtime.model_store import resolve_model

    model_path = resolve_model(args.model, Path(args.data_dir) / "models")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"model": str(model_path), "clients": args.clients, "new_tokens": args.new_tokens}

    with tempfile.TemporaryDirectory(prefix="loopwise-bench-adapters-") as tmp:
        root = Path(tmp) / "adapters"
        t0 = time.perf_counter()
        paths = build_adapters(model_path, root, n=6)
        print(f"built {len(paths)} adapters (r=8, {'/'.join(TARGETS)}) in {time.perf_counter() - t0:.1f}s", flush=True)
        cmd = [
            sys.executable,
            "serve.py",
            "--model",
            str(model_path),
            "--served-model-name",
            "m",
            "--admin-key",
            ADMIN,
            "--adapter-root",
            str(root),
            "--data-dir",
            str(Path(tmp) / "data"),
            "--port",
            "0",
            "--log-level",
            "info",
        ]
        proc, base = start_process(cmd, lambda line: (m := re.search(r"on (http://[\d.]+:\d+)/v1", line)) and m.group(1), out_dir / "adapters.log")
        try:
            # 1: hot swap under load
            print(f"swap latency under {args.clients}-client load:", flush=True)
            results["swap"] = swap = swap_latency(base, paths, args.swaps, args.clients)
            print(f"  background: {swap['background_ok']} ok, {swap['background_failed']} failed; versions seen {swap['versions_seen']}", flush=True)

            # 2: base vs single adapter vs mixed (up to 4 adapters + base)
            loaded = swap["versions"][:4]  # fam@1 was the first, the others came with the swaps (all still loaded)
            loads = {"base": ["m"], "single": loaded[:1], "mixed": [*loaded, "m"]}
            texts = prompts(args.requests)
            if args.rounds:
                asyncio.run(run_load(base, loads["mixed"], prompts(10), args.clients, 4))  # warm-up: every adapter and the base
            rounds: dict[str, list[dict]] = {label: [] for label in loads}
            for k in range(args.rounds):
                for label, models in loads.items():
                    res = asyncio.run(run_load(base, models, texts, args.clients, args.new_tokens))
                    rounds[label].append(res)
                    print(f"  round {k + 1} {label:6s}: {res}", flush=True)
            results["throughput"] = {
                label: {"rounds": rs, "median_tok_s": statistics.median(r["tok_s"] for r in rs), "models": loads[label]}
                for label, rs in rounds.items()
                if rs
            }
        finally:
            stop_process(proc)

    swap, tp = results["swap"], results["throughput"]
    print(
        f"\nmodel: {model_path.name}  clients: {args.clients}  requests/round: {args.requests}  rounds: {args.rounds}  "
        f"new tokens: {args.new_tokens}  swaps: {args.swaps}  cores: {os.cpu_count()}"
    )
    print(f"{'measure':48s} {'value':>12s} {'target|base':>12s} {'ratio':>8s}")
    print(f"{'swap latency median (POST → first new answer)':48s} {swap['median_s'] * 1000:10.1f}ms {'≤ 1000.0ms':>12s} {swap['median_s']:8.2f}")
    print(f"{'swap latency max':48s} {swap['max_s'] * 1000:10.1f}ms {'≤ 1000.0ms':>12s} {swap['max_s']:8.2f}")
    control = swap["control_median_s"]
    print(
        f"{'swap latency median vs 1-token request, no swap':48s} {swap['median_s'] * 1000:10.1f}ms {control * 1000:10.1f}ms {swap['median_s'] / control:8.2f}"
    )
    if times := engine_load_times(out_dir / "adapters.log"):
        prep, attach = statistics.median(x[0] for x in times), statistics.median(x[1] for x in times)
        print(f"{'engine: prepare off-thread / attach wait (median)':48s} {prep * 1000:10.1f}ms {attach * 1000:10.1f}ms {'':>8s}")
    total = swap["background_ok"] + swap["background_failed"]
    print(f"{f'failed background requests during swaps (of {total})':48s} {swap['background_failed']:12d} {'0':>12s} {'':>8s}")
    if tp:
        base_tps, single_tps, mixed_tps = tp["base"]["median_tok_s"], tp["single"]["median_tok_s"], tp["mixed"]["median_tok_s"]
        results["mixed_over_single"] = mixed_tps / single_tps
        results["single_over_base"] = single_tps / base_tps
        print(f"{'mixed (4 adapters + base) vs single adapter tok/s':48s} {mixed_tps:12.1f} {single_tps:12.1f} {results['mixed_over_single']:8.2f}")
        print(f"{'single adapter vs base model tok/s':48s} {single_tps:12.1f} {base_tps:12.1f} {results['single_over_base']:8.2f}")
        print(f"   (target mixed / single ≥ 0.80, single / base close to 1; medians of {args.rounds} alternating rounds each)")
    (out_dir / "adapters.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
