"""Can the served model judge its own answers? A probe of group completion's LLM-judge scorer on checkable chat.

    .venv/bin/python bench/judge_probe.py --n 100 --json-out docs/results/judge_probe.json

For ``--n`` problems (``bench/live_traffic.py``'s focus shape: the problem asked as its users ask it, the reply, then
"the final answer only"), the served model answers the first turn at ``--temperature``, then ``--group`` final answers
at the same temperature (one request, ``n``); the same model, as ``[singletons] scorer = "judge"`` would call it
(``learner.group_completion``'s prompt, JSON-schema grammar and seeded shuffle, through ``POST /admin/chat/completions``),
scores the group. Each answer is checked by the task's verifier. Reported: how often the judge scores a right answer
above a wrong one of the same group (ties count half: 0.5 is a coin), over the groups that hold both, and how many
groups it scored all alike (no signal for GRPO). A fresh server (``--no-record``), alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._rl_harness import served_model  # noqa: E402
from bench.live_traffic import FINAL_ONLY, ask  # noqa: E402
from learner.config import SingletonConfig  # noqa: E402
from learner.group_completion import judge_messages, judge_order, judge_schema, parse_judge  # noqa: E402


async def probe(url: str, key: str, problems: list[Any], task: Any, *, group: int, temperature: float, max_tokens: int) -> list[dict[str, Any]]:
    rubric = SingletonConfig.model_fields["judge_rubric"].default
    out: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(8)
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, timeout=900) as c,
        httpx.AsyncClient(base_url=url, headers=headers, timeout=900) as h,
    ):
        base = served_model(url)

        async def one(i: int, p: Any) -> None:
            async with sem:
                m: list[dict[str, str]] = [{"role": "user", "content": ask(p)}]
                r = await c.chat.completions.create(model=base, messages=m, temperature=temperature, max_tokens=max_tokens)  # type: ignore[arg-type]
                m += [{"role": "assistant", "content": r.choices[0].message.content or ""}, {"role": "user", "content": FINAL_ONLY}]
                r = await c.chat.completions.create(model=base, messages=m, temperature=temperature, max_tokens=max_tokens, n=group)  # type: ignore[arg-type]
                texts = [ch.message.content or "" for ch in r.choices]
                order = judge_order(group, f"probe:{i}")
                body = {
                    "model": base,
                    "messages": judge_messages(m, [texts[j] for j in order], rubric),
                    "temperature": 0,
                    "max_tokens": 12 * group + 16,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "scores", "schema": judge_schema(group)}},
                }
                jr = await h.post("/admin/chat/completions", json=body)
                jr.raise_for_status()
                shown = parse_judge(jr.json()["choices"][0]["message"]["content"] or "", group)
            scores = [0.0] * group
            for k, j in enumerate(order):
                scores[j] = shown[k]
            out.append({"problem": i, "correct": [bool(task.verify(p, t).correct) for t in texts], "scores": scores})

        await asyncio.gather(*(one(i, p) for i, p in enumerate(problems)))
    return sorted(out, key=lambda r: r["problem"])


def summarize(groups: list[dict[str, Any]]) -> dict[str, Any]:
    mixed = [g for g in groups if 0 < sum(g["correct"]) < len(g["correct"])]
    pairs = [
        (a > b) + 0.5 * (a == b)
        for g in mixed
        for a, ok_a in zip(g["scores"], g["correct"], strict=True)
        if ok_a
        for b, ok_b in zip(g["scores"], g["correct"], strict=True)
        if not ok_b
    ]
    right = [s for g in mixed for s, ok in zip(g["scores"], g["correct"], strict=True) if ok]
    wrong = [s for g in mixed for s, ok in zip(g["scores"], g["correct"], strict=True) if not ok]
    answers = [ok for g in groups for ok in g["correct"]]
    return {
        "groups": len(groups),
        "answers_right": round(sum(answers) / max(1, len(answers)), 4),
        "groups_with_right_and_wrong": len(mixed),
        "groups_scored_all_alike": sum(1 for g in groups if len(set(g["scores"])) == 1),
        "pairs": len(pairs),
        "p_right_scored_above_wrong": round(sum(pairs) / len(pairs), 4) if pairs else None,
        "mean_score_right": round(sum(right) / len(right), 4) if right else None,
        "mean_score_wrong": round(sum(wrong) / len(wrong), 4) if wrong else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--n", type=int, default=100, help="problems (groups)")
    p.add_argument("--group", type=int, default=4, help="final answers per group (group_size)")
    p.add_argument("--temperature", type=float, default=1.0, help="the users' sampling temperature (live_traffic's users send none: 1.0)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--task-options", default='{"max_terms": 2, "max_digits": 1}')
    p.add_argument("--seed", type=int, default=777, help="the problems' seed (neither live_traffic's training 0 nor its held-out 4242)")
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "results" / "judge_probe.json")
    args = p.parse_args()
    from agents.tasks import get_task
    from experiments.agent_eval import spawned_server

    task = get_task(args.task, **json.loads(args.task_options))
    problems = task.problems(args.n, seed=args.seed)
    key = secrets.token_hex(8)
    with spawned_server(args.model, key, ["--no-record"]) as url:
        groups = asyncio.run(probe(url.rstrip("/"), key, problems, task, group=args.group, temperature=args.temperature, max_tokens=args.max_tokens))
    summary = {"command": " ".join(sys.argv), **{k: v for k, v in vars(args).items() if k != "json_out"}, **summarize(groups), "groups_raw": groups}
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(summary, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k != "groups_raw"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
