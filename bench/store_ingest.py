"""Interaction-store ingest throughput: packed token arrays vs JSON token lists, side by side in one run.

    .venv/bin/python bench/store_ingest.py                      # 20,000 turns, batches of 64
    .venv/bin/python bench/store_ingest.py --turns 5000 --full  # synchronous=FULL (power-loss durable)

Writes N turns (200-token contexts, 64-token outputs with logprobs and a loss mask, a short chat in
``messages``) through ``SqliteStore.append_turns`` in batches of 64 into a fresh temp database, the
way the recorder's writer thread does (one transaction per batch). The baseline is the same store,
schema and code path with the four token columns encoded as JSON text instead of packed arrays.
Each variant runs ``--repeats`` times on a fresh file (alternating), best run reported. Target:
packed ≥ 5,000 turns/s. Also prints bytes on disk per turn. Results go to
bench/results/store_ingest.json. Building the Turn objects is not timed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from learner.records import Turn, TurnTimings  # noqa: E402
from learner.records.store import SqliteStore, turn_row  # noqa: E402

TARGET = 5_000


def _json_turn_row(t: Turn) -> tuple:
    row = list(turn_row(t))
    row[10:14] = [json.dumps(t.context_ids), json.dumps(t.output_ids), json.dumps(t.logprobs), json.dumps(t.loss_mask)]
    return tuple(row)


class JsonTokensStore(SqliteStore):
    _turn_row = staticmethod(_json_turn_row)


def make_turns(n: int, context_len: int, output_len: int, seed: int = 0) -> list[Turn]:
    rng = random.Random(seed)
    turns = []
    now = time.time()
    for i in range(n):
        traj = i // 4  # 4-turn trajectories, 2 trajectories per session
        out = [rng.randrange(49_152) for _ in range(output_len)]
        turns.append(
            Turn(
                turn_id=f"turn-{i:08d}",
                trajectory_id=f"traj-{traj:08d}",
                session_id=f"sess-{traj // 2:08d}",
                index=i % 4,
                parent_turn_id=None if i % 4 == 0 else f"turn-{i - 1:08d}",
                completion_id=f"chatcmpl-{i:08d}",
                created_at=now + i * 1e-4,
                model="SmolLM2-135M-Instruct",
                context_ids=[rng.randrange(49_152) for _ in range(context_len)],
                output_ids=out,
                logprobs=[-rng.random() * 5 for _ in out],
                loss_mask=[1] * output_len,
                sampling={"temperature": 0.7, "top_p": 0.95, "max_tokens": output_len, "seed": i},
                finish_reason="stop",
                timings=TurnTimings(queued_s=0.001, ttft_s=0.02, total_s=0.5),
                messages=[
                    {"role": "system", "content": "You are a helpful assistant. " * 4},
                    {"role": "user", "content": f"Question {i}: " + "please explain the following in detail. " * 12},
                ],
                output_text="an answer " * (output_len // 2),
                continuation_key=f"{rng.getrandbits(128):032x}",
                prefix_key=f"{rng.getrandbits(128):032x}",
            )
        )
    return turns


def run_once(cls: type[SqliteStore], turns: list[Turn], batch: int, full: bool) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.db"
        store = cls(path, synchronous_full=full)
        t0 = time.perf_counter()
        for i in range(0, len(turns), batch):
            store.append_turns(turns[i : i + batch])
        elapsed = time.perf_counter() - t0
        assert store.stats()["turns"] == len(turns)
        store._conn().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = path.stat().st_size
        store.close()
    return len(turns) / elapsed, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="synchronous=FULL instead of NORMAL")
    args = ap.parse_args()

    turns = make_turns(args.turns, args.context, args.output)
    best = {"packed": (0.0, 0), "json": (0.0, 0)}
    for _ in range(args.repeats):
        for name, cls in (("packed", SqliteStore), ("json", JsonTokensStore)):
            rate, size = run_once(cls, turns, args.batch, args.full)
            if rate > best[name][0]:
                best[name] = (rate, size)
    (p_rate, p_size), (j_rate, j_size) = best["packed"], best["json"]
    sync = "FULL" if args.full else "NORMAL"
    print(f"{args.turns:,} turns ({args.context}-token contexts, {args.output}-token outputs), batches of {args.batch}, synchronous={sync}")
    print(f"packed: {p_rate:,.0f} turns/s  json: {j_rate:,.0f} turns/s  ratio {p_rate / j_rate:.2f}")
    print(f"packed vs target {TARGET:,} turns/s: {p_rate / TARGET:.2f}x {'OK' if p_rate >= TARGET else 'BELOW TARGET'}")
    print(f"on disk: packed {p_size / args.turns:,.0f} B/turn  json {j_size / args.turns:,.0f} B/turn  ratio {j_size / p_size:.2f}")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "store_ingest.json").write_text(
        json.dumps(
            {
                "turns": args.turns,
                "batch": args.batch,
                "context": args.context,
                "output": args.output,
                "synchronous": sync,
                "packed_turns_per_s": p_rate,
                "json_turns_per_s": j_rate,
                "ratio": p_rate / j_rate,
                "target_turns_per_s": TARGET,
                "packed_bytes_per_turn": p_size / args.turns,
                "json_bytes_per_turn": j_size / args.turns,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
