"""``python -m learner``: the learner's command line. For now one command, ``export``.

    python -m learner export --format jsonl [--data-dir .data] [--db PATH] [--out FILE|-] [--since ISO-or-unix] [--rewarded]

writes one JSON object per recorded turn (``SqliteStore.iter_samples``, in insertion order) to
``--out`` (default ``-``, stdout) and the count to stderr. The store is ``--db`` or, by default,
``<data-dir>/interactions.db``; a missing store is an error (export never creates one). ``--since``
takes Unix seconds (``1767225600``) or an ISO 8601 time (``2026-01-01T00:00:00``; without a UTC
offset it is read as UTC) and keeps turns created at or after it. ``--rewarded`` keeps turns with a
reward on them or on their trajectory.

Each line::

    {"turn_id", "trajectory_id", "session_id", "index",            # where the turn sits
     "context_ids": [int],   # the exact prompt token ids the engine was given (all earlier turns included)
     "output_ids": [int],    # the sampled response token ids (a final eos included)
     "logprobs": [float],    # behaviour-policy logprob of each output token (float32 precision); may be []
     "loss_mask": [0|1],     # per output token: 1 = model token to train on
     "adapter", "finish_reason", "created_at",
     "reward": float|null,             # the latest turn-level reward
     "trajectory_reward": float|null,  # the latest trajectory-level reward
     "rewards": [{reward_id, target, target_id, value, source, created_at, comment, idempotency_key}],
     "trainable": bool,      # False when an agent run broke the prefix invariant (train on it at your own risk)
     "task_key": str|null}   # the agent run's task key (same problem → same key), for grouping

Reading it from other trainers (``datasets.load_dataset("json", data_files="samples.jsonl")``):
- TRL: ``context_ids`` → ``prompt_ids``, ``output_ids`` → ``completion_ids``, ``loss_mask`` →
  ``completion_mask``, ``logprobs`` → ``old_per_token_logps`` (the sampling logprobs, for the
  importance ratio), ``reward``/``trajectory_reward`` → the reward a GRPO-style advantage is computed
  from (group rows by whatever task key you use). Never re-tokenize: the ids are what the model saw.
- verl (``DataProto``): ``context_ids`` → ``prompts`` (left-pad to a batch), ``output_ids`` →
  ``responses`` (right-pad), ``loss_mask`` → ``response_mask``, ``logprobs`` → ``old_log_probs``,
  the reward → ``token_level_scores`` on the last response token; ``trajectory_id`` groups turns of
  one multi-turn rollout, ``index`` orders them.

Only ``jsonl`` for now; other formats are rejected.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from learner.store import DEFAULT_DB_NAME, SqliteStore, db_path

FORMATS = ("jsonl",)


def parse_time(text: str) -> float:
    """Unix seconds or an ISO 8601 time (naive = UTC) → Unix seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a Unix time or an ISO 8601 time: {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m learner", description="loopwise learner")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write recorded turn samples for external trainers")
    ex.add_argument("--format", required=True, help="output format; only 'jsonl' for now")
    ex.add_argument("--data-dir", type=Path, default=Path(".data"), help="data directory (default .data)")
    ex.add_argument("--db", type=Path, default=None, help=f"store file (default <data-dir>/{DEFAULT_DB_NAME})")
    ex.add_argument("--out", default="-", help="output file, or - for stdout (default)")
    ex.add_argument("--since", type=parse_time, default=None, help="only turns created at/after this (Unix seconds or ISO 8601, naive = UTC)")
    ex.add_argument("--rewarded", action="store_true", help="only turns with a reward on them or on their trajectory")
    return parser


def export(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        print(f"error: unsupported export format {args.format!r}; supported: {', '.join(FORMATS)}", file=sys.stderr)
        return 2
    path = args.db if args.db is not None else db_path(args.data_dir)
    if not path.is_file():
        print(f"error: no interaction store at {path}", file=sys.stderr)
        return 2
    store = SqliteStore(path)
    out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    n = 0
    try:
        for sample in store.iter_samples(since=args.since, rewarded=True if args.rewarded else None):
            out.write(json.dumps(sample, separators=(",", ":"), ensure_ascii=False))
            out.write("\n")
            n += 1
    finally:
        if out is not sys.stdout:
            out.close()
        else:
            out.flush()
        store.close()
    print(f"exported {n} samples from {path} to {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "export":
        return export(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
