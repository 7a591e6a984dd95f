"""SVR training (before vs after) and REVES vs plain GRPO at equal sampled tokens, on one real ``serve.py`` (SmolLM2 by default).

    .venv/bin/python bench/svr_reves.py --part svr   --budget 60000 --n-eval 64      # a full SVR run (one-step calc_arith, no tool)
    .venv/bin/python bench/svr_reves.py --part reves --budget 60000 --n-eval 64      # a full REVES run
    .venv/bin/python bench/svr_reves.py --minutes 18 --budget 6000 --n-eval 16       # what fits in a short shared-CPU slot
    .venv/bin/python bench/svr_reves.py --model tiny --budget 400 --n-eval 4         # smoke run
    .venv/bin/python bench/svr_reves.py --from-store --out DIR                       # a finished run's reports, rebuilt from its store

**SVR** (``[svr]``, ``learner/svr_rewards.py``). Two agents share one adapter family and differ only in the stop
rule: ``svr`` (stop once the model says Correct with confidence ≥ τ) and ``fixed`` (``--horizon`` turns). Before
training and after, both run the same ``--n-eval`` held-out problems (a seed no training run uses, same sampling
seeds) as eval runs; reported per agent: accuracy (Wilson 95% CI), mean turns (bootstrap CI), the wrong-stop rate
(verified stops whose answer was wrong; Wilson CI), ECE and Brier of the final answer's stated P(correct) (bootstrap 95%
CI over problems), and the per-problem outcomes (``per_problem``); after training, ``comparison`` holds the targets'
figures (svr − fixed accuracy paired by problem, svr's turns as a share of fixed's, ECE after ÷ before). Training: each update the learner runs ``--prompts`` new problems x ``--group`` fixed-horizon runs
(``"horizon"``) and trains on their SVR turn rewards with per-turn-index GRPO; every new version serves at once
(no gate), until the sampled training tokens reach ``--budget`` and the optimizer steps ``--min-updates`` (updates whose
groups all had one reward do not change the weights and do not count), or the time is up. Targets (issue 22): wrong-stop
≤ 0.5, ECE halved, SVR accuracy within 2 points of the fixed agent's, SVR mean turns ≤ 40% of the fixed horizon.

**REVES vs plain GRPO** (``[reves]``, ``learner/reves.py``). Two adapter families on two single-turn answer agents.
Plain GRPO: each update ``--prompts`` new problems x ``--group`` runs. REVES: each update the current policy attempts
``--prompts`` items, repairs the wrong ones (up to ``--max-retries`` rounds), and trains on a mix of repair,
verification and original prompts (``--augmented-share``). Both stop at the same sampled-token budget, counting
everything they sampled (REVES's augmentation rollouts included). Reported on ``--n-eval`` held-out problems:
pass@1 and sequential-revision success (solved within ``--sr-rounds`` repair rounds with binary "incorrect"
feedback; REVES's own repair prompt), Wilson 95% CIs, and the paired difference (REVES − GRPO) with a bootstrap CI.

Arms run one after the other on one server; other load on the machine hits them alike only roughly, which is
why the tables carry CIs. Results go to ``<--out>/svr_reves.json``. Not a test.

**Resumable** (a full SVR run takes hours): ``svr_reves.json`` holds the design, and the SVR part's before-training
evaluation, updates and curve, written after each update (whose learner checkpoint is written before it).
``--resume`` restarts the server on the same data folder (``<--out>/server``), keeps the finished evaluations and
continues the updates from the learner's checkpoint, recording where it resumed (``resumed``); a finished part is
skipped. The REVES part is not resumable: it reruns whole. ``--from-store`` runs nothing: it rebuilds the SVR reports of
the run in ``--out`` from the eval runs its server recorded (each trajectory's annotated outcome), checked against the
figures the run wrote, for a run made before a report field existed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._rl_harness import BenchServer, add_agent, bench_server, bootstrap_ci, resumed_run, rollouts, service, write_json  # noqa: E402
from learner.reves import run_attempts  # noqa: E402
from learner.runs_client import post_runs  # noqa: E402
from learner.svr_rollouts import adaptive_report, calibration_error  # noqa: E402

ADMIN = "bench-admin"
HELDOUT_SEED = 4242
# small enough for a shared 24 GB machine: LoRA on q/v, 1024-token micro-batches with activation checkpointing, bf16 matmuls
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
TRAINER = {"progress": False, "epochs": 2, "micro_batch_tokens": 1024, "activation_checkpointing": True, "autocast": "bfloat16"}


def wilson(k: int, n: int) -> tuple[float, float]:
    from agents.calibration import wilson_interval

    return wilson_interval(k, n)


def fmt(x: float | None, ci: tuple[float, float] | None = None) -> str:
    if x is None:
        return "—"
    return f"{x:.3f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci is not None else "")


def eval_runs(url: str, agent: str, n: int, model: str, concurrency: int) -> list[dict[str, Any]]:
    bodies = [{"problem_index": i, "seed": HELDOUT_SEED, "sample_seed": i, "model": model, "eval": True} for i in range(n)]
    outs = post_runs(url, ADMIN, agent, bodies, concurrency=concurrency, timeout_s=1800.0)
    return [o for o in outs if isinstance(o, dict)]


PER_PROBLEM = ("problem_index", "correct", "turns", "stop_reason", "p_correct")


def report_with_ci(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``adaptive_report`` with 95% CIs (accuracy and wrong-stop rate: Wilson; mean turns and ECE: bootstrap over
    problems) and the per-problem outcomes it came from (``per_problem``: one row of ``PER_PROBLEM`` per run)."""
    r = adaptive_report(runs)
    k = sum(bool(x.get("correct")) for x in runs)
    r["accuracy_ci"] = wilson(k, len(runs)) if runs else None
    verified = [bool(x.get("correct")) for x in runs if x.get("stop_reason") == "verified"]
    r["wrong_stop_ci"] = wilson(sum(not c for c in verified), len(verified)) if verified else None
    r["mean_turns_ci"] = bootstrap_ci([float(x.get("turns") or 0) for x in runs]) if len(runs) >= 2 else None
    stated = [(float(x["p_correct"]), bool(x.get("correct"))) for x in runs if isinstance(x.get("p_correct"), int | float)]
    if len(stated) >= 2:
        rng = random.Random(0)
        eces = sorted(calibration_error(*zip(*[rng.choice(stated) for _ in stated], strict=True)) for _ in range(1000))  # type: ignore[arg-type]
        r["ece_ci"] = (eces[25], eces[974])
    r["per_problem"] = sorted(([x.get(f) for f in PER_PROBLEM] for x in runs), key=lambda row: row[0] if isinstance(row[0], int) else -1)
    return r


def store_reports(db: Path, agents: dict[str, str]) -> dict[str, dict[str, dict[str, Any]]]:
    """The held-out evaluations as the server recorded them: ``{model: {label: report_with_ci(...)}}`` from the eval
    runs of each agent in ``agents`` (``{agent name: label}``) in the SQLite store ``db``, grouped by the adapter that
    served them (``"base"``: none). The run outcome is the trajectory's annotation (what the runs endpoint answered)."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT t.meta, (SELECT u.adapter FROM turns u WHERE u.trajectory_id = t.trajectory_id ORDER BY u.idx LIMIT 1) FROM trajectories t"
        ).fetchall()
    finally:
        con.close()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for meta_text, adapter in rows:
        meta = json.loads(meta_text)
        if meta.get("eval") and meta.get("agent") in agents and meta.get("problem_seed") == HELDOUT_SEED:
            runs.setdefault(adapter or "base", {}).setdefault(agents[meta["agent"]], []).append(meta)
    return {model: {label: report_with_ci(rs) for label, rs in by.items()} for model, by in runs.items()}


def svr_comparison(after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The design's targets on the after-training reports: accuracy svr − fixed paired by problem (bootstrap CI), svr's
    mean turns as a share of the fixed agent's, wrong-stop rate, and each agent's ECE after ÷ before."""
    svr, fixed = ({int(r[0]): r for r in after[a]["per_problem"] if isinstance(r[0], int)} for a in ("svr", "fixed"))
    both = sorted(svr.keys() & fixed.keys())
    diffs = [float(bool(svr[i][1])) - float(bool(fixed[i][1])) for i in both]
    out: dict[str, Any] = {
        "paired_problems": len(both),
        "accuracy_diff": sum(diffs) / len(diffs) if diffs else None,
        "accuracy_diff_ci": bootstrap_ci(diffs) if len(diffs) >= 2 else None,
        "turns_share": (after["svr"]["mean_turns"] / after["fixed"]["mean_turns"]) if after["fixed"].get("mean_turns") else None,
        "wrong_stop_rate": after["svr"].get("wrong_stop_rate"),
    }
    for agent in ("svr", "fixed"):
        b, a = before.get(agent, {}).get("ece"), after[agent].get("ece")
        out[f"ece_ratio_{agent}"] = a / b if a is not None and b else None
    return out


def print_svr(s: dict[str, Any]) -> None:
    n = s["before"]["svr"]["n"]
    print(
        f"\nSVR ({s['updates']} updates, {s.get('optimizer_steps')} optimizer steps, {s['sampled_tokens']} sampled training tokens; held-out n={n})"
    )
    print(f"{'':10} {'agent':6} {'accuracy [95% CI]':22} {'mean turns [95% CI]':22} {'wrong-stop [95% CI]':22} {'ECE [95% CI]':22} {'Brier':>6}")
    for when in ("before", "after"):
        for agent in ("svr", "fixed"):
            r = s.get(when, {}).get(agent)
            if r is None:
                continue
            print(f"{when:10} {agent:6} {fmt(r['accuracy'], r.get('accuracy_ci')):22} {fmt(r['mean_turns'], r.get('mean_turns_ci')):22} "
                  f"{fmt(r['wrong_stop_rate'], r.get('wrong_stop_ci')):22} {fmt(r['ece'], r.get('ece_ci')):22} {fmt(r['brier']):>6}")  # fmt: skip
    c = s.get("comparison")
    if c:
        print(f"after: accuracy svr − fixed {fmt(c['accuracy_diff'], c['accuracy_diff_ci'])} (paired, n={c['paired_problems']}); svr turns ÷ fixed "
              f"{fmt(c['turns_share'])}; wrong-stop {fmt(c['wrong_stop_rate'])}; ECE after ÷ before: svr {fmt(c['ece_ratio_svr'])}, fixed "
              f"{fmt(c['ece_ratio_fixed'])}")  # fmt: skip


def svr_part(srv: BenchServer, args: argparse.Namespace, deadline: float, state: dict[str, Any], save: Callable[[], None]) -> dict[str, Any]:
    """The SVR part; ``state`` is its record so far (empty for a new run), updated in place and saved (``save``) after
    the before-training evaluation and after every update, so a cut run continues where it stopped."""
    url = srv.url
    family = "svr-bench"
    common = {
        "system_prompt": "You are a careful problem solver.",
        "max_turns": args.horizon,
        "max_tokens_per_turn": args.max_tokens,
        "token_budget": args.horizon * args.max_tokens,
        "task": args.task,
        "task_options": args.task_options,
        "temperature": 1.0,
        "adapter_family": family,
    }
    add_agent(url, ADMIN, {**common, "name": "bench-svr", "stop_policy": "svr", "stop_params": {"tau": args.tau}})
    add_agent(url, ADMIN, {**common, "name": "bench-svr-fixed", "stop_policy": "fixed", "stop_params": {"fmt": "svr", "tau": args.tau}})
    base = srv.base

    def evaluate(model: str) -> dict[str, Any]:
        return {
            "svr": report_with_ci(eval_runs(url, "bench-svr", args.n_eval, model, args.concurrency)),
            "fixed": report_with_ci(eval_runs(url, "bench-svr-fixed", args.n_eval, model, args.concurrency)),
        }

    t0 = time.monotonic()
    if "before" not in state:
        state.update(before=evaluate(base), updates=0, sampled_tokens=0, curve=[], wall_s=0.0, resumed=[])
        save()
        print(f"svr: before training ({time.monotonic() - t0:.0f} s): {json.dumps(state['before'], default=str)}", flush=True)
    settings = {
        "family": family,
        "lora": LORA,
        "trainer": {**TRAINER, "lr": args.lr, "estimator": "turn_grpo", "estimator_params": {"source": "reward"}},
        "samples": {"settle_s": 0, "max_staleness": 64},
        "svr": {"enabled": True, "tau": args.tau, "problems_per_update": args.prompts, "group": args.group, "horizon": args.horizon},
    }
    svc = service(url, ADMIN, srv.data, srv.model_path, "bench-svr", settings)  # the server's data folder: its store
    if state["updates"]:
        svc.serve_newest()
        state["resumed"].append({"update": state["updates"], "tokens": state["sampled_tokens"], "learner_version": svc.status.champion})
        print(f"svr: resumed after update {state['updates']} ({state['sampled_tokens']} tokens), learner at {svc.status.champion}", flush=True)
    t1 = time.monotonic() - state["wall_s"]

    def steps() -> int:
        return sum(1 for c in state["curve"] if c.get("optimizer_step"))

    def trained_enough() -> bool:
        return state["sampled_tokens"] >= args.budget and steps() >= args.min_updates

    while not trained_enough() and time.monotonic() < deadline:
        rec = svc.update(force=True)
        state["sampled_tokens"] += int(rec.get("svr_runs", {}).get("sampled_tokens", 0))
        state["updates"] += 1
        state["curve"].append({"update": state["updates"], "tokens": state["sampled_tokens"], "reward_mean": rec.get("self_check_rewards", {}).get("reward_mean"),
                               "train_correct": rec.get("svr_runs", {}).get("correct"), "optimizer_step": rec["metrics"].get("optimizer_step")})  # fmt: skip
        state.update(wall_s=time.monotonic() - t1, model=svc.status.champion)
        save()
        print(f"svr: update {state['updates']}: {state['curve'][-1]}", flush=True)
    if not trained_enough():
        print(
            f"svr: out of time at {state['sampled_tokens']} of {args.budget} tokens, {steps()} of at least {args.min_updates} optimizer steps: "
            "evaluating now (--resume continues training)",
            flush=True,
        )
    model = svc.status.champion or state.get("model") or base
    svc.store.close()
    svc.state.trainer = None  # one model in memory at a time
    gc.collect()
    state.update(after=evaluate(model), model=model, optimizer_steps=steps(), finished=trained_enough())
    state["comparison"] = svr_comparison(state["after"], state["before"])
    save()
    return state


def reports_from_store(out_dir: Path) -> None:
    """``--from-store``: rebuild the SVR part's before/after reports (with per-problem rows and every CI) from the eval
    runs the server recorded in ``<out>/server``, check them against the reports the run wrote, and rewrite
    ``svr_reves.json``. For a run whose bench predates a report field; the store is the record."""
    results = out_dir / "svr_reves.json"
    out = json.loads(results.read_text())
    s = out["svr"]
    by_model = store_reports(out_dir / "server" / "interactions.db", {"bench-svr": "svr", "bench-svr-fixed": "fixed"})
    wanted = {"before": "base", "after": s.get("model")}
    for when, model in wanted.items():
        if when not in s:
            continue
        rebuilt = by_model.get(str(model))
        if rebuilt is None:
            raise SystemExit(f"--from-store: no eval runs of {model} in {out_dir / 'server'} (models there: {sorted(by_model)})")
        for agent, rep in rebuilt.items():
            for key in ("n", "accuracy", "mean_turns", "verified_stops"):
                if s[when][agent].get(key) != rep.get(key):
                    raise SystemExit(f"--from-store: {when} {agent} {key}: the run wrote {s[when][agent].get(key)}, the store has {rep.get(key)}")
        s[when] = rebuilt
    if "after" in s:
        s["comparison"] = svr_comparison(s["after"], s["before"])
    s["reports_from_store"] = True
    write_json(results, out)
    print_svr(s)


async def _sr(url: str, agent: str, model: str, n: int, rounds: int, concurrency: int) -> list[tuple[bool, bool]]:
    """Per held-out problem: (pass@1, solved within ``rounds`` repair rounds with "incorrect" feedback)."""
    attempt = run_attempts(url, ADMIN, agent, seed=HELDOUT_SEED, sample_seed=0, model=model, concurrency=concurrency)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> tuple[bool, bool]:
        async with sem:
            first = await attempt(i, None, 0)
            if first is None or first.correct:
                return bool(first and first.correct), bool(first and first.correct)
            prev = first.text
            for r in range(1, rounds + 1):
                y = await attempt(i, prev, r)
                if y is None:
                    return False, False
                if y.correct:
                    return False, True
                prev = y.text
            return False, False

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def reves_part(srv: BenchServer, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    url, data, base = srv.url, srv.data, srv.base
    arms: dict[str, dict[str, Any]] = {}
    per_arm_deadline = (deadline - time.monotonic()) / 2
    for arm in ("grpo", "reves"):
        family, agent = f"{arm}-bench", f"bench-{arm}"
        add_agent(url, ADMIN, {"name": agent, "system_prompt": "You are a careful problem solver.", "max_turns": 1,
                               "max_tokens_per_turn": args.max_tokens, "task": args.task, "task_options": args.task_options, "temperature": 1.0,
                               "adapter_family": family})  # fmt: skip
        settings: dict[str, Any] = {
            "family": family,
            "lora": LORA,
            "trainer": {**TRAINER, "lr": args.lr},
            "samples": {"settle_s": 0, "max_staleness": 64},
        }
        if arm == "reves":
            settings["reves"] = {"enabled": True, "items_per_round": args.prompts, "max_retries": args.max_retries,
                                 "prompts_per_round": args.prompts, "augmented_share": args.augmented_share, "group": args.group}  # fmt: skip
        svc = service(url, ADMIN, data, srv.model_path, agent, settings)
        end = time.monotonic() + per_arm_deadline
        tokens, updates, next_problem, curve = 0, 0, 0, []
        while tokens < args.budget and time.monotonic() < end:
            if arm == "grpo":
                runs = rollouts(url, agent, args.task, list(range(next_problem, next_problem + args.prompts)), args.group, seed=updates)
                next_problem += args.prompts
                spent = sum(int(r.get("completion_tokens") or 0) for r in runs)
                rec = svc.update(force=True)
            else:
                rec = svc.update(force=True)
                rv = rec.get("reves", {})
                spent = int(rv.get("sampled_tokens", 0)) + int(rv.get("training_sampled_tokens", 0))
            tokens += spent
            updates += 1
            curve.append({"update": updates, "tokens": tokens, "reward_mean": rec["metrics"].get("reward_mean"), "reves": rec.get("reves")})
            print(f"{arm}: update {updates}: tokens {tokens}, reward {curve[-1]['reward_mean']}, reves {rec.get('reves')}", flush=True)
        model = svc.status.champion or base
        svc.store.close()
        svc.state.trainer = None
        gc.collect()
        res = asyncio.run(_sr(url, agent, model, args.n_eval, args.sr_rounds, args.concurrency))
        arms[arm] = {"model": model, "updates": updates, "sampled_tokens": tokens, "curve": curve, "per_problem": res}
    out: dict[str, Any] = {"arms": {}}
    for arm, a in arms.items():
        p1 = [x[0] for x in a["per_problem"]]
        sr = [x[1] for x in a["per_problem"]]
        out["arms"][arm] = {
            **{k: a[k] for k in ("model", "updates", "sampled_tokens", "curve")},
            "pass@1": sum(p1) / len(p1),
            "pass@1_ci": wilson(sum(p1), len(p1)),
            "sr": sum(sr) / len(sr),
            "sr_ci": wilson(sum(sr), len(sr)),
        }
    for metric, j in (("pass@1", 0), ("sr", 1)):
        diff = [float(r[j]) - float(g[j]) for r, g in zip(arms["reves"]["per_problem"], arms["grpo"]["per_problem"], strict=True)]
        out[f"{metric}_diff"] = sum(diff) / len(diff)
        out[f"{metric}_diff_ci"] = bootstrap_ci(diff)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("svr", "reves", "both"), default="both")
    ap.add_argument("--model", default="default")
    ap.add_argument("--task", default="calc_arith")
    ap.add_argument("--task-options", type=json.loads, default={"n_ops": 1, "use_tools": False}, help="the agents' task options (JSON)")
    ap.add_argument("--n-eval", type=int, default=64)
    ap.add_argument("--budget", type=int, default=60_000, help="sampled training tokens per arm")
    ap.add_argument(
        "--min-updates", type=int, default=0, help="SVR: train on past --budget until this many optimizer steps (updates that changed the weights)"
    )
    ap.add_argument("--minutes", type=float, default=600.0, help="stop training when this much time is used (evaluation still runs)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--horizon", type=int, default=3)
    ap.add_argument("--tau", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-retries", type=int, default=3)
    ap.add_argument("--sr-rounds", type=int, default=2)
    ap.add_argument("--augmented-share", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="the server's CPU threads (1 on a shared 2-core machine: docs/engines.md, Speed on CPU)")
    ap.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "svr_reves", help="the run's folder: svr_reves.json and the server's data"
    )
    ap.add_argument("--resume", action="store_true", help="continue the run in --out (same design): see the module docstring")
    ap.add_argument("--from-store", action="store_true", help="no run: rebuild the SVR reports in --out from its server's recorded eval runs")
    args = ap.parse_args()
    if args.from_store:
        reports_from_store(args.out)
        return
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    design = {k: str(v) for k, v in vars(args).items() if k not in ("resume", "minutes")}
    results = args.out / "svr_reves.json"
    done = resumed_run(results, design, args.resume)
    out: dict[str, Any] = {**done, "design": design}
    with bench_server(args.model, args.out, resume=args.resume, flags=["--threads", str(args.threads)], key=ADMIN) as srv:
        parts = ["svr", "reves"] if args.part == "both" else [args.part]
        for k, part in enumerate(parts):
            share = deadline if k == len(parts) - 1 else t0 + (deadline - t0) / len(parts)
            if part == "svr":
                if out.get("svr", {}).get("finished"):
                    print("svr: finished in the resumed run", flush=True)
                    continue
                out["svr"] = out.get("svr") or {}
                svr_part(srv, args, share, out["svr"], lambda: write_json(results, out))
            else:
                out["reves"] = reves_part(srv, args, share)
            write_json(results, out)
    out["elapsed_s"] = time.monotonic() - t0
    write_json(results, out)
    if "svr" in out:
        print_svr(out["svr"])
    if "reves" in out:
        r = out["reves"]
        print(f"\nREVES vs GRPO (held-out n={args.n_eval}; SR = solved within {args.sr_rounds} repair rounds)")
        for arm, a in r["arms"].items():
            print(
                f"{arm:6} updates {a['updates']:3} tokens {a['sampled_tokens']:7}  pass@1 {fmt(a['pass@1'], a['pass@1_ci'])}  SR {fmt(a['sr'], a['sr_ci'])}"
            )
        print(f"REVES − GRPO: pass@1 {fmt(r['pass@1_diff'], r['pass@1_diff_ci'])}  SR {fmt(r['sr_diff'], r['sr_diff_ci'])}")
    print(f"({out['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
