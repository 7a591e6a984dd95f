"""Online learning works: held-out success of the base model vs the learned champion after a fixed demo budget.

    .venv/bin/python bench/online_learning.py --minutes 45 --n 100          # SmolLM2, the demo of docs/learning.md
    .venv/bin/python bench/online_learning.py --model tiny --minutes 2 --n 8 # smoke run

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="default (SmolLM2) or tiny")
    p.add_argument("--minutes", type=float, default=45.0, help="wall-time budget of the demo before the held-out comparison")
    p.add_argument("--n", type=int, default=100, help="held-out problems per arm")
    p.add_argument("--heldout-seed", type=int, default=4242)
    p.add_argument("--extra", default="", help="more serve.py flags, space separated (e.g. '--learner-min-trajectories 16')")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()

    key = secrets.token_hex(8)
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "online_learning_data"
    shutil.rmtree(data, ignore_errors=True)
    t0 = time.time()
    with spawned_server(args.model, key, ["--demo", *args.extra.split()], learner=True, data_dir=data) as url:
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
        base = httpx.get(f"{url}/ready", timeout=30).json()["model"]
        aliases = httpx.get(f"{url}/admin/adapters", headers=admin, timeout=30).json().get("aliases", {})
        champion = aliases.get(FAMILY)
        experiments = httpx.get(f"{url}/admin/experiments", headers=admin, timeout=30).json()
        runs = httpx.get(f"{url}/admin/learner", headers=admin, timeout=30).json()["data"]
    history_file = next(data.glob("learner/*/history.jsonl"), None)
    history = [json.loads(x) for x in history_file.read_text().splitlines() if x.strip()] if history_file else []
    passed = [r["version"] for r in history if r.get("gate", {}).get("decision") == "passed"]
    latest = f"{FAMILY}@{passed[-1]}" if passed and f"{FAMILY}@{passed[-1]}" != champion else None
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
        "published": [r["version"] for r in history if r.get("gate", {}).get("decision") not in (None, "skipped", "held")],
        "gates": [r.get("gate") for r in history],
        "experiments": experiments,
        "learner": runs,
        "eval_s": eval_s,
        "live_success": live,
    }
    if champion:
        diff, lo, hi = paired_ci(res[base], res[champion])
        summary["paired_diff"] = {"mean": diff, "ci95": [lo, hi]}
    if latest:
        ldiff, llo, lhi = paired_ci(res[base], res[latest])
        summary["latest_paired_diff"] = {"mean": ldiff, "ci95": [llo, lhi]}
    (args.out / "online_learning.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nupdates: {len(history)}; published versions: {summary['published']}; champion at the end: {champion}")
    print("live success of the demo users' runs per serving version: " + ", ".join(f"{a} {v['success']:.3f} (n={v['n']})" for a, v in live.items()))
    for a, v in res.items():
        print(f"held-out success  {a:<28} {sum(v) / len(v):.3f}  (n={len(v)})")
    if champion:
        print(f"champion - base: {diff * 100:+.1f} points, 95% CI [{lo * 100:+.1f}, {hi * 100:+.1f}] (paired bootstrap)")
    else:
        print("no champion was promoted within the budget")
    if latest:
        print(
            f"{latest} (newest version that passed the gate, not the champion) - base: {ldiff * 100:+.1f} points, 95% CI [{llo * 100:+.1f}, {lhi * 100:+.1f}]"
        )
    print(f"results: {args.out / 'online_learning.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
