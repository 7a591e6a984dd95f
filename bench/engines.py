"""Engines one after another on the same model folder and dtype (SmolLM2): embedded, vLLM and SGLang.

    .venv/bin/python bench/engines.py                              # SmolLM2, 16 clients, 64 new tokens, 6 rounds, 5 swaps
    .venv/bin/python bench/engines.py --engines embedded sglang --rounds 1 --clients 4 --max-tokens 16 --swaps 2   # smoke

``--engines`` (default: embedded plus every external engine whose virtualenv is installed, ``make vllm`` /
``make sglang``; naming one that is not installed is an error). Every round sends the same 16 conversations
at once (``--clients``), greedy, 64 new tokens (``ignore_eos``). On 2 cores each engine runs alone, its
servers stopped before the next starts (an idle SGLang scheduler polls a core), so the tok/s of different
engines come from different phases; within a phase the sides alternate round by round, so noise hits both:

1. **embedded**: ``serve.py --backend embedded``: p50/p95 latency, completion tok/s;
2. **vLLM**: two servers (``runtime/engines/vllm_launcher.py``, the flags ``--vllm-launch`` uses, one core each).
   Overhead: ``serve.py --backend vllm --engine-url V1`` (templating, routing, recording with logprobs) vs
   V1's ``/v1/completions`` with the token ids loopwise would send and the same return options; scaling:
   through loopwise on V1 alone vs V1 + V2 (tok/s ratio); hot swap on the two-replica server;
3. **SGLang**: one server (``runtime/engines/sglang_launcher.py``, the flags ``--sglang-launch`` uses: its CPU path
   here). Overhead: ``serve.py --backend sglang`` vs SGLang's ``/generate`` with the token ids loopwise would
   send (``bench/sglang_overhead.py``'s ``compare``); hot swap; logprobs: a turn of 32 tokens per conversation at T = 1 and
   T = 0.7 recorded through loopwise, then, SGLang stopped, their output ids re-scored by the learner's trainer
   (``LoRATrainer.token_logprobs``, in ``--dtype``, no autocast) against SGLang's logprobs: max and mean |diff|.

Overhead targets: loopwise-vs-direct p50 ratio ≤ 1.10 (prompt lengths checked against loopwise's
``usage.prompt_tokens``). Hot swap: ``--swaps`` times, POST a new adapter version (r=8, q/k/v/o_proj) with
``alias: true`` while 16 clients keep the base model busy; seconds until the first answer through the alias
comes from the new version (target ≤ 1 s); on vLLM each swap is followed by the same swap straight into the
replicas (load on each, a one-token completion naming it), the floor under the same load. Results go to
bench/results/engines.json after each phase, with load averages; the launched servers' logs to the work folder
printed first. Not a test.
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

from bench.sglang_overhead import compare as sglang_compare  # noqa: E402
from bench.sglang_overhead import conversations  # noqa: E402

ENGINES = ("embedded", "vllm", "sglang")
ADMIN = "bench-admin"
MAX_ADAPTERS = 4  # LoRA slots of each vLLM server (--max-loras, --max-cpu-loras) and loopwise's --max-loaded-adapters
LOGPROB_TOKENS = 32
LOGPROB_TEMPERATURES = (1.0, 0.7)


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


async def hot_swaps(base: str, convs: list[list[dict]], adapters: list[Path], vllm: tuple[list[str], list[int]] | None = None) -> dict:
    """Swap ``swap@k`` in as the alias while 16 clients load the base model: per swap, seconds from POST to the first
    answer from it, and the POST's own share (the adapter loaded into every replica). With ``vllm`` (the replicas'
    URLs and the first conversation's prompt ids), each swap is followed by the same swap straight into vLLM under
    the same load, as an operator without loopwise would do it: ``/v1/load_lora_adapter`` on every replica at once,
    then a one-token ``/v1/completions`` naming the adapter (replicas in turn): the floor loopwise sits on."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    out: dict[str, list[tuple[float, float]]] = {"loopwise": [], "direct": []}
    stop_load = asyncio.Event()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:

        async def load_client(conv: list[dict]) -> None:
            while not stop_load.is_set():
                await via_loopwise(client, base, conv, 16)

        background = [asyncio.create_task(load_client(c)) for c in convs]
        await asyncio.sleep(2.0)
        for k, path in enumerate(adapters):
            t0 = time.perf_counter()
            r = await client.post(base + "/admin/adapters", json={"path": str(path), "family": "swap", "alias": True}, headers=auth)
            r.raise_for_status()
            posted = time.perf_counter() - t0
            version = r.json()["name"]
            while True:
                _, _, _, adapter = await via_loopwise(client, base, convs[0], 1, model="swap")
                if adapter == version:
                    break
            out["loopwise"].append((time.perf_counter() - t0, posted))
            if vllm is None:
                continue
            urls, prompt = vllm
            name = f"direct-swap-{k}"
            t0 = time.perf_counter()
            loads = await asyncio.gather(*(client.post(u + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}) for u in urls))
            for resp in loads:
                resp.raise_for_status()
            posted = time.perf_counter() - t0
            await direct(client, urls[k % len(urls)], name, prompt, 1)
            out["direct"].append((time.perf_counter() - t0, posted))
            for u in urls:  # vLLM forgets the name (its engine's LRU cache drops the weights when it needs the slot)
                (await client.post(u + "/v1/unload_lora_adapter", json={"lora_name": name})).raise_for_status()
        stop_load.set()
        await asyncio.gather(*background)
    return out


def installed(engine: str) -> bool:
    """``make vllm`` / ``make sglang`` finished (the virtualenv's stamp is there), as the engine tests check."""
    from runtime.settings import default_sglang_venv, default_vllm_venv

    if engine == "embedded":
        return True
    venv = default_vllm_venv() if engine == "vllm" else default_sglang_venv()
    return (venv / "bin" / "python").exists() and any(venv.glob(".installed-*"))


def side_stats(out: dict, loopwise: str, direct: str) -> dict:
    """``rounds``'s two sides as ``{"loopwise", "direct"}`` with their ratios (``sglang_overhead.compare``'s shape)."""
    res = {"loopwise": out[loopwise], "direct": out[direct]}
    for key, field in (("p50_ratio", "p50_s"), ("p95_ratio", "p95_s"), ("tok_s_ratio", "tok_s")):
        res[key] = res["loopwise"][field] / res["direct"][field]
    return res


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64))


def embedded_phase(args: argparse.Namespace, model: Path, work: Path, convs: list[list[dict]]) -> dict:
    proc, url = start_loopwise(args, model, work, "embedded", [])
    try:

        async def go() -> dict:
            async with client() as c:
                await asyncio.gather(*(via_loopwise(c, url, conv, 2) for conv in convs))
                return (
                    await rounds({"embedded": lambda: asyncio.gather(*(via_loopwise(c, url, conv, args.max_tokens) for conv in convs))}, args.rounds)
                )["embedded"]

        return asyncio.run(go())
    finally:
        stop(proc)


def vllm_phase(args: argparse.Namespace, model: Path, work: Path, convs: list[list[dict]], ids: list[list[int]], adapters: list[Path]) -> dict:
    from runtime.engines.launcher import start_all
    from runtime.engines.vllm_launcher import vllm_launchers
    from runtime.settings import VLLMSettings

    settings = VLLMSettings(kv_cache=args.kv_cache, replicas=2)  # as --vllm-launch --vllm-replicas 2: one core each on 2 cores
    launchers = vllm_launchers(settings, model, served_name="m", max_lora_rank=8, max_loaded_adapters=MAX_ADAPTERS, dtype=args.dtype)
    print(f"vLLM: starting 2 servers ({args.dtype}, KV cache {args.kv_cache} each)", flush=True)
    v1, v2 = start_all(launchers)
    procs: list[subprocess.Popen[str]] = []
    res: dict = {}
    try:
        one, one_url = start_loopwise(args, model, work, "vllm-1", ["--backend", "vllm", "--engine-url", v1])
        procs.append(one)

        async def overhead() -> dict:
            async with client() as c:
                check = await asyncio.gather(*(via_loopwise(c, one_url, conv, 2) for conv in convs))
                await asyncio.gather(*(direct(c, v1, "m", i, 2) for i in ids))
                out = await rounds(
                    {
                        "loopwise": lambda: asyncio.gather(*(via_loopwise(c, one_url, conv, args.max_tokens) for conv in convs)),
                        "direct": lambda: asyncio.gather(*(direct(c, v1, "m", i, args.max_tokens) for i in ids)),
                    },
                    args.rounds,
                )
                return {**side_stats(out, "loopwise", "direct"), "same_prompt_tokens": all(p == len(ids[k]) for k, (_, p, _, _) in enumerate(check))}

        res["overhead"] = asyncio.run(overhead())
        print(f"partial, vLLM overhead (load {load_average()}): {json.dumps(res['overhead'])}", flush=True)
        two, two_url = start_loopwise(args, model, work, "vllm-2", ["--backend", "vllm", "--engine-url", v1, "--engine-url", v2])
        procs.append(two)
        if not args.skip_scaling:

            async def scaling() -> dict:
                async with client() as c:
                    await asyncio.gather(*(via_loopwise(c, two_url, conv, 2) for conv in convs))
                    return await rounds(
                        {
                            "one_replica": lambda: asyncio.gather(*(via_loopwise(c, one_url, conv, args.max_tokens) for conv in convs)),
                            "two_replicas": lambda: asyncio.gather(*(via_loopwise(c, two_url, conv, args.max_tokens) for conv in convs)),
                        },
                        args.rounds,
                    )

            s = res["scaling"] = asyncio.run(scaling())
            s["tok_s_ratio"] = s["two_replicas"]["tok_s"] / s["one_replica"]["tok_s"]
            print(f"partial, vLLM scaling (load {load_average()}): {json.dumps(s)}", flush=True)
        if adapters:
            swaps = asyncio.run(hot_swaps(two_url, convs, adapters, ([v1, v2], ids[0])))
            res["hot_swap_s"], res["direct_hot_swap_s"] = swap_stats(swaps["loopwise"]), swap_stats(swaps["direct"])
        res["load"] = load_average()
        return res
    finally:
        for proc in procs:
            stop(proc)
        for launcher in launchers:
            launcher.stop()


async def record_turns(base: str, convs: list[list[dict]], temperature: float) -> list[dict]:
    """One turn per conversation through loopwise at ``temperature`` (``LOGPROB_TOKENS``, ``ignore_eos``), as recorded."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with client() as c:

        async def one(conv: list[dict]) -> dict:
            body = {"model": "m", "messages": conv, "max_tokens": LOGPROB_TOKENS, "temperature": temperature, "ignore_eos": True}
            r = await c.post(base + "/v1/chat/completions", json=body)
            r.raise_for_status()
            trajectory = r.json()["loopwise"]["trajectory_id"]
            for _ in range(200):  # recording is asynchronous
                t = await c.get(f"{base}/admin/trajectories/{trajectory}", headers=auth)
                if t.status_code == 200:
                    [turn] = t.json()["turns"]
                    return {"context_ids": turn["context_ids"], "output_ids": turn["output_ids"], "logprobs": turn["logprobs"]}
                await asyncio.sleep(0.1)
            raise RuntimeError(f"trajectory {trajectory} was not recorded")

        return list(await asyncio.gather(*(one(conv) for conv in convs)))


def rescore(model: Path, dtype: str, recorded: dict[float, list[dict]]) -> dict:
    """The trainer's logprobs of the recorded output ids (``LoRATrainer.token_logprobs``, base model) vs the engine's."""
    from learner.config import LoRAConfig, TrainerConfig
    from learner.samples import Sample
    from learner.trainer import LoRATrainer

    trainer = LoRATrainer(
        model,
        TrainerConfig(threads=os.cpu_count() or 1, progress=False, dtype=dtype, autocast="off"),
        LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj"]),
    )
    out: dict = {"trainer": f"LoRATrainer.token_logprobs, {dtype}, autocast off", "tokens_per_turn": LOGPROB_TOKENS}
    for temperature, turns in recorded.items():
        samples = [
            Sample(
                turn_id=f"t{k}",
                trajectory_id=f"tr{k}",
                group_id="g",
                turn_index=0,
                context_ids=t["context_ids"],
                output_ids=t["output_ids"],
                logprobs=[],
                loss_mask=[1] * len(t["output_ids"]),
                adapter=None,
                adapter_version=0,
                reward=1.0,
                trajectory_reward=None,
                temperature=temperature,
                created_at=0.0,
            )
            for k, t in enumerate(turns)
        ]
        diffs = [
            abs(a - b)
            for row, t in zip(trainer.token_logprobs(samples, adapter=False), turns, strict=True)
            for a, b in zip(row, t["logprobs"], strict=True)
        ]
        out[f"T={temperature}"] = {"max_abs": max(diffs), "mean_abs": statistics.fmean(diffs), "turns": len(turns), "tokens": len(diffs)}
    return out


def sglang_phase(args: argparse.Namespace, model: Path, work: Path, convs: list[list[dict]], ids: list[list[int]], adapters: list[Path]) -> dict:
    from runtime.engines.sglang_launcher import SGLangLauncher, resolve_device
    from runtime.settings import SGLangSettings

    settings = SGLangSettings(max_total_tokens=args.sglang_kv_tokens)  # the Python of `make sglang`'s virtualenv; its CPU path where no CUDA
    launcher = SGLangLauncher(settings, model, max_lora_rank=8, max_loaded_adapters=MAX_ADAPTERS, dtype=args.dtype)
    print(f"SGLang: starting 1 server ({args.dtype}, {resolve_device(settings.device)}, {launcher.python})", flush=True)
    url = launcher.start()
    proc = None
    res: dict = {}
    recorded: dict[float, list[dict]] = {}
    try:
        proc, base = start_loopwise(args, model, work, "sglang", ["--backend", "sglang", "--sglang-url", url])

        async def overhead() -> dict:
            async with client() as c:
                return await sglang_compare(c, base, url, convs, ids, args.rounds, args.max_tokens)

        res["overhead"] = asyncio.run(overhead())
        print(f"partial, SGLang overhead (load {load_average()}): {json.dumps(res['overhead'])}", flush=True)
        if adapters:
            res["hot_swap_s"] = swap_stats(asyncio.run(hot_swaps(base, convs, adapters))["loopwise"])
        for temperature in LOGPROB_TEMPERATURES:
            recorded[temperature] = asyncio.run(record_turns(base, convs, temperature))
        res["load"] = load_average()
    finally:
        if proc is not None:
            stop(proc)
        launcher.stop()
    res["logprobs"] = rescore(model, args.dtype, recorded)  # with SGLang stopped: the cores are the trainer's
    return res


def swap_stats(swaps: list[tuple[float, float]]) -> dict:
    total, post = [t for t, _ in swaps], [p for _, p in swaps]
    return {"each": total, "median": statistics.median(total), "max": max(total), "post_each": post, "post_median": statistics.median(post)}


def report(res: dict) -> None:
    print(
        f"model {Path(res['model']).name} ({res['dtype']}); {res['clients']} clients x {res['rounds']} rounds per side, {res['max_tokens']} new tokens"
    )
    print(f"load average before {res['load_before']}, after {res.get('load_after')}")
    print(f"{'side':28s} {'p50':>9s} {'p95':>9s} {'tok/s':>8s}")

    def row(name: str, side: dict) -> None:
        print(f"{name:28s} {side['p50_s'] * 1000:7.0f}ms {side['p95_s'] * 1000:7.0f}ms {side['tok_s']:8.1f}")

    if "embedded" in res:
        row("embedded", res["embedded"])
    for engine, label in (("vllm", "vLLM"), ("sglang", "SGLang")):
        if "overhead" not in res.get(engine, {}):
            continue
        o = res[engine]["overhead"]
        row(f"{engine} through loopwise", o["loopwise"])
        row(f"{engine} direct", o["direct"])
        print(
            f"  loopwise overhead on {label}, p50 ratio {o['p50_ratio']:.3f} (target <= 1.10), p95 ratio {o['p95_ratio']:.3f}; same prompt tokens: {o['same_prompt_tokens']}"
        )
        if "embedded" in res:
            print(f"  {label} through loopwise vs embedded, tok/s ratio {o['loopwise']['tok_s'] / res['embedded']['tok_s']:.3f} (separate phases)")
    if "scaling" in res.get("vllm", {}):
        s = res["vllm"]["scaling"]
        row("vllm one replica", s["one_replica"])
        row("vllm two replicas", s["two_replicas"])
        print(f"  two vLLM replicas vs one, tok/s ratio {s['tok_s_ratio']:.3f}")
    for engine, label in (("vllm", "vLLM (2 replicas)"), ("sglang", "SGLang (1 server)")):
        if "hot_swap_s" in res.get(engine, {}):
            h = res[engine]["hot_swap_s"]
            print(
                f"hot swap into {label}, {res['clients']}-client load: median {h['median']:.3f}s, max {h['max']:.3f}s over {len(h['each'])} (target <= 1 s);"
                f" of it the POST (loading every replica): median {h.get('post_median', float('nan')):.3f}s"
            )
            if "direct_hot_swap_s" in res[engine]:
                d = res[engine]["direct_hot_swap_s"]
                print(
                    f"  the same swaps straight into vLLM, same load: median {d['median']:.3f}s, max {d['max']:.3f}s (load on every replica:"
                    f" median {d['post_median']:.3f}s); loopwise / direct median {h['median'] / d['median']:.2f}"
                )
    if "logprobs" in res.get("sglang", {}):
        lp = res["sglang"]["logprobs"]
        for temperature in LOGPROB_TEMPERATURES:
            d = lp[f"T={temperature}"]
            print(
                f"trainer vs SGLang logprobs at T={temperature}: max |diff| {d['max_abs']:.2e}, mean {d['mean_abs']:.2e} over {d['tokens']} tokens ({lp['trainer']})"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=None, help="default: embedded and every external engine installed")
    ap.add_argument("--model", default="default", help="'default' (SmolLM2) or a local model folder")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="for every engine")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--swaps", type=int, default=5)
    ap.add_argument("--kv-cache", default="256M", help="vLLM KV cache per server")
    ap.add_argument("--sglang-kv-tokens", type=int, default=None, help="SGLang --max-total-tokens (default: the launcher's, 16384 on CPU)")
    ap.add_argument("--skip-scaling", action="store_true", help="leave out vLLM's one-vs-two replicas")
    ap.add_argument("--data-dir", default=str(ROOT / ".data"))
    args = ap.parse_args()
    if args.engines is None:
        engines = [e for e in ENGINES if installed(e)]
    else:
        engines = [e for e in ENGINES if e in args.engines]
        if missing := [e for e in engines if not installed(e)]:
            ap.error("; ".join(f"{e} is not installed: `make {e}` installs it into its own virtualenv" for e in missing))

    import structlog
    from transformers import AutoTokenizer

    from runtime.model_store import resolve_model

    model = resolve_model(args.model, Path(args.data_dir) / "models") if args.model in ("tiny", "default") else Path(args.model)
    work = Path(tempfile.mkdtemp(prefix="engines-bench-"))
    (work / "adapters").mkdir()
    structlog.configure(logger_factory=structlog.WriteLoggerFactory(file=open(work / "launchers.log", "a")))  # the launched servers' output
    print(f"engines: {', '.join(engines)}; logs in {work}", flush=True)
    convs, ids = conversations(AutoTokenizer.from_pretrained(model), args.clients)
    external = [e for e in engines if e != "embedded"]
    adapters = make_adapters(model, work / "adapters", args.swaps) if args.swaps and external else []
    res: dict = {
        "model": str(model),
        "dtype": args.dtype,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "engines": engines,
    }
    res["load_before"] = load_average()
    out = ROOT / "bench" / "results" / "engines.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    phases = {"embedded": lambda: embedded_phase(args, model, work, convs), "vllm": lambda: vllm_phase(args, model, work, convs, ids, adapters)}
    phases["sglang"] = lambda: sglang_phase(args, model, work, convs, ids, adapters)
    for engine in engines:
        t0 = time.monotonic()
        res[engine] = phases[engine]()
        res[engine]["phase_s"] = time.monotonic() - t0
        res["load_after"] = load_average()
        out.write_text(json.dumps(res, indent=2))  # after each phase: a run cut short still reports
        print(f"{engine} done in {res[engine]['phase_s']:.0f}s (load {res['load_after']})", flush=True)
    report(res)


if __name__ == "__main__":
    main()
