"""Learning from ordinary chat traffic: held-out success vs time when users send one-off prompts and feedback.

    .venv/bin/python bench/chat_learning.py --arms baseline,hook,judge,n8 --minutes 20 --n 100   # the issue's comparison
    .venv/bin/python bench/chat_learning.py --arms baseline --minutes 8 --n 60                    # a short run
    .venv/bin/python bench/chat_learning.py --model tiny --arms baseline --minutes 1 --n 8         # smoke run

What it runs, per arm, one after another with the same budget: ``serve.py`` with one learner job (family
``chat-lora``, plain chat traffic only) and ``--users`` synthetic users who send ordinary chat completions
(no agent, distinct prompts that are never repeated: reasoning-gym ``basic_arithmetic`` with
``--task-options``, not calc_arith) to ``chat-lora`` (the base model until the learner's first version, then
the champion or an A/B arm), score each answer with the task's check and post it by the ``turn_id`` they
received. The arms differ only in what the learner does with one-off prompts and in ``n``:

- ``baseline``: ``[singletons] mode = "baseline"`` (the running per-key baseline), ``n = 1``;
- ``hook``: group completion (``mode = "complete"``, ``group_size = 4``) scored by the task's check as a reward
  hook (``bench/chat_learning_hook.py:reward``), ``n = 1``;
- ``judge``: group completion scored by an LLM judge: the served base model (``judge_model``), ``n = 1``;
- ``n8``: the same users asking ``n = 8`` answers per prompt (groups of 8 from live traffic), GRPO.

Then a fresh server without users or learner loads the versions the learner published (the champion, the
newest and up to ``--versions`` in between) and answers ``--n`` held-out problems (another seed) greedily with
each and with the base model; results go to ``bench/results/chat_learning.json``: held-out success per version
with the minute it was published, the users' live success, and the learner's updates and reasons.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents.tasks import get_task  # noqa: E402
from bench._rl_harness import HeldoutBootstrap  # noqa: E402
from experiments.agent_eval import spawned_server  # noqa: E402
from learner.records.adapter_manifest import manifest_sha256  # noqa: E402

FAMILY, BASE = "chat-lora", "bench-base"
TRAIN_SEED, HELDOUT_SEED = 0, 4242


def job(arm: str, base: str, min_new: int) -> dict[str, Any]:
    singletons: dict[str, Any] = {"mode": "baseline"}
    if arm == "hook":
        singletons = {"mode": "complete", "scorer": "hook", "hook": "bench.chat_learning_hook:reward", "group_size": 4}
    elif arm == "judge":
        singletons = {"mode": "complete", "scorer": "judge", "judge_model": base, "group_size": 4}
    return {
        "family": FAMILY,
        "min_new_trajectories": min_new,
        "gate_n": 0,
        "settings": {
            "traffic": {"chat": True, "agents": []},
            "singletons": singletons,
            "trainer": {"lr": 1e-3, "epochs": 2, "old_logprobs": "recompute", "behaviour_weight_cap": 2.0},
            "samples": {"settle_s": 10, "max_trajectories": 48},
        },
    }


class Users:
    """``k`` users, each sending the next unseen problem, scoring the answer(s) and posting feedback by turn_id."""

    def __init__(self, url: str, task: Any, problems: list[Any], k: int, n: int, max_tokens: int) -> None:
        self.url, self.task, self.problems, self.k, self.n, self.max_tokens = url, task, problems, k, n, max_tokens
        self.next = 0
        self.log: list[dict[str, Any]] = []  # per answer: time, adapter, correct
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url + "/v1", timeout=600) as client:
            await asyncio.gather(*(self._user(client) for _ in range(self.k)))

    async def _user(self, client: httpx.AsyncClient) -> None:
        while not self.stop.is_set() and self.next < len(self.problems):
            p = self.problems[self.next]
            self.next += 1
            body = {"model": FAMILY, "messages": [{"role": "user", "content": p.prompt}], "n": self.n, "max_tokens": self.max_tokens}
            try:
                r = await client.post("/chat/completions", json=body)
                r.raise_for_status()
                out = r.json()
                ids = out["loopwise"].get("choices") or [{"turn_id": out["loopwise"]["turn_id"]}]
                for choice, c in zip(out["choices"], ids, strict=True):
                    ok = self.task.verify(p, choice["message"]["content"] or "").correct
                    self.log.append({"t": time.time(), "adapter": out["loopwise"].get("adapter") or "base", "correct": ok})
                    await client.post("/feedback", json={"turn_id": c["turn_id"], "reward": float(ok)})
            except httpx.HTTPError as exc:
                print(f"user request failed: {exc}", flush=True)
                await asyncio.sleep(1)


async def heldout(url: str, models: list[str], problems: list[Any], task: Any, max_tokens: int) -> dict[str, list[bool]]:
    """Each model's greedy answer to each held-out problem, checked: ``{model: [correct of problem i]}``, in problem order."""
    sem = asyncio.Semaphore(8)
    out: dict[str, list[bool]] = {m: [False] * len(problems) for m in models}
    async with httpx.AsyncClient(base_url=url + "/v1", timeout=900) as client:

        async def one(i: int, p: Any, m: str) -> None:
            body = {"model": m, "messages": [{"role": "user", "content": p.prompt}], "temperature": 0, "max_tokens": max_tokens}
            async with sem:
                r = await client.post("/chat/completions", json=body)
            r.raise_for_status()
            out[m][i] = task.verify(p, r.json()["choices"][0]["message"]["content"] or "").correct

        await asyncio.gather(*(one(i, p, m) for i, p in enumerate(problems) for m in models))  # models interleaved per problem
    return out


def run_arm(arm: str, args: argparse.Namespace, task: Any, spec_file: Path) -> dict[str, Any]:
    key = secrets.token_hex(8)
    data = args.out / f"chat_learning_{arm}_data"
    shutil.rmtree(data, ignore_errors=True)
    train = task.problems(args.problems, seed=TRAIN_SEED)
    os.environ["CHAT_LEARNING_TASK"] = str(spec_file)  # the learner process (a child of serve.py) reads it in the hook
    base = BASE  # --served-model-name: the judge arm's judge is the base model under this name
    flags = ["--served-model-name", BASE, "--learner-job", json.dumps(job(arm, base, args.min_new))]
    with spawned_server(args.model, key, flags, learner=True, data_dir=data) as url:
        admin = {"Authorization": f"Bearer {key}"}
        users = Users(url, task, train, args.users, 8 if arm == "n8" else 1, args.max_tokens)
        users.thread.start()
        t0 = time.time()
        print(f"[{arm}] server at {url}; users running for {args.minutes:g} min", flush=True)
        deadline = t0 + 60 * args.minutes
        while time.time() < deadline:
            time.sleep(min(60.0, max(0.0, deadline - time.time())))
            st = next((s for s in httpx.get(f"{url}/admin/learner", headers=admin, timeout=30).json()["data"] if s["family"] == FAMILY), {})
            recent = users.log[-50:]
            rate = sum(x["correct"] for x in recent) / len(recent) if recent else 0.0
            print(
                f"[{arm} {(time.time() - t0) / 60:5.1f} min] answers {len(users.log)} recent success {rate:.2f}; learner {st.get('state')} "
                f"v{st.get('version')} champion={st.get('champion')}: {st.get('detail', '')[:100]}",
                flush=True,
            )
        users.stop.set()
        users.thread.join(timeout=600)
        champion = httpx.get(f"{url}/admin/adapters", headers=admin, timeout=30).json().get("aliases", {}).get(FAMILY)
    history_file = data / "learner" / FAMILY / "history.jsonl"
    history = [json.loads(x) for x in history_file.read_text().splitlines() if x.strip()] if history_file.exists() else []
    published = [(r["version"], (r["at"] - t0) / 60) for r in history if r.get("gate", {}).get("decision") in ("passed",)]
    pick = [v for v, _ in published]
    if len(pick) > args.versions:
        step = len(pick) / args.versions
        pick = sorted({pick[int(i * step)] for i in range(args.versions)} | {pick[-1]})
    if champion and int(champion.split("@")[1]) not in pick:
        pick.append(int(champion.split("@")[1]))
    held = task.problems(args.n, seed=HELDOUT_SEED)
    with spawned_server(args.model, key, ["--served-model-name", BASE], data_dir=data) as url:
        admin = {"Authorization": f"Bearer {key}"}
        models = [base]
        for v in sorted(pick):
            path = data / "adapters" / FAMILY / f"v{v}"
            body = {"path": str(path), "family": FAMILY, "version": v, "sha256": manifest_sha256(path)}
            httpx.post(f"{url}/admin/adapters", headers=admin, json=body, timeout=300).raise_for_status()
            models.append(f"{FAMILY}@{v}")
        per_problem = asyncio.run(heldout(url, models, held, task, args.max_tokens))
    boot = HeldoutBootstrap({m: {0: v} for m, v in per_problem.items()}, [0], len(held))
    success = {m: sum(v) / len(v) for m, v in per_problem.items()}
    vs_base = {m: [round(x, 3) for x in boot.diff(m, base)] for m in models if m != base}  # paired by problem: point, 95% CI
    when = dict(published)
    live: dict[str, list[bool]] = {}
    for x in users.log:
        live.setdefault(x["adapter"], []).append(x["correct"])
    return {
        "arm": arm,
        "answers": len(users.log),
        "updates": len(history),
        "champion": champion,
        "heldout": [
            {"model": m, "minute": when.get(int(m.split("@")[1])) if "@" in m else 0.0, "success": s, "vs_base": vs_base.get(m)}
            for m, s in success.items()
        ],
        "live_success": {a: {"n": len(v), "success": sum(v) / len(v)} for a, v in live.items()},
        "reasons": [r.get("unused", {}).get("top") for r in history],
        "group_completion": [r.get("group_completion") for r in history if r.get("group_completion")],
        "gates": [r.get("gate", {}).get("decision") for r in history],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="default (SmolLM2) or tiny")
    p.add_argument("--arms", default="baseline,hook,judge,n8", help="comma-separated: baseline, hook, judge, n8")
    p.add_argument("--minutes", type=float, default=20.0, help="wall time of each arm's traffic")
    p.add_argument("--users", type=int, default=4, help="concurrent synthetic users")
    p.add_argument("--n", type=int, default=100, help="held-out problems")
    p.add_argument("--versions", type=int, default=4, help="most published versions evaluated per arm (the newest and the champion always)")
    p.add_argument("--min-new", type=int, default=16, help="the learner's min_new_trajectories")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--problems", type=int, default=5000, help="training problems available to the users (never repeated)")
    p.add_argument("--task-options", default='{"max_terms": 2, "max_digits": 1}', help="basic_arithmetic's generator config (JSON)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    options = json.loads(args.task_options)
    task = get_task("basic_arithmetic", **options)
    spec_file = args.out / "chat_learning_task.json"
    spec_file.write_text(json.dumps({"task": "basic_arithmetic", "options": options, "n": args.problems, "seed": TRAIN_SEED}))
    load = os.getloadavg()
    results = [run_arm(arm.strip(), args, task, spec_file) for arm in args.arms.split(",") if arm.strip()]
    summary = {"command": " ".join(sys.argv), "loadavg_start": load, "loadavg_end": os.getloadavg(), "model": args.model, "arms": results}
    (args.out / "chat_learning.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nheld-out success (greedy, n={args.n}), load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    for r in results:
        rows = ", ".join(
            f"{h['model']} {h['success']:.3f}"
            + (f" (min {h['minute']:.1f})" if h["minute"] else "")
            + (" [vs base {:+.2f}, 95% CI {:+.2f}..{:+.2f}]".format(*h["vs_base"]) if h.get("vs_base") else "")
            for h in r["heldout"]
        )
        print(f"{r['arm']:<9} answers {r['answers']:>5}, updates {r['updates']:>3}, champion {r['champion']}: {rows}")
    print(f"results: {args.out / 'chat_learning.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
