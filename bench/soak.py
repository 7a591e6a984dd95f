"""Soak: honest clients keep their latency while a hostile client attacks, and nothing honest is lost.

    .venv/bin/python bench/soak.py                          # SmolLM2, 16 honest clients, 2 x 10 minutes
    .venv/bin/python bench/soak.py --minutes 3 --model tiny # a quick run

One real ``serve.py`` (four honest API keys, one hostile key, an admin key, no learner) serves the whole
run. Time is cut into rounds (``--round-s``, 60 s) that alternate *calm* (honest clients only) and
*hostile* (the same honest clients plus the hostile client), ``--minutes`` of each, so the machine's other
load hits both sides alike. Every round the admin hot-swaps the ``soak`` adapter family (a new random LoRA
version is loaded, the alias flips, the previous version is unloaded); a quarter of the honest requests
ask for ``soak``, the rest for the base model.

- Honest clients (``--clients``, 16) loop: a short chat completion (``max_tokens`` 16, sampled), and now and
  then feedback on their own turn. Their latencies, statuses and answered turn ids are kept.
- The hostile client runs ``--hostile-workers`` (4) loops of: malformed bodies (invalid, 10 000-deep and
  non-object JSON), a ``user`` of 100 000 characters, grammar bombs (a ``[a-z]{0,10000}`` pattern, a
  1000-branch ``anyOf``), a 4 MB prompt, feedback on the honest clients' turn ids (they are leaked to it,
  the worst case) and under ``verifier:`` sources, ``temperature`` 1e-50, ``n`` 16 floods, and branch runs.

Printed (and written to ``bench/results/soak.json``): honest p50 / p95 latency per side and the hostile /
calm ratios (target <= 1.2), honest 5xx count (target 0), answered honest turns missing from the store after
shutdown (target 0), the hostile client's status codes (any 5xx is a finding), and the server's RSS per
round (flat: the last rounds' median within 10% of the first's), with ``uptime``'s load at the start and end.
Not here: timed assertions (this prints figures); GPU runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HONEST_KEYS = [f"soak-honest-{i}" for i in range(4)]
HOSTILE_KEY, ADMIN_KEY = "soak-hostile", "soak-admin"
PROMPTS = ["Name a colour.", "What is 2 + 3?", "Say hello in French.", "Give me one word that rhymes with cat.", "What day follows Monday?"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def start_server(args: argparse.Namespace, data: Path) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, str(ROOT / "serve.py"), "--model", args.model, "--served-model-name", "base", "--port", "0", "--data-dir", str(data)]
    cmd += ["--no-learner"]
    cmd += ["--dtype", args.dtype, "--admin-key-file", str(data.parent / "admin.key")]
    env = {**os.environ, "LOOPWISE_API_KEYS": ",".join([*HONEST_KEYS, HOSTILE_KEY])}
    (data.parent / "admin.key").write_text(ADMIN_KEY + "\n")
    log = open(data.parent / "server.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"server exited: see {data.parent / 'server.log'}")
        if m := re.search(r"on (http://[\d.]+:\d+)/v1", line):
            return proc, m.group(1)
    raise TimeoutError("server did not start")


def make_adapter(model_dir: Path, out: Path, seed: int) -> None:
    """A random rank-4 LoRA on q/v for the served model (what a learner publishes, minus the learning)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.mul_(0.01)  # small: the adapter changes outputs a little, never to garbage
    model.save_pretrained(out)


class Stats:
    def __init__(self) -> None:
        self.latency: dict[str, list[float]] = {"calm": [], "hostile": []}
        self.status: dict[str, Counter[int]] = {"calm": Counter(), "hostile": Counter()}
        self.turns: list[str] = []
        self.hostile: Counter[str] = Counter()


async def honest(client: httpx.AsyncClient, i: int, stats: Stats, phase: dict[str, Any], stop: asyncio.Event, adapter_ready: asyncio.Event) -> None:
    rng = random.Random(i)
    key = HONEST_KEYS[i % len(HONEST_KEYS)]
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": f"honest-{i}"}
    while not stop.is_set():
        model = "soak" if adapter_ready.is_set() and rng.random() < 0.25 else "base"
        body = {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": 16, "temperature": 0.7}
        side = phase["side"]
        t0 = time.perf_counter()
        try:
            r = await client.post("/v1/chat/completions", json=body, headers=headers)
            status = r.status_code
        except httpx.HTTPError:
            status = 599
        dt = time.perf_counter() - t0
        if side == phase["side"]:  # a request that straddles a round change counts for neither side
            stats.status[side][status] += 1
            if status == 200:
                stats.latency[side].append(dt)
        if status == 200:
            turn = r.json()["loopwise"]["turn_id"]
            stats.turns.append(turn)
            if rng.random() < 0.2:  # honest feedback on its own turn (its latency is not the target; a 5xx would count)
                fb = await client.post("/v1/feedback", json={"turn_id": turn, "reward": 1.0, "source": "thumbs"}, headers=headers)
                if fb.status_code >= 500:
                    stats.status[side][fb.status_code] += 1


def _attacks(stats: Stats) -> list[tuple[str, str, Any]]:
    deep = "[" * 10_000 + "]" * 10_000
    bomb_pattern = {"type": "object", "properties": {"s": {"type": "string", "pattern": "[a-z]{0,10000}"}}, "required": ["s"]}
    any_of = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(1000)]}
    hello = [{"role": "user", "content": "hi"}]
    leaked = stats.turns[-1] if stats.turns else "turn-none"
    return [
        ("invalid_json", "/v1/chat/completions", b"{not json"),
        ("deep_json", "/v1/chat/completions", ('{"model": "base", "messages": ' + deep + "}").encode()),
        ("not_object", "/v1/chat/completions", b"[1, 2, 3]"),
        ("huge_user", "/v1/chat/completions", {"model": "base", "messages": hello, "user": "u" * 100_000}),
        ("grammar_pattern", "/v1/chat/completions", {"model": "base", "messages": hello, "max_tokens": 4,
                                                     "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": bomb_pattern}}}),
        ("grammar_anyof", "/v1/chat/completions", {"model": "base", "messages": hello, "max_tokens": 4,
                                                   "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": any_of}}}),
        ("huge_prompt", "/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "word " * 800_000}]}),
        ("tiny_temperature", "/v1/chat/completions", {"model": "base", "messages": hello, "max_tokens": 4, "temperature": 1e-50}),
        ("n_flood", "/v1/chat/completions", {"model": "base", "messages": hello, "max_tokens": 64, "n": 16}),
        ("foreign_feedback", "/v1/feedback", {"turn_id": leaked, "reward": 1e300}),
        ("forged_verifier", "/v1/feedback", {"turn_id": leaked, "reward": 1.0, "source": "verifier:calc_arith"}),
        ("branch", "/v1/agents/calc-agent/runs", {"problem_index": 0, "branch": {"prefix_outputs": [[1, 2, 3]], "context_sha256": "0" * 64}}),
    ]  # fmt: skip


async def hostile(client: httpx.AsyncClient, w: int, stats: Stats, phase: dict[str, Any], stop: asyncio.Event) -> None:
    rng = random.Random(1000 + w)
    headers = {"Authorization": f"Bearer {HOSTILE_KEY}"}
    while not stop.is_set():
        if phase["side"] != "hostile":
            await asyncio.sleep(0.2)
            continue
        name, path, body = rng.choice([a for a in _attacks(stats) if not phase["attacks"] or a[0] in phase["attacks"]])
        try:
            if isinstance(body, bytes):
                r = await client.post(path, content=body, headers={**headers, "content-type": "application/json"})
            else:
                r = await client.post(path, json=body, headers=headers)
            status = r.status_code
        except httpx.HTTPError:
            status = 599
        stats.hostile[f"{name}:{status}"] += 1


async def admin_swaps(
    client: httpx.AsyncClient, adapters: list[Path], round_s: float, stop: asyncio.Event, ready: asyncio.Event, swaps: list[float]
) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    loaded: list[str] = []
    k = 0
    while not stop.is_set():
        path = adapters[k % len(adapters)]
        t0 = time.perf_counter()
        r = await client.post("/admin/adapters", json={"path": str(path), "family": "soak", "alias": True}, headers=headers)
        if r.status_code == 200:
            name = r.json()["name"]
            await client.put("/admin/aliases/soak", json={"target": name}, headers=headers)
            swaps.append(time.perf_counter() - t0)
            ready.set()
            for old in loaded:
                await client.delete(f"/admin/adapters/{old}", headers=headers)
            loaded = [name]
        k += 1
        try:
            await asyncio.wait_for(stop.wait(), round_s)
        except TimeoutError:
            pass


async def run(args: argparse.Namespace, url: str, pid: int, adapters: list[Path]) -> tuple[Stats, list[float], list[tuple[str, float]]]:
    stats = Stats()
    phase: dict[str, Any] = {"side": "calm", "attacks": set(args.attacks.split(",")) if args.attacks else set()}
    stop, ready = asyncio.Event(), asyncio.Event()
    swaps: list[float] = []
    rss: list[tuple[str, float]] = []
    limits = httpx.Limits(max_connections=args.clients + args.hostile_workers + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tasks = [asyncio.create_task(honest(client, i, stats, phase, stop, ready)) for i in range(args.clients)]
        tasks += [asyncio.create_task(hostile(client, w, stats, phase, stop)) for w in range(args.hostile_workers)]
        tasks.append(asyncio.create_task(admin_swaps(client, adapters, args.round_s, stop, ready, swaps)))
        rounds = max(2, round(2 * args.minutes * 60 / args.round_s))
        for k in range(rounds):
            phase["side"] = "calm" if k % 2 == 0 else "hostile"
            end = time.monotonic() + args.round_s
            while time.monotonic() < end:
                await asyncio.sleep(min(5.0, end - time.monotonic()))
                rss.append((phase["side"], rss_mb(pid)))
            print(
                f"round {k + 1}/{rounds} ({phase['side']}): rss {rss[-1][1]:.0f} MB, honest {sum(stats.status['calm'].values()) + sum(stats.status['hostile'].values())} requests",
                flush=True,
            )
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return stats, swaps, rss


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) >= 2 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a model folder")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes of each side (calm and hostile)")
    ap.add_argument("--round-s", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--hostile-workers", type=int, default=4)
    ap.add_argument("--attacks", default="", help="comma-separated attack names to use (default: all); for finding which one hurts")
    args = ap.parse_args()
    from runtime.model_store import resolve_model

    tmp = Path(tempfile.mkdtemp(prefix="loopwise-soak-"))
    data = tmp / "data"
    model_dir = resolve_model(
        args.model, ROOT / ".data" / "models" if "LOOPWISE_TEST_CACHE" not in os.environ else Path(os.environ["LOOPWISE_TEST_CACHE"])
    )
    adapters = []
    for k in range(2):
        out = data / "adapters" / f"v{k}"
        make_adapter(model_dir, out, seed=k)
        adapters.append(out)
    args.model = str(model_dir)
    start_load = load()
    proc, base = start_server(args, data)
    try:
        stats, swaps, rss = asyncio.run(run(args, base, proc.pid, adapters))
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    end_load = load()
    answered = set(stats.turns)
    conn = sqlite3.connect(data / "interactions.db")
    stored = {r[0] for r in conn.execute("SELECT turn_id FROM turns")}
    journal = data / "interactions.journal"
    if journal.exists():
        stored |= {json.loads(line)["turn_id"] for line in journal.read_text().splitlines() if line.strip()}
    lost = len(answered - stored)
    calm, host = stats.latency["calm"], stats.latency["hostile"]
    honest_5xx = sum(n for side in stats.status.values() for code, n in side.items() if code >= 500)
    hostile_5xx = {k: v for k, v in stats.hostile.items() if int(k.rsplit(":", 1)[1]) >= 500}
    first = statistics.median(v for s, v in rss[: max(1, len(rss) // 4)])
    last = statistics.median(v for s, v in rss[-max(1, len(rss) // 4) :])
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "minutes_per_side": args.minutes,
        "clients": args.clients,
        "honest_requests": {side: dict(c) for side, c in stats.status.items()},
        "p50_s": {"calm": statistics.median(calm), "hostile": statistics.median(host)},
        "p95_s": {"calm": pct(calm, 95), "hostile": pct(host, 95)},
        "p50_ratio": statistics.median(host) / statistics.median(calm),
        "p95_ratio": pct(host, 95) / pct(calm, 95),
        "honest_5xx": honest_5xx,
        "answered_turns": len(answered),
        "turns_lost": lost,
        "hostile_statuses": dict(sorted(stats.hostile.items())),
        "hostile_5xx": hostile_5xx,
        "hot_swaps": len(swaps),
        "rss_mb_first_quarter": first,
        "rss_mb_last_quarter": last,
        "load_start": start_load,
        "load_end": end_load,
    }
    out = ROOT / "bench" / "results" / "soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(
        f"\nhonest p50 {result['p50_s']['calm']:.3f} -> {result['p50_s']['hostile']:.3f} s (x{result['p50_ratio']:.2f}), "
        f"p95 {result['p95_s']['calm']:.3f} -> {result['p95_s']['hostile']:.3f} s (x{result['p95_ratio']:.2f}); honest 5xx {honest_5xx}; "
        f"turns lost {lost} of {len(answered)}; hostile 5xx {sum(hostile_5xx.values())}; RSS {first:.0f} -> {last:.0f} MB; "
        f"{len(swaps)} hot swaps; load {start_load} -> {end_load}"
    )


if __name__ == "__main__":
    main()
