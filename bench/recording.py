"""Serving with recording on vs off: throughput and latency, side by side in one run.

    .venv/bin/python bench/recording.py            # tiny model, 16 clients, 4 alternating rounds

Two real ``serve.py`` processes on the tiny model, one recording (async durability, the default)
and one with ``--no-record``. Rounds alternate between them (off, on, off, on, ...) so machine noise
hits both alike; only one server is under load at a time. Each round sends the same requests from
16 concurrent clients (16 new tokens each, ``ignore_eos``). Targets: throughput ratio on/off ≥ 0.97,
p99 latency added ≤ 2 ms. Also prints the turns the recording server committed.
Not here: the store's raw ingest rate (``bench/store_ingest.py``).
"""

from __future__ import annotations

import argparse
import asyncio
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


def start(args: list[str], data_dir: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "serve.py", "--model", "tiny", "--port", "0", "--data-dir", str(data_dir), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"on (http://[\d.]+:\d+)/v1", line):
            return proc, m.group(1)
    raise RuntimeError("server did not start")


async def round_(base: str, requests: int, clients: int) -> tuple[float, list[float]]:
    sem = asyncio.Semaphore(clients)
    lat: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:

        async def one(i: int) -> None:
            nonlocal tokens
            async with sem:
                body = {"model": "tiny", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 16, "ignore_eos": True}
                t0 = time.perf_counter()
                r = await c.post("/v1/chat/completions", json=body)
                lat.append(time.perf_counter() - t0)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    return tokens / wall, lat


def request_path_cost(n: int = 2000) -> list[float]:
    """In process: what recording adds to one request's path (stitching ids + building the turn + queueing it),
    with the real SQLite store and writer thread running, async durability."""
    from learner.records import Turn
    from learner.records.store import SqliteStore
    from runtime.recorder import Recorder, messages_key

    async def run(rec: Recorder) -> list[float]:
        out = []
        for i in range(n):
            msgs = [{"role": "user", "content": f"request {i}"}]
            t0 = time.perf_counter()
            [slot] = rec.assign("bench", msgs, 1)
            turn = Turn(
                turn_id=slot.turn_id, trajectory_id=slot.trajectory_id, session_id=slot.session_id, index=slot.index,
                completion_id=f"c{i}", model="tiny", context_ids=list(range(48)), output_ids=list(range(16)),
                logprobs=[-0.5] * 16, loss_mask=[1] * 16, finish_reason="length", messages=msgs, output_text="x" * 40,
                prefix_key=messages_key(msgs), continuation_key=messages_key([*msgs, {"role": "assistant", "content": "x" * 40}]),
            )  # fmt: skip
            await rec.record([turn])
            out.append(time.perf_counter() - t0)
            if i % 16 == 0:
                await asyncio.sleep(0.001)  # let the writer run, as between real requests
        await rec.flush()
        return out

    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(SqliteStore(Path(tmp) / "bench.db"))
        rec.start()
        try:
            return asyncio.run(run(rec))
        finally:
            rec.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = ROOT / ".data"  # reuse the cached tiny model
        off, off_url = start(["--no-record"], models)
        on_dir = Path(tmp)
        (on_dir / "models").symlink_to(models / "models")
        on, on_url = start(["--admin-key", "bench"], on_dir)
        try:
            asyncio.run(round_(off_url, 32, args.clients))  # warm-up both
            asyncio.run(round_(on_url, 32, args.clients))
            tput = {"off": [], "on": []}
            lats: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(args.rounds):
                for name, url in (("off", off_url), ("on", on_url)):
                    tps, lat = asyncio.run(round_(url, args.requests, args.clients))
                    tput[name].append(tps)
                    lats[name].extend(lat)
            stats = httpx.get(on_url + "/admin/stats", headers={"Authorization": "Bearer bench"}).json()
        finally:
            off.terminate()
            on.terminate()
            off.wait()
            on.wait()

    def p(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    t_off, t_on = statistics.median(tput["off"]), statistics.median(tput["on"])
    print(f"\nrecording on vs off: tiny model, {args.clients} clients, {args.requests} requests x {args.rounds} rounds each, 16 tokens")
    print(f"{'measure':34s} {'on':>10s} {'off':>10s} {'on/off':>8s} {'added':>9s}")
    print(f"{'throughput tok/s (median round)':34s} {t_on:10.1f} {t_off:10.1f} {t_on / t_off:8.3f}")
    for q in (0.5, 0.99):
        a, b = p(lats["on"], q) * 1000, p(lats["off"], q) * 1000
        print(f"{f'latency p{int(q * 100)} ms':34s} {a:10.1f} {b:10.1f} {a / b:8.3f} {a - b:7.2f}ms")
    print(f"turns committed by the recording server: {stats['turns']} (expected {(args.rounds * args.requests) + 32})")
    cost = request_path_cost()
    print(f"request-path cost of recording, in process: p50 {p(cost, 0.5) * 1e3:.3f} ms  p99 {p(cost, 0.99) * 1e3:.3f} ms (target p99 added <= 2 ms)")


if __name__ == "__main__":
    main()
