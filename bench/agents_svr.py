"""SVR adaptive stop vs a fixed horizon, side by side on one real ``serve.py`` (SmolLM2 by default).

    .venv/bin/python bench/agents_svr.py                     # SmolLM2, basic_arithmetic, 40 problems, horizon 6
    .venv/bin/python bench/agents_svr.py --model tiny --n 8  # a quick smoke run
    .venv/bin/python bench/agents_svr.py --task calc_arith --tools calculator

Two agents with the same system prompt, answer format (SVR's tagged solution / verdict / confidence)
and feedback between turns, differing only in the stop rule: ``svr`` (stop once the model says Correct
with confidence ≥ τ) and ``fixed`` (always run ``--horizon`` turns, answer = the last turn's). Both run
the same problems (same seed) through ``POST /v1/agents/{name}/runs``, so every run is recorded with its
verifier reward. Printed: accuracy, mean turns, mean tokens, and for SVR the calibration of the stated
confidence; the ratio of SVR's turns to the fixed horizon's (target ≤ 0.40) and the accuracy difference
(target within 2 points).

Results also go to bench/results/agents_svr.json. Not here: trained adapters (the learner issue revisits
this figure after training).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments.agent_eval import report, run_all, spawned_server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--task", default="basic_arithmetic")
    ap.add_argument("--tools", action="append", default=[])
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--horizon", type=int, default=6)
    ap.add_argument("--tau", type=float, default=0.7)
    ap.add_argument("--max-tokens-per-turn", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()

    common = {
        "system_prompt": "You are a careful problem solver.",
        "tools": args.tools,
        "max_turns": args.horizon,
        "max_tokens_per_turn": args.max_tokens_per_turn,
        "token_budget": args.horizon * args.max_tokens_per_turn,
        "task": args.task,
    }
    agents = {
        "svr": {**common, "name": "bench-svr", "stop_policy": "svr", "stop_params": {"tau": args.tau}},
        "fixed": {**common, "name": "bench-fixed", "stop_policy": "fixed", "stop_params": {"fmt": "svr", "tau": args.tau}},
    }
    admin_key = "bench-admin"
    results: dict[str, dict] = {}
    with spawned_server(args.model, admin_key) as url:
        import httpx

        for cfg in agents.values():
            r = httpx.post(f"{url}/admin/agents", json=cfg, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)
            r.raise_for_status()
        ns = argparse.Namespace(
            task=args.task, n=args.n, seed=args.seed, adapter=None, max_turns=None, api_key=None, concurrency=args.concurrency, timeout=1800.0
        )
        for label, cfg in agents.items():
            runs = asyncio.run(run_all(ns, url, cfg["name"]))
            results[label] = report(runs)
            print(f"{label}: done ({results[label]['success_rate']:.3f} success, {results[label]['mean_turns']:.2f} turns)", flush=True)

    svr, fixed = results["svr"], results["fixed"]
    rows = [
        ("accuracy", svr["success_rate"], fixed["success_rate"], svr["success_rate"] - fixed["success_rate"], "diff within ±0.02"),
        ("mean turns", svr["mean_turns"], fixed["mean_turns"], svr["mean_turns"] / fixed["mean_turns"], "ratio ≤ 0.40"),
        ("mean tokens", svr["mean_tokens"], fixed["mean_tokens"], svr["mean_tokens"] / fixed["mean_tokens"], "(report)"),
        ("wrong-stop rate", svr["wrong_stop_rate"], None, None, "(report)"),
        ("Brier (stated conf.)", svr["brier"], fixed["brier"], None, "(report)"),
        ("ECE (stated conf.)", svr["ece"], fixed["ece"], None, "(report)"),
    ]
    print(f"\nSVR vs fixed horizon {args.horizon} — {args.model}, task {args.task}, n={args.n}, seed {args.seed}, tau {args.tau}")
    print(f"{'measure':<22}{'svr':>10}{'fixed':>10}{'svr vs fixed':>14}  target")
    for name, a, b, c, target in rows:

        def f(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.3f}"

        print(f"{name:<22}{f(a):>10}{f(b):>10}{f(c):>14}  {target}")
    print(f"svr 95% CI [{svr['ci_low']:.3f}, {svr['ci_high']:.3f}]; fixed 95% CI [{fixed['ci_low']:.3f}, {fixed['ci_high']:.3f}]")
    print(f"svr stop reasons: {svr['stop_reasons']}; format failures svr {svr['format_failures']}, fixed {fixed['format_failures']}")
    out = ROOT / "bench" / "results" / "agents_svr.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "svr": svr, "fixed": fixed}, indent=2))


if __name__ == "__main__":
    main()
