"""The learner's own runs sampled during its step (``overlap_sampling``) vs sampled before it, side by side on one server.

    .venv/bin/python bench/learner_overlap.py --minutes 4 --rounds 2       # SmolLM2, SVR fixed-horizon runs
    .venv/bin/python bench/learner_overlap.py --model tiny --minutes 0.5   # smoke run

What it runs: one spawned ``serve.py`` (``--threads`` CPU threads, 1 by default: the learner's trainer takes the other
core of a 2-core machine) with an SVR agent per arm, and the learner's own ``LearnerService.update`` in this process
(the benchmarks' ``PromoteService``: every new version serves at once, no gate), with ``[svr]`` making
``--prompts`` x ``--group`` fixed-horizon runs of ``--horizon`` turns per update, the learner's own runs. Two arms,
``overlap_sampling`` off and on, each a fresh adapter family, alternated (off, on, off, on, ...) for ``--rounds``
rounds of ``--minutes`` each, so drift in the machine's load hits both alike.

What it reports per arm (summed over its rounds): updates, optimizer steps, updates per hour, the training runs'
sampled tokens per hour (what the trainer got to train on), trained tokens and the step's seconds, the steady rate
(updates per hour past each round's first update, which also loads the trainer and has nothing sampled ahead); and
the ratios on ÷ off. Runs sampled ahead that no update took by the end of a round are waited for (so they do not load the next
round) and not counted. Results go to ``<--out>/learner_overlap.json``. Not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._rl_harness import BenchServer, add_agent, bench_server, service, write_json  # noqa: E402

ADMIN = "bench-admin"
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def arm_round(srv: BenchServer, args: argparse.Namespace, arm: str, k: int) -> dict[str, Any]:
    """One round of one arm: a fresh family and agent, updates until ``--minutes`` are up; its figures."""
    family, agent = f"ovl-{arm}-{k}", f"ovl-{arm}-{k}"
    add_agent(srv.url, ADMIN, {
        "name": agent, "system_prompt": "You are a careful problem solver.", "max_turns": args.horizon,
        "max_tokens_per_turn": args.max_tokens, "token_budget": args.horizon * args.max_tokens, "task": args.task,
        "task_options": args.task_options, "temperature": 1.0, "adapter_family": family, "stop_policy": "svr",
        "stop_params": {"tau": 0.7},
    })  # fmt: skip
    settings = {
        "family": family,
        "lora": LORA,
        "trainer": {
            "progress": False,
            "lr": args.lr,
            "estimator": "turn_grpo",
            "estimator_params": {"source": "reward"},
            "threads": args.trainer_threads,
        },
        "samples": {"settle_s": 0, "max_staleness": 2},
        "svr": {"enabled": True, "problems_per_update": args.prompts, "group": args.group, "horizon": args.horizon},
        "overlap_sampling": arm == "on",
    }
    svc = service(srv.url, ADMIN, srv.data, srv.model_path, agent, settings)
    t0 = time.monotonic()
    rows = []
    while time.monotonic() - t0 < 60 * args.minutes:
        u0 = time.monotonic()
        rec = svc.update(force=True)
        m = rec.get("metrics") or {}
        rows.append({
            "wall_s": time.monotonic() - u0, "sampled_tokens": int(rec.get("svr_runs", {}).get("sampled_tokens", 0)),
            "tokens": int(m.get("tokens", 0)), "step_s": float(m.get("step_s", 0.0)), "optimizer_step": bool(m.get("optimizer_step")),
        })  # fmt: skip
        print(f"[{arm} round {k}] update {len(rows)}: {json.dumps(rows[-1])}", flush=True)
    elapsed = time.monotonic() - t0
    svc.wait_for_ahead(600)  # runs sampled ahead for an update that will not come: made outside the clock
    svc.store.close()
    svc.state.trainer = None
    return {"arm": arm, "round": k, "elapsed_s": elapsed, "updates": rows}


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    hours = sum(r["elapsed_s"] for r in rounds) / 3600
    rows = [u for r in rounds for u in r["updates"]]
    later = [u for r in rounds for u in r["updates"][1:]]
    return {
        "hours": hours,
        "updates": len(rows),
        "optimizer_steps": sum(u["optimizer_step"] for u in rows),
        "updates_per_hour": len(rows) / hours,
        "sampled_tokens_per_hour": sum(u["sampled_tokens"] for u in rows) / hours,
        "trained_tokens": sum(u["tokens"] for u in rows),
        "step_s": sum(u["step_s"] for u in rows),
        "mean_update_s": sum(u["wall_s"] for u in rows) / max(1, len(rows)),
        # past each round's first update (which also loads the trainer and has nothing sampled ahead): the steady rate
        "steady_updates_per_hour": 3600 * len(later) / max(1e-9, sum(u["wall_s"] for u in later)),
        "steady_update_s": [round(u["wall_s"], 1) for u in later],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--task", default="calc_arith")
    ap.add_argument("--task-options", type=json.loads, default={"n_ops": 1, "use_tools": False})
    ap.add_argument("--minutes", type=float, default=4.0, help="wall time of each arm's round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--horizon", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1, help="the server's CPU threads")
    ap.add_argument("--trainer-threads", type=int, default=1, help="the trainer's CPU threads")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "learner_overlap")
    args = ap.parse_args()

    rounds: list[dict[str, Any]] = []
    with bench_server(args.model, args.out, flags=["--threads", str(args.threads)], key=ADMIN) as srv:
        for k in range(args.rounds):
            for arm in ("off", "on"):
                rounds.append(arm_round(srv, args, arm, k))
    arms = {arm: summary([r for r in rounds if r["arm"] == arm]) for arm in ("off", "on")}
    ratio = {k: arms["on"][k] / arms["off"][k] for k in ("updates_per_hour", "sampled_tokens_per_hour", "steady_updates_per_hour") if arms["off"][k]}
    out = {"design": {k: v for k, v in vars(args).items() if k != "out"}, "arms": arms, "ratio_on_off": ratio, "rounds": rounds}
    write_json(args.out / "learner_overlap.json", out)
    for arm, s in arms.items():
        print(f"overlap {arm:3}: {json.dumps(s)}")
    print(f"on / off: {json.dumps(ratio)}")
    print(f"results: {args.out / 'learner_overlap.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
