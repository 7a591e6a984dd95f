"""Scale-out figures, each side by side in one run (rounds alternate, so machine noise hits both sides):

    .venv/bin/python bench/scaling.py ingest     # store ingest turns/s: SQLite vs PostgreSQL (BYTEA) vs PostgreSQL (arrays)
    .venv/bin/python bench/scaling.py record     # serving with recording off / on SQLite / on PostgreSQL (tiny model)
    .venv/bin/python bench/scaling.py runtimes   # two runtimes vs one on one PostgreSQL store (tiny model)
    .venv/bin/python bench/scaling.py ddp        # the learner's step: 2 data-parallel ranks vs 1, same samples

PostgreSQL is a throwaway cluster (``tests/pgcluster.py``) with ``fsync`` on and ``synchronous_commit=on``:
a commit is on disk, as SQLite's is in WAL mode. ``ingest`` writes the same turns (200-token contexts,
64-token outputs, as ``bench/store_ingest.py``) through ``append_turns`` in batches of 64, the way the
recorder's writer does, and reports bytes per turn; the "arrays" variant stores the four token columns as
``int4[]``/``real[]``/``smallint[]`` instead of packed little-endian ``BYTEA``. ``record`` and ``runtimes``
use real ``serve.py`` processes and 16 concurrent clients (16 new tokens each); ``ddp`` runs
``LoRATrainer.step`` on the tiny model (or ``--model``) in 1 and in 2 gloo ranks. Results go to
``bench/results/scaling_<what>.json``. On a machine with few cores, two runtimes or two ranks share those
cores: the ratios say what one host gains, not what two hosts would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.store_ingest import make_turns  # noqa: E402
from learner.records.store import SqliteStore  # noqa: E402
from learner.records.store_pg import PostgresStore  # noqa: E402
from tests.pgcluster import PgCluster  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def _save(what: str, data: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"scaling_{what}.json").write_text(json.dumps(data, indent=2))


def _load() -> str:
    return os.getloadavg().__repr__()


# ---- ingest -----------------------------------------------------------------------------------------


def _array_row(t: Any) -> tuple:
    from learner.records.store import turn_row

    row = list(turn_row(t))
    row[10:14] = [list(t.context_ids), list(t.output_ids), list(t.logprobs), list(t.loss_mask)]
    return tuple(row)


class ArrayTokensStore(PostgresStore):
    """The PostgreSQL store with native arrays for the token columns (the alternative to packed BYTEA)."""

    _turn_row = staticmethod(_array_row)

    def __init__(self, url: str, **kw: Any) -> None:
        super().__init__(url, **kw)
        with self._tx() as conn:
            for col, typ in (("context_ids", "int4[]"), ("output_ids", "int4[]"), ("logprobs", "real[]"), ("loss_mask", "smallint[]")):
                conn.execute(f"ALTER TABLE turns ALTER COLUMN {col} TYPE {typ} USING NULL")


def ingest(args: argparse.Namespace) -> None:
    turns = make_turns(args.turns, 200, 64)
    rates: dict[str, list[float]] = {"sqlite": [], "pg_bytea": [], "pg_arrays": []}
    sizes: dict[str, int] = {}
    with PgCluster(fsync=True) as pg, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name in rates:
                if name == "sqlite":
                    store: Any = SqliteStore(Path(tmp) / f"r{r}.db")
                elif name == "pg_bytea":
                    store = PostgresStore(pg.create_schema(f"b{r}"))
                else:
                    store = ArrayTokensStore(pg.create_schema(f"a{r}"))
                t0 = time.perf_counter()
                for i in range(0, len(turns), args.batch):
                    store.append_turns(turns[i : i + args.batch])
                rates[name].append(len(turns) / (time.perf_counter() - t0))
                assert store.stats()["turns"] == len(turns)
                if name == "sqlite":
                    store._conn().execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    sizes[name] = (Path(tmp) / f"r{r}.db").stat().st_size
                else:
                    with store._tx() as conn:
                        sizes[name] = conn.execute("SELECT pg_total_relation_size('turns')").fetchone()[0]
                store.close()
        # read back: the learner's path (iter_samples) on each store of the last round
        reads: dict[str, float] = {}
        for name, store in (
            ("sqlite", SqliteStore(Path(tmp) / f"r{args.repeats - 1}.db")),
            ("pg_bytea", PostgresStore(pg.url() + f"?options=-csearch_path%3Db{args.repeats - 1}")),
        ):
            t0 = time.perf_counter()
            n = sum(1 for _ in store.iter_samples())
            reads[name] = n / (time.perf_counter() - t0)
            store.close()
    best = {k: max(v) for k, v in rates.items()}
    print(f"{args.turns:,} turns (200-token contexts, 64-token outputs), batches of {args.batch}, best of {args.repeats}; load {_load()}")
    for name in rates:
        print(
            f"  {name:10s} {best[name]:9,.0f} turns/s  ({best[name] / best['sqlite']:.2f}x SQLite)  {sizes[name] / args.turns:7,.0f} B/turn on disk"
        )
    print(f"  read back (iter_samples): SQLite {reads['sqlite']:,.0f} turns/s, PostgreSQL {reads['pg_bytea']:,.0f} turns/s")
    _save("ingest", {"turns": args.turns, "batch": args.batch, "turns_per_s": best, "all": rates, "bytes_per_turn": {k: v / args.turns for k, v in sizes.items()}, "read_turns_per_s": reads, "load": _load()})  # fmt: skip


# ---- servers ----------------------------------------------------------------------------------------


def _start(extra: list[str], data_dir: Path) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "serve.py",
        "--model",
        "tiny",
        "--port",
        "0",
        "--data-dir",
        str(data_dir),
        "--log-level",
        "warning",
        "--no-learner",
        *extra,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"on (http://[\d.]+:\d+)/v1", line):
            return proc, m.group(1)
    raise RuntimeError(f"server did not start: {cmd}")


def _data_dir(tmp: Path, name: str) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "models").symlink_to(Path(os.environ.get("LOOPWISE_TEST_CACHE", ROOT / ".data" / "models")))
    return d


async def _round(urls: list[str], requests: int, clients: int) -> tuple[float, list[float]]:
    import httpx

    sem = asyncio.Semaphore(clients)
    lat: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(timeout=120) as c:

        async def one(i: int) -> None:
            nonlocal tokens
            async with sem:
                body = {"model": "tiny", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 16, "ignore_eos": True}
                t0 = time.perf_counter()
                r = await c.post(urls[i % len(urls)] + "/v1/chat/completions", json=body, headers={"X-Session-Id": f"s{i % clients}"})
                lat.append(time.perf_counter() - t0)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
    return tokens / (time.perf_counter() - t0), lat


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _compare(sides: dict[str, list[str]], args: argparse.Namespace) -> dict[str, Any]:
    for urls in sides.values():
        asyncio.run(_round(urls, 32, args.clients))  # warm-up
    tput: dict[str, list[float]] = {k: [] for k in sides}
    lats: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name, urls in sides.items():
            tps, lat = asyncio.run(_round(urls, args.requests, args.clients))
            tput[name].append(tps)
            lats[name].extend(lat)
    base = next(iter(sides))
    out = {}
    print(f"tiny model, {args.clients} clients, {args.requests} requests x {args.rounds} alternating rounds, 16 tokens each; load {_load()}")
    print(f"  {'side':18s} {'tok/s':>9s} {'vs ' + base:>10s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for name in sides:
        t = statistics.median(tput[name])
        p50, p99 = _pct(lats[name], 0.5) * 1e3, _pct(lats[name], 0.99) * 1e3
        out[name] = {"tokens_per_s": t, "ratio": t / statistics.median(tput[base]), "p50_ms": p50, "p99_ms": p99, "rounds": tput[name]}
        print(f"  {name:18s} {t:9.1f} {out[name]['ratio']:10.3f} {p50:8.1f} {p99:8.1f}")
    return out


def record(args: argparse.Namespace) -> None:
    procs: list[subprocess.Popen] = []
    with PgCluster(fsync=True) as pg, tempfile.TemporaryDirectory() as tmp:
        try:
            dur = ["--durability", args.durability]
            p, off = _start(["--no-record"], _data_dir(Path(tmp), "off"))
            procs.append(p)
            p, lite = _start(dur, _data_dir(Path(tmp), "sqlite"))
            procs.append(p)
            p, post = _start([*dur, "--store", pg.create_database("rec")], _data_dir(Path(tmp), "pg"))
            procs.append(p)
            print(f"recording ({args.durability} durability): off vs SQLite vs PostgreSQL")
            out = _compare({"off": [off], "sqlite": [lite], "postgres": [post]}, args)
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    _save(f"record_{args.durability}", {**out, "durability": args.durability, "load": _load()})


def _fanout(a: str, b: str, adapters: Path, version: int) -> dict[str, float]:
    """Load ``fan@version`` on runtime A through the admin API (as the learner does); seconds until A, then B, answer with it."""
    import httpx

    auth = {"Authorization": "Bearer bench"}
    body = {"model": f"fan@{version}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    t0 = time.perf_counter()
    r = httpx.post(a + "/admin/adapters", json={"path": str(adapters / f"v{version}"), "family": "fan", "version": version}, headers=auth, timeout=60)
    r.raise_for_status()
    out = {"load_on_a_s": time.perf_counter() - t0}
    while httpx.post(b + "/v1/chat/completions", json=body, timeout=60).status_code != 200:
        time.sleep(0.02)
    out["served_by_b_s"] = time.perf_counter() - t0
    return out


def runtimes(args: argparse.Namespace) -> None:
    from runtime.model_store import ensure_tiny
    from tests.runtime.test_adapter_serving import make_adapter

    procs: list[subprocess.Popen] = []
    with PgCluster(fsync=True) as pg, tempfile.TemporaryDirectory() as tmp:
        try:
            url = pg.create_database("two")
            adapters = Path(tmp) / "adapters"
            tiny = ensure_tiny(Path(os.environ.get("LOOPWISE_TEST_CACHE", ROOT / ".data" / "models")))
            for v in (1, 2, 3):
                make_adapter(tiny, adapters / f"v{v}", seed=v)
            common = ["--store", url, "--durability", args.durability, "--admin-key", "bench", "--adapter-root", str(adapters)]
            cpus = os.cpu_count() or 1
            half = ["--threads", str(max(1, cpus // 2))]  # the two share this host's cores: no oversubscription
            p, one = _start([*common, "--threads", str(cpus)], _data_dir(Path(tmp), "one"))
            procs.append(p)
            p, a = _start([*common, *half], _data_dir(Path(tmp), "a"))
            procs.append(p)
            p, b = _start([*common, *half], _data_dir(Path(tmp), "b"))
            procs.append(p)
            print(f"one runtime ({cpus} threads) vs two ({half[1]} each) on one PostgreSQL store ({args.durability} durability); clients alternate")
            out = _compare({"one runtime": [one], "two runtimes": [a, b]}, args)
            fan = [_fanout(a, b, adapters, v) for v in (1, 2, 3)]
            out["fanout"] = fan
            print(f"adapter fan-out (default --store-sync-s 2): loaded on A in {statistics.median(x['load_on_a_s'] for x in fan):.2f} s, "
                  f"served by B after {statistics.median(x['served_by_b_s'] for x in fan):.2f} s (median of 3; max {max(x['served_by_b_s'] for x in fan):.2f} s)")  # fmt: skip
            store = PostgresStore(url)
            out["turns_stored"] = store.stats()["turns"]
            store.close()
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    _save("runtimes", {**out, "cpus": os.cpu_count(), "load": _load()})


# ---- ddp --------------------------------------------------------------------------------------------

DDP_SCRIPT = """
import json, sys, time, torch
from pathlib import Path
from learner.distributed import init_from_env
from learner.trainer import LoRATrainer
from learner.update import update
from tests.learner.test_trainer import LORA, cfg, make_samples
rank, size = init_from_env()
if size == 1:
    torch.set_num_threads(int(sys.argv[4]))  # one rank: all the cores, or (the fair baseline for 2 ranks) half
trainer = LoRATrainer(Path(sys.argv[1]), cfg(micro_batch_tokens=int(sys.argv[3]), threads=None), LORA)
from dataclasses import replace
ctx, out = int(sys.argv[5]), int(sys.argv[6])
samples = [replace(s, context_ids=(s.context_ids * ctx)[:ctx], output_ids=(s.output_ids * out)[:out], loss_mask=[1] * out)
           for s in make_samples(1, n_groups=4, per_group=4)]
update(trainer, samples)  # warm-up step
times = []
for _ in range(int(sys.argv[2])):
    if size > 1:
        torch.distributed.barrier()
    t0 = time.perf_counter()
    m, _ = update(trainer, samples)
    times.append(time.perf_counter() - t0)
if rank == 0:
    print(json.dumps({"step_s": times, "tokens": m.tokens}))
"""


def _ddp_run(model: Path, nproc: int, steps: int, mb_tokens: int, threads: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        cmd = [sys.executable, "-c", DDP_SCRIPT, str(model), str(steps), str(mb_tokens), str(threads), "128", "32"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
    return json.loads(outs[0].strip().splitlines()[-1])


def ddp(args: argparse.Namespace) -> None:
    from runtime.model_store import ensure_tiny

    model = Path(args.model) if args.model else ensure_tiny(Path(os.environ.get("LOOPWISE_TEST_CACHE", ROOT / ".data" / "models")))
    cpus = os.cpu_count() or 1
    sides = {"1 rank, all threads": (1, cpus), "1 rank, half the threads": (1, max(1, cpus // 2)), "2 ranks": (2, max(1, cpus // 2))}
    runs: dict[str, list[float]] = {k: [] for k in sides}
    tokens = 0
    for _ in range(args.rounds):
        for name, (n, threads) in sides.items():
            r = _ddp_run(model, n, args.steps, args.micro_batch_tokens, threads)
            runs[name].append(statistics.median(r["step_s"]))
            tokens = r["tokens"]
    med = {k: statistics.median(v) for k, v in runs.items()}
    one, two = med["1 rank, all threads"], med["2 ranks"]
    print(
        f"learner step on {model.name}: 16 samples of 128 context + 32 output tokens ({tokens} trained), micro-batches of {args.micro_batch_tokens} tokens; {os.cpu_count()} CPUs, load {_load()}"
    )
    for name, (_, threads) in sides.items():
        print(f"  {name:26s} ({threads} thread(s) per rank): {med[name]:7.3f} s/step   vs 1 rank, all threads: {med[name] / one:.2f}")
    _save("ddp", {"model": str(model), "step_s": med, "ratio_2_over_1": two / one, "rounds": runs, "tokens": tokens, "cpus": cpus, "load": _load()})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    i = sub.add_parser("ingest")
    i.add_argument("--turns", type=int, default=10_000)
    i.add_argument("--batch", type=int, default=64)
    i.add_argument("--repeats", type=int, default=2)
    for name in ("record", "runtimes"):
        s = sub.add_parser(name)
        s.add_argument("--requests", type=int, default=192)
        s.add_argument("--clients", type=int, default=16)
        s.add_argument("--rounds", type=int, default=3)
        s.add_argument("--durability", choices=("async", "sync"), default="async")
    d = sub.add_parser("ddp")
    d.add_argument("--model", default=None, help="a base model folder (default: the tiny test model)")
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("--micro-batch-tokens", type=int, default=256)
    args = ap.parse_args()
    {"ingest": ingest, "record": record, "runtimes": runtimes, "ddp": ddp}[args.what](args)


if __name__ == "__main__":
    main()
