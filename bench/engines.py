"""Engines side by side on SmolLM2: embedded vs vLLM through loopwise vs vLLM directly, one vs two vLLM replicas, hot swap.

    make vllm && .venv/bin/python bench/engines.py                 # SmolLM2, 16 clients, 64 new tokens, 6 rounds
    .venv/bin/python bench/engines.py --rounds 3 --skip-scaling    # shorter

Starts two vLLM servers (``runtime/vllm_launcher.py``, the flags ``--vllm-launch`` uses; on a 2-core host
one core each) and the loopwise servers it compares, all on the same model folder and dtype:

1. **overhead**: the same 16 conversations, greedy, 64 new tokens (``ignore_eos``), through
   ``serve.py --backend embedded``, through ``serve.py --backend vllm --engine-url V1`` (templating,
   routing, recording with logprobs) and straight to V1's ``/v1/completions`` with the token ids loopwise
   would send (checked against loopwise's ``usage.prompt_tokens``) and the same return options. Each
   round sends 16 concurrent requests to one side, then the next, the order rotating round by round, so
   machine noise hits all sides alike. Printed: p50/p95 latency and completion tokens/s per side; the
   loopwise-vs-direct p50 ratio (target ≤ 1.10);
2. **scaling**: ``serve.py --backend vllm`` on V1 alone vs on V1 + V2 (two replicas), same rounds;
   tokens/s ratio (the embedded server is stopped first, to leave the cores to vLLM);
3. **hot swap**: on the two-replica server, ``--swaps`` times: POST a new adapter version (r=8,
   q/k/v/o_proj) with ``alias: true`` while 16 clients keep the base model busy, and time until the
   first answer through the alias comes from the new version (target ≤ 1 s).

Results also go to bench/results/engines.json, with ``uptime``'s load averages. Not a test.
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
ADMIN = "bench-admin"
MAX_ADAPTERS = 4  # LoRA slots of each vLLM server (--max-loras, --max-cpu-loras) and loopwise's --max-loaded-adapters


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def start_loopwise(args: argparse.Namespace, model: Path, work: Path, name: str, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    data = work / name
    data.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "serve.py", "--model", str(model), "--served-model-name", "m", "--port", "0", "--data-dir", str(data)]
    cmd += ["--no-learner", "--no-builtin-agents", "--log-level", "warning", "--admin-key", ADMIN, "--adapter-root", str(work / "adapters")]
    cmd += ["--dtype", args.dtype, "--max-loaded-adapters", str(MAX_ADAPTERS), *extra]  # as many as each vLLM server holds
    with open(data / "loopwise.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"serve.py exited early; see {data / 'loopwise.log'}")
        if m := re.search(r"on (http://[\d.]+:\d+)/v1", line):
            return proc, m.group(1)
    raise TimeoutError("serve.py did not start")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def via_loopwise(client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int, model: str = "m") -> tuple[float, int, int, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = await client.post(base + "/v1/chat/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    return dt, out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"], str((out.get("loopwise") or {}).get("adapter"))


async def direct(client: httpx.AsyncClient, url: str, served: str, ids: list[int], max_tokens: int) -> tuple[float, int, int, str]:
    body = {  # what loopwise's vLLM engine sends for a recorded, greedy request
        "model": served,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "top_p": 1.0,
        "top_k": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json()["usage"]
    return dt, usage["prompt_tokens"], usage["completion_tokens"], ""


async def rounds(sides: dict, n_rounds: int) -> dict:
    """``sides``: name → a coroutine factory running one 16-client round; returns per-side latency and tok/s."""
    lat: dict[str, list[float]] = {s: [] for s in sides}
    tokens = dict.fromkeys(sides, 0)
    wall = dict.fromkeys(sides, 0.0)
    names = list(sides)
    for rnd in range(n_rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for side in order:
            t0 = time.perf_counter()
            res = await sides[side]()
            wall[side] += time.perf_counter() - t0
            lat[side] += [r[0] for r in res]
            tokens[side] += sum(r[2] for r in res)
    return {s: {"p50_s": statistics.median(lat[s]), "p95_s": pct(lat[s], 0.95), "tok_s": tokens[s] / wall[s], "requests": len(lat[s])} for s in sides}


def make_adapters(model: Path, root: Path, n: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    base = AutoModelForCausalLM.from_pretrained(model)
    for k in range(n):
        torch.manual_seed(100 + k)
        peft = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        peft.save_pretrained(root / f"swap{k}")
        base = peft.unload()
        out.append(root / f"swap{k}")
    return out


async def hot_swaps(base: str, convs: list[list[dict]], adapters: list[Path]) -> list[float]:
    """Swap ``swap@k`` in as the alias while 16 clients load the base model; seconds from POST to the first answer from it."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    out = []
    stop_load = asyncio.Event()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:

        async def load_client(conv: list[dict]) -> None:
            while not stop_load.is_set():
                await via_loopwise(client, base, conv, 16)

        background = [asyncio.create_task(load_client(c)) for c in convs]
        await asyncio.sleep(2.0)
        for path in adapters:
            t0 = time.perf_counter()
            r = await client.post(base + "/admin/adapters", json={"path": str(path), "family": "swap", "alias": True}, headers=auth)
            r.raise_for_status()
            version = r.json()["name"]
            while True:
                _, _, _, adapter = await via_loopwise(client, base, convs[0], 1, model="swap")
                if adapter == version:
                    break
            out.append(time.perf_counter() - t0)
        stop_load.set()
        await asyncio.gather(*background)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="'default' (SmolLM2) or a local model folder")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="for every engine")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--swaps", type=int, default=5)
    ap.add_argument("--kv-cache", default="256M", help="vLLM KV cache per server")
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--data-dir", default=str(ROOT / ".data"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from runtime.launcher import start_all
    from runtime.model_store import resolve_model
    from runtime.settings import VLLMSettings
    from runtime.vllm_launcher import vllm_launchers

    model = resolve_model(args.model, Path(args.data_dir) / "models") if args.model in ("tiny", "default") else Path(args.model)
    work = Path(tempfile.mkdtemp(prefix="engines-bench-"))
    (work / "adapters").mkdir()
    tok = AutoTokenizer.from_pretrained(model)
    convs = [[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}. Request {i}."}] for i in range(args.clients)]
    ids = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)) for c in convs]
    adapters = make_adapters(model, work / "adapters", args.swaps) if args.swaps else []
    settings = VLLMSettings(kv_cache=args.kv_cache, replicas=2)  # as --vllm-launch --vllm-replicas 2: one core each on 2 cores
    launchers = vllm_launchers(settings, model, served_name="m", max_lora_rank=8, max_loaded_adapters=MAX_ADAPTERS, dtype=args.dtype)
    print(f"starting 2 vLLM servers ({args.dtype}, KV cache {args.kv_cache} each), log in {work}", flush=True)
    v1, v2 = start_all(launchers)
    procs: list[subprocess.Popen[str]] = []
    res: dict = {"model": str(model), "dtype": args.dtype, "clients": args.clients, "max_tokens": args.max_tokens, "rounds": args.rounds}
    try:
        emb, emb_url = start_loopwise(args, model, work, "embedded", [])
        one, one_url = start_loopwise(args, model, work, "vllm-1", ["--backend", "vllm", "--engine-url", v1])
        procs += [emb, one]

        async def overhead() -> dict:
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
                check = await asyncio.gather(*(via_loopwise(client, one_url, c, 2) for c in convs))
                await asyncio.gather(*(via_loopwise(client, emb_url, c, 2) for c in convs))
                await asyncio.gather(*(direct(client, v1, "m", i, 2) for i in ids))
                same = all(p == len(ids[k]) for k, (_, p, _, _) in enumerate(check))
                out = await rounds(
                    {
                        "embedded": lambda: asyncio.gather(*(via_loopwise(client, emb_url, c, args.max_tokens) for c in convs)),
                        "vllm_loopwise": lambda: asyncio.gather(*(via_loopwise(client, one_url, c, args.max_tokens) for c in convs)),
                        "vllm_direct": lambda: asyncio.gather(*(direct(client, v1, "m", i, args.max_tokens) for i in ids)),
                    },
                    args.rounds,
                )
                out["same_prompt_tokens"] = same
                return out

        res["load_before"] = load_average()
        res["overhead"] = asyncio.run(overhead())
        o = res["overhead"]
        o["p50_ratio_loopwise_vs_direct"] = o["vllm_loopwise"]["p50_s"] / o["vllm_direct"]["p50_s"]
        o["tok_s_ratio_vllm_vs_embedded"] = o["vllm_loopwise"]["tok_s"] / o["embedded"]["tok_s"]
        print(f"partial, overhead (load {load_average()}): {json.dumps(o)}", flush=True)  # a run cut short still reports
        stop(emb)
        procs.remove(emb)
        two, two_url = start_loopwise(args, model, work, "vllm-2", ["--backend", "vllm", "--engine-url", v1, "--engine-url", v2])
        procs.append(two)
        if not args.skip_scaling:

            async def scaling() -> dict:
                async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
                    await asyncio.gather(*(via_loopwise(client, two_url, c, 2) for c in convs))
                    return await rounds(
                        {
                            "one_replica": lambda: asyncio.gather(*(via_loopwise(client, one_url, c, args.max_tokens) for c in convs)),
                            "two_replicas": lambda: asyncio.gather(*(via_loopwise(client, two_url, c, args.max_tokens) for c in convs)),
                        },
                        args.rounds,
                    )

            res["scaling"] = asyncio.run(scaling())
            s = res["scaling"]
            s["tok_s_ratio"] = s["two_replicas"]["tok_s"] / s["one_replica"]["tok_s"]
            print(f"partial, scaling (load {load_average()}): {json.dumps(s)}", flush=True)
        if adapters:
            swaps = asyncio.run(hot_swaps(two_url, convs, adapters))
            res["hot_swap_s"] = {"each": swaps, "median": statistics.median(swaps), "max": max(swaps)}
        res["load_after"] = load_average()
    finally:
        for proc in procs:
            stop(proc)
        for launcher in launchers:
            launcher.stop()
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "engines.json").write_text(json.dumps(res, indent=2))

    o = res["overhead"]
    print(f"model {model.name} ({args.dtype}); {args.clients} clients x {args.rounds} rounds per side, {args.max_tokens} new tokens")
    print(f"load average before {res['load_before']}, after {res['load_after']}; same prompt tokens: {o['same_prompt_tokens']}")
    print(f"{'side':28s} {'p50':>9s} {'p95':>9s} {'tok/s':>8s}")
    for side in ("embedded", "vllm_loopwise", "vllm_direct"):
        print(f"{side:28s} {o[side]['p50_s'] * 1000:7.0f}ms {o[side]['p95_s'] * 1000:7.0f}ms {o[side]['tok_s']:8.1f}")
    print(f"loopwise overhead on vLLM, p50 ratio: {o['p50_ratio_loopwise_vs_direct']:.3f} (target <= 1.10)")
    print(f"vLLM through loopwise vs embedded, tok/s ratio: {o['tok_s_ratio_vllm_vs_embedded']:.3f}")
    if "scaling" in res:
        s = res["scaling"]
        for side in ("one_replica", "two_replicas"):
            print(f"{side:28s} {s[side]['p50_s'] * 1000:7.0f}ms {s[side]['p95_s'] * 1000:7.0f}ms {s[side]['tok_s']:8.1f}")
        print(f"two replicas vs one, tok/s ratio: {s['tok_s_ratio']:.3f}")
    if "hot_swap_s" in res:
        h = res["hot_swap_s"]
        print(
            f"hot swap into vLLM (2 replicas, 16-client load): median {h['median']:.3f}s, max {h['max']:.3f}s over {len(h['each'])} (target <= 1 s)"
        )


if __name__ == "__main__":
    main()
