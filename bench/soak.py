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
round (flat: the last quarter's median within 5% of the median of round 3, after the first calm and hostile rounds
have grown the KV pools to the batch's size; the first quarter's median is printed too), with ``uptime``'s load at
the start and end. The ``overlap`` table: the honest requests of the hostile rounds grouped by the attack (and its
status) they overlapped in time, with their median and p95 latency, beside those that overlapped none: which attack
the tail rides with (timeline in ``bench/results/soak_timeline.json``). ``--serve-args`` passes flags to ``serve.py`` (e.g. ``--no-row-share`` for an A/B).
Not here: timed assertions (this prints figures); GPU runs.

Finding memory growth (opt-in, never in a production path): ``--memprobe DIR`` starts ``serve.py`` through this
script (``--memprobe-serve``), which installs a ``SIGUSR1`` handler before running ``serve.py`` unchanged; the soak
signals it at the end of every round, and the server appends one JSON line to ``DIR/probe.jsonl``: VmRSS and
``/proc/self/smaps_rollup``, glibc's ``mallinfo2`` (bytes in use vs free-but-kept in the arenas, mmapped bytes) and
``malloc_info`` (the number of arenas, each one's size and free bytes), the thread count, and with
``--memprobe-frames N`` (N > 0: ``tracemalloc`` with N frames, started at the first probe, after the warm-up round,
so that only blocks allocated since then are traced and a snapshot stays cheap) the traced Python total, the 25
call sites that grew most since the previous probe, and the 25 that hold most of what is still alive from since the
first (growth that stays there is a leak; growth of RSS that neither ``mallinfo2``'s in-use bytes nor the traced
total follow is the allocator keeping freed memory). A probe blocks the server's event loop while it runs.
``--malloc-trim-s S`` (with ``--memprobe``) has the server call ``malloc_trim(0)`` every S seconds on a thread of the
probe, ``--engine-fcfs`` (with ``--memprobe``) puts the embedded engine's admission back to first-come-first-served
(no per-owner counters) in the server, for an A/B of the fair share, and ``--server-env K=V`` sets an environment
variable for the server (e.g. ``MALLOC_ARENA_MAX=2``), to measure remedies. Every run also samples the engine's
waiting and running requests (``/metrics``) with the RSS: a waiting count of 0 means admission into the batch was
never contended, so its order (the fair share) could not matter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
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
    if args.memprobe:  # the same serve.py, started through the probe (module docstring)
        Path(args.memprobe).mkdir(parents=True, exist_ok=True)
        cmd[1:2] = [
            str(Path(__file__).resolve()),
            MEMPROBE_SERVE,
            args.memprobe,
            str(args.memprobe_frames),
            str(args.malloc_trim_s),
            "fcfs" if args.engine_fcfs else "fair",
            str(ROOT / "serve.py"),
        ]
    cmd += ["--no-learner"]
    cmd += ["--dtype", args.dtype, "--admin-key-file", str(data.parent / "admin.key"), *shlex.split(args.serve_args)]
    env = {**os.environ, "LOOPWISE_API_KEYS": ",".join([*HONEST_KEYS, HOSTILE_KEY])}
    for kv in args.server_env:
        k, _, v = kv.partition("=")
        env[k] = v
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


# ---- the memory probe (opt-in: --memprobe) ---------------------------------------------------------------

MEMPROBE_SERVE = "--memprobe-serve"


def _proc_fields(path: str, names: tuple[str, ...]) -> dict[str, float]:
    """``name: N kB`` lines of a /proc file, in MB."""
    out = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in names:
            out[key] = int(rest.split()[0]) / 1024
    return out


def _malloc_state(libc: Any) -> dict[str, Any]:
    """glibc's view: mallinfo2 (all arenas) and malloc_info's per-arena sizes, in MB."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
        ]

    libc.mallinfo2.restype = Mallinfo2
    mi = libc.mallinfo2()
    state: dict[str, Any] = {
        "malloc_arena_mb": mi.arena / 2**20,  # bytes the arenas took from the system (sbrk + arena mmaps)
        "malloc_in_use_mb": mi.uordblks / 2**20,  # bytes allocated and not freed, in the arenas
        "malloc_free_kept_mb": mi.fordblks / 2**20,  # freed bytes the arenas keep (RSS only where touched)
        "malloc_mmapped_mb": mi.hblkhd / 2**20,  # large blocks served by their own mmap (returned on free)
        "malloc_mmapped_blocks": mi.hblks,
    }
    fd, path = tempfile.mkstemp(prefix="malloc-info-")
    os.close(fd)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    fp = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    xml = Path(path).read_text()
    os.unlink(path)
    heaps = re.findall(r'<heap nr="(\d+)">(.*?)</heap>', xml, re.S)
    arenas = []
    for nr, body in heaps:
        cur = re.search(r'<system type="current" size="(\d+)"', body)
        rest = re.search(r'<total type="rest" count="\d+" size="(\d+)"', body)
        arenas.append((int(nr), round(int(cur.group(1)) / 2**20, 1) if cur else None, round(int(rest.group(1)) / 2**20, 1) if rest else None))
    state["arenas"] = len(arenas)
    state["arena_mb_free_mb"] = [[s, f] for _, s, f in arenas]  # per arena: its size and the free bytes in it
    return state


def _fcfs_pop(self: Any) -> Any:
    """``FairQueue.pop`` as before the fair share: the earliest arrival of any owner."""
    waiting = self._waiting
    if not waiting:
        return None
    owner = min(waiting, key=lambda o: waiting[o][0][0])
    _, item = waiting[owner].popleft()
    if not waiting[owner]:
        del waiting[owner]
    self._len -= 1
    self._running[owner] = self._running.get(owner, 0) + 1
    return item


def _memprobe_serve(argv: list[str]) -> None:
    """Run serve.py (argv[3:]) in this process with the probe installed (module docstring)."""
    import ctypes
    import runpy
    import signal
    import threading
    import tracemalloc

    out, frames, trim_s, order, serve = Path(argv[0]), int(argv[1]), float(argv[2]), argv[3], argv[4]
    if order == "fcfs":
        from runtime.engines.fair_share import FairQueue

        FairQueue.pop = _fcfs_pop  # type: ignore[method-assign]
    libc = ctypes.CDLL("libc.so.6")
    seen: dict[str, Any] = {"n": 0, "prev": None, "busy": False, "trims": 0, "trimmed_mb": 0.0}

    def growth(now: dict[Any, tuple[int, int]], then: dict[Any, tuple[int, int]] | None) -> list[dict[str, Any]]:
        if then is None:
            return []
        rows = [(size - then.get(tb, (0, 0))[0], count - then.get(tb, (0, 0))[1], tb) for tb, (size, count) in now.items()]
        rows.sort(key=lambda r: r[0], reverse=True)
        return [{"kb": round(d / 1024, 1), "blocks": c, "where": [f"{f.filename}:{f.lineno}" for f in tb]} for d, c, tb in rows[:25]]

    def probe(signum: int, frame: Any) -> None:
        if seen["busy"]:  # a signal that arrives while a probe runs (handlers can nest) is dropped
            return
        seen["busy"] = True
        try:
            measure()
        finally:
            seen["busy"] = False

    def measure() -> None:
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"n": seen["n"], "t": time.time()}
        rec.update(_proc_fields("/proc/self/status", ("VmRSS", "RssAnon", "RssFile", "Threads")))
        rec["Threads"] = int(rec["Threads"] * 1024)
        rec.update({f"rollup_{k}": v for k, v in _proc_fields("/proc/self/smaps_rollup", ("Rss", "Anonymous", "Private_Dirty", "Swap")).items()})
        rec.update(_malloc_state(libc))
        rec["trims"], rec["trimmed_mb"] = seen["trims"], round(seen["trimmed_mb"], 1)
        if frames and tracemalloc.is_tracing():
            # traced: only blocks allocated since the first probe (after warm-up) and still alive, so the snapshot is small
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            stats = {s.traceback: (s.size, s.count) for s in snap.statistics("traceback")}
            del snap
            rec["traced_mb"] = tracemalloc.get_traced_memory()[0] / 2**20
            rec["growth_since_previous"] = growth(stats, seen["prev"])
            rec["alive_since_first"] = growth(stats, {})
            seen["prev"] = stats
        elif frames:
            tracemalloc.start(frames)
        rec["probe_s"] = round(time.perf_counter() - t0, 2)
        with open(out / "probe.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        seen["n"] += 1

    def trim_forever() -> None:
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        while True:
            time.sleep(trim_s)
            before = rss_mb(os.getpid())
            libc.malloc_trim(0)
            seen["trims"] += 1
            seen["trimmed_mb"] += before - rss_mb(os.getpid())

    signal.signal(signal.SIGUSR1, probe)
    if trim_s > 0:
        threading.Thread(target=trim_forever, name="memprobe-trim", daemon=True).start()
    sys.argv = [serve, *argv[5:]]
    runpy.run_path(serve, run_name="__main__")


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
        self.engine: dict[str, list[tuple[float, float]]] = {"calm": [], "hostile": []}  # (waiting, running) per sample
        self.rss_rounds: list[list[float]] = []  # the server's RSS samples, round by round
        self.latency: dict[str, list[float]] = {"calm": [], "hostile": []}
        self.status: dict[str, Counter[int]] = {"calm": Counter(), "hostile": Counter()}
        self.turns: list[str] = []
        self.hostile: Counter[str] = Counter()
        # the timeline (--timeline): honest (start, seconds, side) and hostile (start, seconds, attack, status), for
        # finding which attack the slow honest requests overlapped
        self.honest_times: list[tuple[float, float, str]] = []
        self.hostile_times: list[tuple[float, float, str, int | str]] = []


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
                stats.honest_times.append((t0, dt, side))
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
        t0 = time.perf_counter()
        try:
            if isinstance(body, bytes):
                r = await client.post(path, content=body, headers={**headers, "content-type": "application/json"})
            else:
                r = await client.post(path, json=body, headers=headers)
            status: int | str = r.status_code
        except httpx.HTTPError:  # e.g. a throttled key's 4 MB body cut off by the server's early 429: not a server error
            status = "transport"
        stats.hostile[f"{name}:{status}"] += 1
        stats.hostile_times.append((t0, time.perf_counter() - t0, name, status))


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
            stats.rss_rounds.append([])
            while time.monotonic() < end:
                await asyncio.sleep(min(5.0, end - time.monotonic()))
                rss.append((phase["side"], rss_mb(pid)))
                stats.rss_rounds[-1].append(rss[-1][1])
                if (sample := await engine_load(client)) is not None:
                    stats.engine[phase["side"]].append(sample)
            print(
                f"round {k + 1}/{rounds} ({phase['side']}): rss {rss[-1][1]:.0f} MB, honest {sum(stats.status['calm'].values()) + sum(stats.status['hostile'].values())} requests",
                flush=True,
            )
            if args.memprobe:
                os.kill(pid, signal.SIGUSR1)  # the server appends this round's line to probe.jsonl
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return stats, swaps, rss


async def engine_load(client: httpx.AsyncClient) -> tuple[float, float] | None:
    """The engine's waiting and running requests now (``/metrics``): whether admission into the batch is contended at all."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return None
    found = dict(re.findall(r"^loopwise_(queue_depth|running_requests) ([\d.]+)$", text, re.M))
    if len(found) < 2:
        return None
    return float(found["queue_depth"]), float(found["running_requests"])


def overlap_table(stats: Stats, window_s: float = 2.0) -> dict[str, dict[str, float]]:
    """For the honest requests of the hostile rounds: by attack kind (and status), those during whose first
    ``window_s`` seconds such an attack was in flight, with their median and p95 latency, beside those with no attack
    in flight then. A fixed window, not the whole request: a slow request overlaps more of everything, which would
    make every attack look guilty (a first run of this table did)."""
    honest = [(t0, t0 + window_s, dt) for t0, dt, side in stats.honest_times if side == "hostile"]
    kinds = sorted({(name, status) for _, _, name, status in stats.hostile_times}, key=str)
    out: dict[str, dict[str, float]] = {}
    hit_any = [False] * len(honest)
    for name, status in kinds:
        spans = [(t0, t0 + dt) for t0, dt, n, st in stats.hostile_times if n == name and st == status]
        lat = []
        for i, (a, b, dt) in enumerate(honest):
            if any(s < b and a < e for s, e in spans):
                lat.append(dt)
                hit_any[i] = True
        if len(lat) >= 2:
            out[f"{name}:{status}"] = {"n": len(lat), "p50_s": round(statistics.median(lat), 3), "p95_s": round(pct(lat, 95), 3)}
    clean = [dt for (_, _, dt), hit in zip(honest, hit_any, strict=True) if not hit]
    if len(clean) >= 2:
        out["none"] = {"n": len(clean), "p50_s": round(statistics.median(clean), 3), "p95_s": round(pct(clean, 95), 3)}
    return out


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) >= 2 else float("nan")


def _max_mean(xs: list[float]) -> tuple[float, float] | None:
    return (max(xs), round(statistics.fmean(xs), 1)) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a model folder")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes of each side (calm and hostile)")
    ap.add_argument("--round-s", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--hostile-workers", type=int, default=4)
    ap.add_argument("--attacks", default="", help="comma-separated attack names to use (default: all); for finding which one hurts")
    ap.add_argument("--memprobe", default="", metavar="DIR", help="probe the server's memory every round into DIR/probe.jsonl (see above)")
    ap.add_argument("--memprobe-frames", type=int, default=0, metavar="N", help="with --memprobe: tracemalloc with N frames (0: off)")
    ap.add_argument("--engine-fcfs", action="store_true", help="with --memprobe: the engine admits first-come-first-served (A/B)")
    ap.add_argument("--malloc-trim-s", type=float, default=0.0, metavar="S", help="with --memprobe: malloc_trim(0) in the server every S seconds")
    ap.add_argument(
        "--server-env", action="append", default=[], metavar="K=V", help="set an environment variable for the server, e.g. MALLOC_ARENA_MAX=2"
    )
    ap.add_argument("--serve-args", default="", help="extra serve.py flags (one string, split like a shell), e.g. --no-row-share")
    args = ap.parse_args()
    if (args.malloc_trim_s or args.engine_fcfs) and not args.memprobe:
        ap.error("--malloc-trim-s and --engine-fcfs need --memprobe DIR")
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
    hostile_5xx = {k: v for k, v in stats.hostile.items() if k.rsplit(":", 1)[1].isdigit() and int(k.rsplit(":", 1)[1]) >= 500}
    first = statistics.median(v for s, v in rss[: max(1, len(rss) // 4)])
    last = statistics.median(v for s, v in rss[-max(1, len(rss) // 4) :])
    # after warm-up: the third round, once a calm and a hostile round have grown the KV pools to the batch's size
    warm = statistics.median(stats.rss_rounds[2]) if len(stats.rss_rounds) >= 4 and stats.rss_rounds[2] else float("nan")
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
        "engine_waiting_max_mean": {side: _max_mean([w for w, _ in xs]) for side, xs in stats.engine.items()},
        "engine_running_max_mean": {side: _max_mean([r for _, r in xs]) for side, xs in stats.engine.items()},
        "rss_mb_first_quarter": first,
        "rss_mb_last_quarter": last,
        "load_start": start_load,
        "load_end": end_load,
        "rss_mb_after_warmup": warm,
        "rss_growth_after_warmup": last / warm - 1,
        "rss_mb_per_sample": [round(v, 1) for _, v in rss],
        "server_env": args.server_env,
        "malloc_trim_s": args.malloc_trim_s,
        "engine_admission": "fcfs" if args.engine_fcfs else "fair share (VTC)",
        "row_share": "--no-row-share" not in args.serve_args,
        "serve_args": args.serve_args,
        "overlap": overlap_table(stats),
    }
    out = ROOT / "bench" / "results" / "soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    timeline = {"honest": [[round(t, 3), round(d, 3), side] for t, d, side in stats.honest_times], "hostile": stats.hostile_times}
    (out.parent / "soak_timeline.json").write_text(json.dumps(timeline))  # for offline analysis (large: not a result to commit)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(
        f"\nhonest p50 {result['p50_s']['calm']:.3f} -> {result['p50_s']['hostile']:.3f} s (x{result['p50_ratio']:.2f}), "
        f"p95 {result['p95_s']['calm']:.3f} -> {result['p95_s']['hostile']:.3f} s (x{result['p95_ratio']:.2f}); honest 5xx {honest_5xx}; "
        f"turns lost {lost} of {len(answered)}; hostile 5xx {sum(hostile_5xx.values())}; RSS {first:.0f} -> {last:.0f} MB "
        f"({warm:.0f} after warm-up: {100 * (last / warm - 1):+.1f} %); "
        f"{len(swaps)} hot swaps; load {start_load} -> {end_load}"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == MEMPROBE_SERVE:
        _memprobe_serve(sys.argv[2:])
    else:
        main()
