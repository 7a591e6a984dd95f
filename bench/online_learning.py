"""Online learning works: held-out success of the base model vs the learned champion after a fixed demo budget.

    .venv/bin/python bench/online_learning.py --minutes 45 --n 100          # SmolLM2, the demo of docs/learning.md
    .venv/bin/python bench/online_learning.py --model tiny --minutes 2 --n 8 # smoke run
    .venv/bin/python bench/online_learning.py --minutes 15 --n 0 --baseline ../old  # learner speed vs an older checkout

What it runs: ``serve.py --demo`` (the sampled calculator agent ``demo-agent`` on ``calc_arith``, synthetic
users, the learner training ``calc-lora`` with its eval gate and A/B experiments) on a private port with a
kept data folder, for ``--minutes`` of wall time. Nothing is steered from here: promotion is the
learner's and the A/B experiment's own decision.

What it measures, at the end, side by side on one fresh server (the demo server, its users and its
learner are stopped first, so the comparison has the machine to itself): the demo agent on ``--n``
held-out problems (problem seed ``--heldout-seed``, which neither the demo users (seed 0) nor the
learner's gate (seed 100000) use), once served by the base model and once by the champion the
learner promoted (loaded from the adapter folder it published into), with the same sampling seed per
problem (paired), the arms interleaved. Also reported: every promotion and experiment
the learner logged (``history.jsonl``, ``GET /admin/experiments``), the demo users' success per serving
version (from the store), and the paired difference with a bootstrap 95% interval. Results go to ``bench/results/online_learning.json`` and the
learner's ``reward.png`` is copied next to it.

The learner's speed on the demo (``speed``): updates, optimizer steps, updates per hour of the demo's wall time,
the minute of the first update, trained tokens and trained tokens per second of step time, from the learner's
``history.jsonl``; where the learner records each update's ``timings``, also its busy seconds by part and its updates
per busy hour (a learner faster than the demo's traffic waits between updates, which the wall-clock rate counts). With ``--baseline DIR`` (another checkout, e.g. a ``git worktree`` of an older commit, run with
this checkout's virtualenv) the same demo first runs for the same minutes from that checkout's ``serve.py``, alone,
and the speed figures are reported side by side with their ratios; ``--n 0`` skips the held-out comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments.agent_eval import spawned_server  # noqa: E402
from learner.records.adapter_manifest import manifest_sha256  # noqa: E402
from learner.records.store import SqliteStore  # noqa: E402
from serve import DEMO_AGENT  # noqa: E402

FAMILY, AGENT, TASK = "calc-lora", "demo-agent", "calc_arith"


async def heldout(url: str, arms: list[str], n: int, seed: int, concurrency: int = 8) -> dict[str, list[bool]]:
    """Each problem once per arm, arms interleaved; the same sampling seed for every arm of a problem."""
    sem = asyncio.Semaphore(concurrency)
    out: dict[str, list[bool]] = {a: [False] * n for a in arms}
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:

        async def one(i: int, arm: str) -> None:
            body = {"task": TASK, "problem_index": i, "seed": seed, "sample_seed": 7 + i, "model": arm, "eval": True}
            async with sem:
                r = await client.post(f"/v1/agents/{AGENT}/runs", json=body)
            r.raise_for_status()
            out[arm][i] = bool(r.json().get("correct"))

        await asyncio.gather(*(one(i, a) for i in range(n) for a in arms))
    return out


def live_success(db: Path) -> dict[str, dict[str, float]]:
    """Success of the demo users' runs (not eval runs) per serving version, in order of first use, from the store."""
    store = SqliteStore(db)
    acc: dict[str, list[bool]] = {}
    for row in sorted(store.list_trajectories(limit=1_000_000), key=lambda r: r["created_at"]):
        meta = row["meta"]
        if meta.get("eval") or meta.get("agent") != AGENT or "correct" not in meta or meta.get("rerollout"):
            continue
        traj = store.get_trajectory(row["trajectory_id"])
        if traj is None or not traj.turns:
            continue
        acc.setdefault(traj.turns[0].adapter or "base", []).append(bool(meta["correct"]))
    return {a: {"n": len(v), "success": sum(v) / len(v)} for a, v in acc.items()}


def paired_ci(a: list[bool], b: list[bool], reps: int = 5000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of b - a with a percentile bootstrap 95% interval over problems."""
    d = [int(y) - int(x) for x, y in zip(a, b, strict=True)]
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(d) for _ in d) / len(d) for _ in range(reps))
    return sum(d) / len(d), means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def run_demo(args: argparse.Namespace, key: str, data: Path, root: Path) -> tuple[dict[str, Any], float]:
    """``serve.py --demo`` from checkout ``root`` for ``args.minutes`` in a fresh ``data`` folder; what it ended with, and its start time."""
    shutil.rmtree(data, ignore_errors=True)
    t0 = time.time()
    with spawned_server(args.model, key, ["--demo", *args.extra.split()], learner=True, data_dir=data, root=root) as url:
        admin = {"Authorization": f"Bearer {key}"}
        print(f"demo server at {url}; running the demo for {args.minutes:g} min", flush=True)
        deadline = t0 + 60 * args.minutes
        while time.time() < deadline:
            time.sleep(min(60.0, max(0.0, deadline - time.time())))
            st = httpx.get(f"{url}/admin/learner", headers=admin, timeout=30).json()["data"]
            s = st[0] if st else {}
            print(
                f"[{(time.time() - t0) / 60:5.1f} min] learner {s.get('state')} v{s.get('version')} champion={s.get('champion')} "
                f"experiment={s.get('experiment')}",
                flush=True,
            )
        end = {
            "base": httpx.get(f"{url}/ready", timeout=30).json()["model"],
            "champion": httpx.get(f"{url}/admin/adapters", headers=admin, timeout=30).json().get("aliases", {}).get(FAMILY),
            "experiments": httpx.get(f"{url}/admin/experiments", headers=admin, timeout=30).json(),
            "runs": httpx.get(f"{url}/admin/learner", headers=admin, timeout=30).json()["data"],
        }
    return end, t0


def read_history(data: Path) -> list[dict[str, Any]]:
    history_file = next(data.glob("learner/*/history.jsonl"), None)
    return [json.loads(x) for x in history_file.read_text().splitlines() if x.strip()] if history_file else []


def speed(t0: float, history: list[dict[str, Any]], minutes: float) -> dict[str, Any]:
    """The learner's pace over the demo's ``minutes`` (from the server's start at ``t0``), from its update history."""
    trained = [r for r in history if r.get("metrics")]  # updates that waited for data carry no metrics
    tokens = sum(int(r["metrics"].get("tokens", 0)) for r in trained)
    step_s = sum(float(r["metrics"].get("step_s", 0.0)) for r in trained)
    steps = sum(bool(r["metrics"].get("optimizer_step")) for r in trained)
    return {
        "updates": len(trained),
        "optimizer_steps": steps,
        "updates_per_hour": len(trained) / (minutes / 60),
        "optimizer_steps_per_hour": steps / (minutes / 60),
        "first_update_min": (trained[0]["at"] - t0) / 60 if trained else None,
        "trained_tokens": tokens,
        "step_s": step_s,
        "trained_tokens_per_step_s": tokens / step_s if step_s else None,
        "trained_samples": sum(int(r["metrics"].get("trained_samples", 0)) for r in trained),
        # from the updates' own timings (learner checkouts that record them): the time the learner was busy, and its pace
        # while busy, which the demo's traffic does not bound (a learner faster than its traffic waits between updates)
        **_busy(history),
    }


def _busy(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Busy seconds (every update's and every held version's release), split by part, and updates per busy hour."""
    timed = [r for r in history if r.get("timings")]
    updates = sum(1 for r in history if r.get("metrics"))
    if not timed or len(timed) < updates:  # a checkout that does not record timings
        return {}
    busy = sum(float(r["timings"]["total_s"]) for r in timed)
    parts = {k: sum(float(r["timings"][k]) for r in timed) for k in ("data_s", "train_s", "checkpoint_s", "release_s")}
    return {"busy_s": busy, "updates_per_busy_hour": updates / (busy / 3600) if busy else None, "busy_parts_s": parts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="default (SmolLM2) or tiny")
    p.add_argument("--minutes", type=float, default=45.0, help="wall-time budget of the demo before the held-out comparison")
    p.add_argument("--n", type=int, default=100, help="held-out problems per arm")
    p.add_argument("--heldout-seed", type=int, default=4242)
    p.add_argument("--extra", default="", help="more serve.py flags, space separated (e.g. '--learner-min-trajectories 16')")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--baseline", type=Path, default=None, help="another checkout whose demo runs first, alone, for the same minutes")
    args = p.parse_args()

    key = secrets.token_hex(8)
    args.out.mkdir(parents=True, exist_ok=True)
    baseline: dict[str, Any] | None = None
    if args.baseline is not None:
        bdata = args.out / "online_learning_baseline_data"
        print(f"baseline: the demo from {args.baseline} for {args.minutes:g} min", flush=True)
        baseline = speed(run_demo(args, key, bdata, root=args.baseline.resolve())[1], read_history(bdata), args.minutes)
        print("baseline speed: " + json.dumps(baseline), flush=True)
    data = args.out / "online_learning_data"
    end, t0 = run_demo(args, key, data, root=ROOT)
    base, champion, experiments, runs = end["base"], end["champion"], end["experiments"], end["runs"]
    history = read_history(data)
    passed = [r["version"] for r in history if r.get("gate", {}).get("decision") == "passed"]
    latest = f"{FAMILY}@{passed[-1]}" if passed and f"{FAMILY}@{passed[-1]}" != champion else None
    res: dict[str, list[bool]] = {}
    eval_s = 0.0
    if args.n > 0:
        # the held-out comparison runs on a fresh server without the demo users and the learner, so the arms get
        # the machine to themselves; the champion (and the newest version that passed the gate, when it is not the
        # champion: what the learner reached, promoted or not) are loaded from the folder the learner published into
        with spawned_server(args.model, key, ["--agent", json.dumps(DEMO_AGENT)], data_dir=data) as url:
            admin = {"Authorization": f"Bearer {key}"}
            arms = [base]
            for name in (champion, latest):
                if name is None:
                    continue
                version = int(name.split("@")[1])
                path = data / "adapters" / FAMILY / f"v{version}"
                sha = manifest_sha256(path)
                body = {"path": str(path), "family": FAMILY, "version": version, "sha256": sha}
                httpx.post(f"{url}/admin/adapters", headers=admin, json=body, timeout=300).raise_for_status()
                arms.append(name)
            print(f"held-out comparison on {args.n} problems: {', '.join(arms)}", flush=True)
            t1 = time.time()
            res = asyncio.run(heldout(url, arms, args.n, args.heldout_seed))
            eval_s = time.time() - t1
    for png in data.glob("learner/*/*.png"):
        shutil.copy(png, args.out / f"online_learning_{png.name}")
    live = live_success(data / "interactions.db")
    summary: dict[str, Any] = {
        "model": args.model,
        "minutes": args.minutes,
        "n": args.n,
        "base": base,
        "champion": champion,
        "latest_passed": latest,
        "success": {a: sum(v) / len(v) for a, v in res.items()},
        "updates": len(history),
        "speed": speed(t0, history, args.minutes),
        "baseline": {"checkout": str(args.baseline), "speed": baseline} if baseline is not None else None,
        "published": [r["version"] for r in history if r.get("gate", {}).get("decision") not in (None, "skipped", "held")],
        "gates": [r.get("gate") for r in history],
        "experiments": experiments,
        "learner": runs,
        "eval_s": eval_s,
        "live_success": live,
    }
    if baseline is not None:
        summary["speed_ratio"] = {
            k: summary["speed"][k] / baseline[k]
            for k in ("updates_per_hour", "optimizer_steps_per_hour", "trained_tokens", "trained_tokens_per_step_s", "updates_per_busy_hour")
            if baseline.get(k) and summary["speed"].get(k) is not None
        }
    if champion and res:
        diff, lo, hi = paired_ci(res[base], res[champion])
        summary["paired_diff"] = {"mean": diff, "ci95": [lo, hi]}
    if latest and res:
        ldiff, llo, lhi = paired_ci(res[base], res[latest])
        summary["latest_paired_diff"] = {"mean": ldiff, "ci95": [llo, lhi]}
    (args.out / "online_learning.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nupdates: {len(history)}; published versions: {summary['published']}; champion at the end: {champion}")
    print("live success of the demo users' runs per serving version: " + ", ".join(f"{a} {v['success']:.3f} (n={v['n']})" for a, v in live.items()))
    for a, v in res.items():
        print(f"held-out success  {a:<28} {sum(v) / len(v):.3f}  (n={len(v)})")
    print("learner speed: " + json.dumps(summary["speed"]))
    if baseline is not None:
        print("baseline speed: " + json.dumps(baseline) + "\nratio (this checkout / baseline): " + json.dumps(summary["speed_ratio"]))
    if champion and res:
        print(f"champion - base: {diff * 100:+.1f} points, 95% CI [{lo * 100:+.1f}, {hi * 100:+.1f}] (paired bootstrap)")
    elif not champion:
        print("no champion was promoted within the budget")
    if latest and res:
        print(
            f"{latest} (newest version that passed the gate, not the champion) - base: {ldiff * 100:+.1f} points, 95% CI [{llo * 100:+.1f}, {lhi * 100:+.1f}]"
        )
    print(f"results: {args.out / 'online_learning.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
