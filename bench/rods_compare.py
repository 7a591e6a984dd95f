"""RODS (a replay pool moved by boundary scores, grown with verified variants) vs a fixed dataset of the same task family.

    .venv/bin/python bench/rods_compare.py --seeds 0,1 --updates 12 --eval-every 3        # SmolLM2 on calc_arith without tools
    .venv/bin/python bench/rods_compare.py --model tiny --seeds 0 --updates 2 --eval-every 1 --n-eval 8   # smoke run

Both arms train one LoRA family each on one shared ``serve.py`` with the learner's ``LearnerService.update``
(GRPO, new versions served at once; ``bench/_rl_harness.py``) and spend the same number of trajectories per
update (``--items`` problems x ``--group`` runs):

- ``fixed``: the dataset is problems ``0..--dataset-1`` (problem seed 0); each update takes the next ``--items``
  of them in order (cycling) and runs each ``--group`` times through the admin runs endpoint;
- ``rods``: ``[rods] enabled`` with the same problems as seed items: each update samples ``--items`` pool items by
  boundary score ``4 Var_G(r)``, runs each ``--group`` times, synthesises ``--variants`` verified variants of
  every item at ``b >= --tau`` (``POST /admin/agents/{name}/variants``) and evicts variants that stay at zero
  variance (``learner/rods.py``, ``learner/sources.py``).

Every ``--eval-every`` updates both arms' current versions are evaluated on ``--n-eval`` held-out problems
(problem seed 4242, same problems and sampling seeds for every arm). Reported: held-out success against the
number of trajectories generated (with 95% bootstrap CIs over problems and seeds at each point); the
trajectories RODS needed to first reach the fixed dataset's final held-out success (target: 3x fewer; seed:
about 20x); the zero-variance fraction per update for both arms; the pool size per update. Arms run
interleaved (seed by seed). ``rods_compare.json`` under ``bench/results/rods_compare/``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._rl_harness import add_agent, agent_runs, base_heldout, bench_server, heldout_results, service, write_json  # noqa: E402
from learner.rods import boundary_score  # noqa: E402


def agent(name: str, family: str | None, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": name,
        "system_prompt": "You are a careful assistant.",
        "temperature": args.temperature,
        "max_turns": 1,
        "max_tokens_per_turn": args.max_tokens,
        "task": args.task,
        "task_options": json.loads(args.task_options),
        **({"adapter_family": family} if family else {}),
    }


def run_arm(url: str, key: str, data: Path, model_path: Path, arm: str, seed: int, args: argparse.Namespace, base: str) -> dict[str, Any]:
    family, name = f"{arm}-s{seed}", f"rods-{arm}-s{seed}"
    add_agent(url, key, agent(name, family, args))
    s: dict[str, Any] = {
        "family": family,
        "lora": {"rank": 8, "alpha": 16.0},
        "trainer": {"lr": args.lr, "estimator": "grpo", "seed": seed, "threads": None, "progress": False},
        "samples": {"settle_s": 0.0, "max_staleness": 1},
    }
    if arm == "rods":
        s["rods"] = {
            "enabled": True,
            "seeds": args.dataset,
            "items_per_update": args.items,
            "group": args.group,
            "tau": args.tau,
            "variants": args.variants,
            "capacity": args.capacity,
        }
        s["rerollouts"] = {"concurrency": 16}
    svc = service(url, key, data, model_path, name, s)
    trajectories, updates, curve, steps = 0, 0, [], []
    t0 = time.perf_counter()
    while updates < args.updates:
        if arm == "fixed":
            items = [(updates * args.items + j) % args.dataset for j in range(args.items)]
            bodies = [{"problem_index": i, "seed": 0, "sample_seed": seed * 100_003 + updates * 977 + k} for i in items for k in range(args.group)]
            runs = agent_runs(url, name, bodies, admin_key=key)
            time.sleep(0.5)  # the recorder's commit window
            rewards = [[float(r.get("reward") or 0.0) for r in runs[j * args.group : (j + 1) * args.group]] for j in range(len(items))]
            zero = sum(1 for rs in rewards if boundary_score(rs) == 0.0) / len(items)
            n_runs, success, pool = len(runs), sum(sum(rs) for rs in rewards) / len(runs), None
            rec = svc.update()
        else:
            rec = svc.update()
            src = rec.get("sources", {})
            rods = src.get("rods", {})
            n_runs, zero, pool = int(src.get("rods_runs", 0)), float(rods.get("zero_variance_fraction", 0.0)), rods.get("pool_size")
            success = float(rec["metrics"].get("reward_mean", 0.0) or 0.0)
        trajectories += n_runs
        updates += 1
        steps.append({"update": updates, "trajectories": trajectories, "zero_variance_fraction": zero, "train_reward": success, "pool_size": pool})
        print(
            f"  {family} update {updates}: trajectories {trajectories}, zero-variance {zero:.2f}, train reward {success:.2f}, pool {pool}", flush=True
        )
        if updates % args.eval_every == 0 or updates == args.updates:
            model = svc.status.champion or base
            runs = heldout_results(url, "rods-eval", args.task, args.n_eval, model)
            curve.append({"update": updates, "trajectories": trajectories, "model": model, "runs": runs, "success": sum(runs) / len(runs)})
            print(f"  {family} held-out success {sum(runs) / len(runs):.3f} after {trajectories} trajectories ({model})", flush=True)
    return {"arm": arm, "seed": seed, "family": family, "steps": steps, "curve": curve, "wall_s": time.perf_counter() - t0}


def report(arms: list[dict[str, Any]], base_runs: list[bool]) -> dict[str, Any]:
    rng = random.Random(0)
    n = len(base_runs)
    out: dict[str, Any] = {"base": sum(base_runs) / n, "n_eval": n}

    def ci(per_seed: list[list[bool]], reps: int = 4000) -> tuple[float, float, float]:
        pt = sum(map(sum, per_seed)) / (len(per_seed) * n)
        draws = []
        for _ in range(reps):
            ss = [rng.choice(per_seed) for _ in per_seed]
            ps = [rng.randrange(n) for _ in range(n)]
            draws.append(sum(s[p] for s in ss for p in ps) / (len(ss) * n))
        draws.sort()
        return pt, draws[int(0.025 * reps)], draws[int(0.975 * reps) - 1]

    print("\n| arm | update | trajectories (mean) | held-out success, mean [95% CI] | zero-variance fraction (mean over updates so far) |")
    print("|---|---|---|---|---|")
    curves: dict[str, list[dict[str, Any]]] = {}
    for arm in ("fixed", "rods"):
        mine = [a for a in arms if a["arm"] == arm]
        if not mine:
            continue
        points = []
        for k, point in enumerate(mine[0]["curve"]):
            per_seed = [a["curve"][k]["runs"] for a in mine if len(a["curve"]) > k]
            traj = sum(a["curve"][k]["trajectories"] for a in mine if len(a["curve"]) > k) / len(per_seed)
            zeros = [s["zero_variance_fraction"] for a in mine for s in a["steps"] if s["update"] <= point["update"]]
            pt, lo, hi = ci(per_seed)
            points.append({"update": point["update"], "trajectories": traj, "success": pt, "ci": [lo, hi]})
            print(f"| {arm} | {point['update']} | {traj:.0f} | {pt:.3f} [{lo:.3f}, {hi:.3f}] | {sum(zeros) / len(zeros):.2f} |")
        curves[arm] = points
    out["curves"] = curves
    print(f"base model held-out success: {out['base']:.3f} (n={n})")
    if "fixed" in curves and "rods" in curves and curves["fixed"]:
        target = curves["fixed"][-1]["success"]
        reached = next((p for p in curves["rods"] if p["success"] >= target), None)
        fixed_traj = curves["fixed"][-1]["trajectories"]
        if target <= out["base"]:
            print(f"the fixed dataset's final held-out success ({target:.3f}) is not above the base model's ({out['base']:.3f}): no ratio to report")
        elif reached is not None and reached["trajectories"] > 0:
            out["trajectories_ratio"] = fixed_traj / reached["trajectories"]
            print(
                f"rods reached the fixed dataset's final held-out success ({target:.3f} after {fixed_traj:.0f} trajectories) after "
                f"{reached['trajectories']:.0f} trajectories: {out['trajectories_ratio']:.1f}x fewer (target >= 3x; seed about 20x)"
            )
        else:
            print(f"rods did not reach the fixed dataset's final held-out success ({target:.3f}) within its run")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--task", default="calc_arith")
    p.add_argument("--task-options", default='{"use_tools": false, "n_ops": 1}', help="one-step calc_arith: SmolLM2 solves some")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (at 1.0 SmolLM2-135M solved 0 of 24 held-out problems)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--updates", type=int, default=12)
    p.add_argument("--items", type=int, default=4, help="problems per update")
    p.add_argument("--group", type=int, default=4, help="runs per problem")
    p.add_argument("--dataset", type=int, default=32, help="the fixed dataset's size = RODS's seed items")
    p.add_argument("--tau", type=float, default=0.5)
    p.add_argument("--variants", type=int, default=2)
    p.add_argument("--capacity", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--n-eval", type=int, default=32)
    p.add_argument("--arms", default="fixed,rods")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rods_compare")
    args = p.parse_args()

    arms: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with bench_server(args.model, args.out) as srv:
        base_runs = base_heldout(srv, agent("rods-eval", None, args), args.task, args.n_eval)
        print(f"base held-out success {sum(base_runs) / len(base_runs):.3f} (n={args.n_eval})", flush=True)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for arm in args.arms.split(","):
                print(f"arm {arm} seed {seed}", flush=True)
                arms.append(run_arm(srv.url, srv.key, srv.data, srv.model_path, arm, seed, args, srv.base))
                write_json(args.out / "rods_compare.json", {"args": {k: str(v) for k, v in vars(args).items()}, "arms": arms})
    summary = report(arms, base_runs)
    summary["wall_s"] = time.perf_counter() - t0
    write_json(args.out / "rods_compare.json", {"args": {k: str(v) for k, v in vars(args).items()}, "arms": arms, "summary": summary})
    print(f"wall {summary['wall_s']:.0f} s; results: {args.out / 'rods_compare.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
