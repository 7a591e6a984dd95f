"""Offline replay of a recorded run: the chat learner's sample → advantage → step path over a stored data folder.

    .venv/bin/python bench/replay_learning.py --data-dir /path/to/live_traffic_data --minutes 30 \
        --settings '{"trainer": {"lr": 3e-4, "old_logprobs": "recompute", "behaviour_weight_cap": 2.0}}' --heldout-n 200

What it runs: a ``LoRATrainer`` on the base model the run served (``<data-dir>/models/<name>``, or ``--model``) walks the
recorded traffic of ``<data-dir>/interactions.db`` (a consistent copy, WAL included, made through a read-only connection; the folder is not written) in windows of ``--window-s`` of
recorded time, from the first turn on, for ``--minutes``. Each window is one update exactly as the learner service
makes it for a chat family: ``learner.samples.collect_samples`` (the ``[samples]`` rules, every version fresh: the
recorded turns came from the live run's versions, so there is no staleness to count), the configured estimator, the
one-off prompts' running baseline (``[singletons]``), ``trainer.step``. Then a fresh server answers ``--heldout-n``
held-out problems in the two-turn focus shape of ``bench/live_traffic.py`` with the final adapter and the base model
(greedy; paired difference, 95 % bootstrap CI).

What it answers: how much a learner configuration gets out of the traffic an hour of users produced, in minutes
rather than an hour of live traffic per try. What it does not: the turns were sampled by the live run's versions,
not by the replay's (its updates are off-policy; ``old_logprobs = "recompute"`` with a behaviour weight cap is the
setting that corrects for it), and there are no gates, experiments or group completion (no server while it trains).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def replay(data_dir: Path, model: Path, family: str, settings: dict[str, Any], minutes: float, window_s: float, work: Path) -> dict[str, Any]:
    from learner.baseline import singleton_advantages
    from learner.config import LearnerSettings
    from learner.records.store import SqliteStore
    from learner.samples import Cursor, collect_samples
    from learner.trainer import LoRATrainer
    from learner.update import estimate

    db = work / "interactions.db"
    src = sqlite3.connect(f"file:{data_dir / 'interactions.db'}?mode=ro", uri=True)  # read only; the backup includes the WAL
    with sqlite3.connect(db) as dst:
        src.backup(dst)
    src.close()
    with sqlite3.connect(db) as con:
        t0, t1 = con.execute("SELECT min(created_at), max(created_at) FROM turns").fetchone()
    end = min(t1, t0 + 60 * minutes)
    s = LearnerSettings(**_merge({"family": family, "traffic": {"chat": True, "agents": []}, "samples": {"settle_s": 0}}, settings))
    store = SqliteStore(db)
    trainer = LoRATrainer(model, s.trainer, s.lora)
    cursor, baseline, updates = Cursor(), None, []
    at = t0 + window_s
    while at - window_s < end:
        batch = collect_samples(store, family=family, min_version=-1, now=min(at, end + 1e-3), cursor=cursor, cfg=s.samples, traffic=s.traffic)
        cursor = batch.cursor
        at += window_s
        if not batch.samples:
            continue
        samples = batch.samples
        adv = estimate(samples, s.trainer.estimator, s.trainer.estimator_params)
        baselined = singleton_advantages(samples, adv, baseline, s.singletons, s.trainer.estimator)
        if baselined is not None:
            adv, baseline, _warm = baselined
        t = time.monotonic()
        m = trainer.step(samples, adv, skipped=batch.counts.as_dict()).as_dict()
        row = {
            k: m.get(k) for k in ("version", "samples", "trained_samples", "tokens", "reward_mean", "adv_mean", "adv_std", "clip_frac", "grad_norm")
        }
        row |= {"minute": round((at - window_s - t0) / 60, 1), "step_s": round(time.monotonic() - t, 1)}
        updates.append(row)
        print(json.dumps(row), flush=True)
    from learner.publish import publish_adapter

    published = publish_adapter(trainer.model, work / "adapters", family, max(1, trainer.version))
    return {"updates": updates, "adapter": str(published.path), "champion": f"{family}@{max(1, trainer.version)}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, required=True, help="a recorded run's data folder (read only)")
    p.add_argument("--model", type=Path, help="the base model folder (default: the only one under <data-dir>/models)")
    p.add_argument("--serve-model", default="default", help="serve.py --model for the held-out server (the same base model)")
    p.add_argument("--family", default="chat-lora")
    p.add_argument("--settings", default="{}", help="learner settings (JSON, the [samples], [trainer], [singletons]... tables)")
    p.add_argument("--minutes", type=float, default=60.0, help="how much of the recorded traffic to replay, from its start")
    p.add_argument("--window-s", type=float, default=180.0, help="recorded seconds per update")
    p.add_argument("--heldout-n", type=int, default=200)
    p.add_argument("--heldout-seed", type=int, default=4242)
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--task-options", default='{"max_terms": 2, "max_digits": 1}')
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    model = args.model or next(p for p in sorted((args.data_dir / "models").iterdir()) if p.is_dir() and not p.name.startswith("."))
    settings = json.loads(args.settings)
    with tempfile.TemporaryDirectory(prefix="replay-") as tmp:
        t = time.monotonic()
        out: dict[str, Any] = {"command": " ".join(sys.argv), "settings": settings, "minutes": args.minutes, "window_s": args.window_s}
        out |= replay(args.data_dir, model, args.family, settings, args.minutes, args.window_s, Path(tmp))
        out["train_s"] = round(time.monotonic() - t, 1)
        if args.heldout_n > 0:
            from agents.tasks import get_task
            from bench.live_traffic import evaluate

            task = get_task(args.task, **json.loads(args.task_options))
            held = task.problems(args.heldout_n, seed=args.heldout_seed)
            out["heldout"] = evaluate(args.serve_model, out["champion"], Path(out["adapter"]), held, task, args.max_tokens)
            print(json.dumps(out["heldout"]), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
