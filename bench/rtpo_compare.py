"""RTPO vs trajectory-level GRPO vs turn-level GRPO on a multi-turn task, at equal sampled-token budget.

    .venv/bin/python bench/rtpo_compare.py --task feedback:calc_arith --task-options '{"n_ops": 1, "use_tools": false}' \
        --max-turns 3 --max-tokens 64 --seeds 0,1,2 --budget 8000          # SmolLM2, TCPO's verifier-feedback mode
    .venv/bin/python bench/rtpo_compare.py --seeds 0,1,2 --budget 6000          # SmolLM2, FrozenLake
    .venv/bin/python bench/rtpo_compare.py --model tiny --seeds 0 --budget 300  # smoke run
    ... the same command --resume                                                 # continue a cut run (or add --seeds)
    ... --resume --seeds 2 --estimators turn_grpo,rtpo                           # run those arms next, the rest later

A run is resumable (runs of hours span days): ``rtpo_compare.json`` holds the design, the base evaluation and
every finished arm; ``arm-<family>.json`` the running arm's iterations, written after each update (whose learner
checkpoint is written before it). ``--resume`` restarts the server on the same data folder, skips finished arms,
and continues a cut arm from its learner's checkpoint, recording where it resumed (``resumed`` in the arm).

Task: ``frozenlake`` by default (random 4x4 maps, deterministic moves), one action per turn, the
episode reward (1 at the goal) as the outcome reward; ``--task calc_arith --stop-policy fixed
--max-turns 2`` is a two-turn alternative (answer, then "Continue." and a second answer, the verifier
scoring the last), for models that never reach a FrozenLake goal (SmolLM2: 0 of 16 held-out, 0 of 8
training episodes in our run, so no arm ever had a reward to learn from). Each arm (estimator x seed) gets its own adapter family, agent
and learner on one shared server; the arms run one after the other. One iteration = ``--prompts``
new training problems x ``--group`` sampled episodes (``--temperature``, 1.0 unless given) through the agent's runs
endpoint, then one ``LearnerService.update`` (the learner's real path; new versions are served at
once, no gate). RTPO's update re-rolls ``K=--branches`` turns per episode with ``m=--siblings``
siblings each, from the exact stored contexts, and sweeps the turn buckets latest first
(``learner/rerollout.py``); its siblings' tokens count against its budget, so it gets fewer
iterations. An arm stops when its sampled tokens (episodes + siblings) reach ``--budget``.

``feedback:calc_arith`` (TCPO's verifier-feedback mode, ``agents/tasks/feedback.py``) is a multi-turn task
on which SmolLM2 succeeds sometimes: one-step arithmetic, answered until the verifier says it is right, the
verifier's score shown between turns and recorded per turn (process rewards), the best turn's score as the
outcome. Arms run interleaved (seed by seed, every estimator), so other load on the machine hits them alike.

Reported: per arm the success curve (success of its training episodes per iteration against the
sampled tokens spent), and the held-out success of its final version on ``--n-eval`` problems of a
seed no arm trains on (same problems and sampling seeds for every arm); per estimator the mean with a
95% bootstrap CI over seeds and problems, and RTPO minus each baseline, paired by seed and problem. One PNG with all curves (thin: seeds,
thick: mean per estimator) and ``rtpo_compare.json`` under ``bench/results/rtpo_compare/``.
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

from bench._rl_harness import HeldoutBootstrap, add_agent, base_heldout, bench_server, final_heldout, resumed_run, rollouts, service, write_json  # noqa: E402

PROMPTS = {
    "frozenlake": "You are an agent walking on a frozen lake. Reach the goal without falling into a hole.",
    "calc_arith": "You are a careful assistant. Check your previous answer when asked to continue.",
}


def agent(name: str, family: str | None, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": name,
        "system_prompt": PROMPTS.get(args.task, "You are a careful assistant."),
        "temperature": args.temperature,
        "max_turns": args.max_turns,
        "max_tokens_per_turn": args.max_tokens,
        "stop_policy": args.stop_policy,
        "task": args.task,
        "task_options": json.loads(args.task_options),
        **({"adapter_family": family} if family else {}),
    }


def run_arm(url: str, key: str, data: Path, model_path: Path, est: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    family, name = f"{est.replace('_', '-')}-s{seed}", f"fl-{est.replace('_', '-')}-s{seed}"
    add_agent(url, key, agent(name, family, args))
    settings: dict[str, Any] = {
        "family": family,
        "lora": {"rank": 8, "alpha": 16.0},
        "trainer": {"lr": args.lr, "estimator": est, "seed": seed, "threads": None, "progress": False},
        "samples": {"settle_s": 0.0, "max_staleness": 1},
        "rerollouts": {"branches": args.branches, "siblings": args.siblings, "refresh": True},
    }
    svc = service(url, key, data, model_path, name, settings)
    progress = args.out / f"arm-{family}.json"  # written after every iteration: a killed run resumes the arm here
    state: dict[str, Any] = {"spent": 0, "it": 0, "curve": [], "wall_s": 0.0, "final": None, "resumed": []}
    if progress.exists():
        state = json.loads(progress.read_text())
        svc.serve_newest()
        state["resumed"].append({"iteration": state["it"], "tokens": state["spent"], "learner_version": svc.status.champion})
        print(
            f"  {family}: resumed at iteration {state['it']} ({state['spent']} tokens), learner at {svc.status.champion or 'the base (no version yet)'}",
            flush=True,
        )
    spent, it, curve = state["spent"], state["it"], state["curve"]
    t0 = time.perf_counter() - state["wall_s"]
    while spent < args.budget:
        problems = [seed * 10_000 + it * args.prompts + j for j in range(args.prompts)]
        runs = rollouts(url, name, args.task, problems, args.group, seed=seed)
        spent += sum(r["completion_tokens"] for r in runs)
        success = sum(bool(r.get("correct")) for r in runs) / len(runs)
        rec = svc.update()
        rr = rec.get("rerollouts") or {}
        spent += int(rr.get("sampled_tokens", 0))
        curve.append({"iteration": it, "tokens": spent, "train_success": success, "optimizer_step": rec["metrics"].get("optimizer_step")})
        print(f"  {family} it {it}: success {success:.2f}, tokens {spent}, siblings {rr.get('siblings', 0)}", flush=True)
        it += 1
        state.update(spent=spent, it=it, curve=curve, wall_s=time.perf_counter() - t0, final=svc.status.champion)
        write_json(progress, state)
    final = svc.status.champion or state["final"]
    wall = time.perf_counter() - t0
    del svc
    arm = {"estimator": est, "seed": seed, "family": family, "final": final, "iterations": it, "tokens": spent, "curve": curve, "wall_s": wall}
    return arm | ({"resumed": state["resumed"]} if state["resumed"] else {})


def plot(arms: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"grpo": "tab:blue", "turn_grpo": "tab:orange", "rtpo": "tab:green"}
    for est in dict.fromkeys(a["estimator"] for a in arms):
        mine = [a for a in arms if a["estimator"] == est]
        grid = np.linspace(0, max(a["tokens"] for a in mine), 50)
        ys = []
        for a in mine:
            x = [c["tokens"] for c in a["curve"]]
            y = np.cumsum([c["train_success"] for c in a["curve"]]) / np.arange(1, len(x) + 1)  # running mean success
            ax.plot(x, y, color=colors.get(est), alpha=0.3, linewidth=1)
            ys.append(np.interp(grid, x, y))
        ax.plot(grid, np.mean(ys, axis=0), color=colors.get(est), linewidth=2.5, label=f"{est} (mean of {len(mine)} seeds)")
    ax.set_xlabel("sampled tokens (episodes + re-rollouts)")
    ax.set_ylabel("training success (running mean)")
    ax.set_title(f"{title}: RTPO vs trajectory GRPO vs turn GRPO")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def save(path: Path, design: dict[str, str], args: argparse.Namespace, base_runs: list[bool], arms: list[dict[str, Any]]) -> None:
    """The run so far: its design (what ``--resume`` checks), the base evaluation and every finished arm."""
    args_s = {k: str(v) for k, v in vars(args).items()}
    write_json(path, {"design": design, "args": args_s, "base": sum(base_runs) / len(base_runs), "base_runs": base_runs, "arms": arms})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--estimators", default="grpo,turn_grpo,rtpo")
    p.add_argument("--task", default="frozenlake", help="a multi-turn task: frozenlake, or e.g. calc_arith with --stop-policy fixed")
    p.add_argument("--task-options", default="{}", help="the task's options as JSON")
    p.add_argument("--stop-policy", default="answer", help="the agents' stop policy (fixed: every run takes --max-turns turns)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budget", type=int, default=6000, help="sampled tokens per arm")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=1.0, help="the agents' sampling temperature (training and held-out runs alike)")
    p.add_argument("--branches", type=int, default=1)
    p.add_argument("--siblings", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--n-eval", type=int, default=24)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rtpo_compare")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out (same design; --seeds may add seeds): finished arms are kept, a cut arm resumes "
        "from its learner's checkpoint and its last iteration",
    )
    args = p.parse_args()

    # --seeds and --estimators choose which arms of the design run now (a session that cannot fit one arm may run
    # another first); neither changes how an arm learns
    design = {k: str(v) for k, v in vars(args).items() if k not in ("resume", "seeds", "estimators")}
    results = args.out / "rtpo_compare.json"
    done = resumed_run(results, design, args.resume)
    arms: list[dict[str, Any]] = list(done.get("arms", []))
    with bench_server(args.model, args.out, resume=args.resume) as srv:
        add_agent(srv.url, srv.key, agent("fl-eval", None, args))
        if "base_runs" in done:
            base_runs = [bool(b) for b in done["base_runs"]]
            print(f"resumed: {len(arms)} arm(s) finished, base held-out success {sum(base_runs) / len(base_runs):.3f} (from the run)", flush=True)
        else:
            base_runs = base_heldout(srv, agent("fl-eval", None, args), args.task, args.n_eval)
            save(results, design, args, base_runs, arms)
        base_success = sum(base_runs) / len(base_runs)
        print(f"base held-out success {base_success:.3f} (n={args.n_eval})", flush=True)
        seeds = [int(s) for s in args.seeds.split(",")]
        finished = {(a["estimator"], a["seed"]) for a in arms}
        # interleaved: seed by seed, every estimator, so the machine's load (other users) hits all arms alike
        for seed in seeds:
            for est in args.estimators.split(","):
                if (est, seed) in finished:
                    continue
                print(f"arm {est} seed {seed}", flush=True)
                arm = run_arm(srv.url, srv.key, srv.data, srv.model_path, est, seed, args)
                final_heldout(srv, "fl-eval", args.task, args.n_eval, arm)
                arms.append(arm)
                save(results, design, args, base_runs, arms)
    plot(arms, args.out / "rtpo_compare.png", args.task)
    report(arms, base_runs, args)
    print(f"plot: {args.out / 'rtpo_compare.png'}")
    return 0


def report(arms: list[dict[str, Any]], base_runs: list[bool], args: argparse.Namespace) -> None:
    """Held-out success per estimator with 95% CIs, and RTPO against each baseline as a paired difference.

    The CI resamples seeds and held-out problems together (a two-level bootstrap: seeds with replacement, then
    problems with replacement within the resampled seeds), so it covers both training noise and evaluation
    noise; the differences pair the arms of one seed on the same held-out problems and sampling seeds."""
    ests = list(dict.fromkeys(a["estimator"] for a in arms))
    by = {e: {a["seed"]: a["heldout_runs"] for a in arms if a["estimator"] == e} for e in ests}
    seeds = sorted(set.intersection(*(set(v) for v in by.values())))
    n = len(base_runs)
    bs = HeldoutBootstrap(by, seeds, n)

    print("\n| estimator | seeds | iterations (mean) | tokens (mean) | held-out success, mean [95% CI] |\n|---|---|---|---|---|")
    for e in ests:
        mine = [a for a in arms if a["estimator"] == e]
        pt, lo, hi = bs.arm(e)
        it = sum(a["iterations"] for a in mine) / len(mine)
        tok = sum(a["tokens"] for a in mine) / len(mine)
        print(f"| {e} | {len(mine)} | {it:.1f} | {tok:.0f} | {pt:.3f} [{lo:.3f}, {hi:.3f}] |")
    print(f"base model held-out success: {sum(base_runs) / n:.3f} (n={n} problems; every arm is evaluated on the same {n})")
    for other in ("grpo", "turn_grpo"):
        if "rtpo" in by and other in by:
            pt, lo, hi = bs.diff("rtpo", other)
            base_o = bs.mean(other)(seeds, list(range(n)))
            rel = f", {100 * pt / base_o:+.1f}% relative" if base_o > 0 else ""
            print(f"rtpo - {other}: {pt:+.3f} [{lo:+.3f}, {hi:+.3f}] absolute held-out success{rel} (seed rtpo ran against the {other} of its seed)")


if __name__ == "__main__":
    raise SystemExit(main())
