"""REVES as a learner data source: revision and verification prompts from the current policy's recovered mistakes.

REVES (Liu et al. 2026, arXiv 2606.18910; the augmentation follows its public planners,
``planner/math_reflection_planner.py``) alternates prompt augmentation with policy optimisation. Each learner round:

1. **Augment** (:func:`augment`): the current policy answers each of the next training items once. A first-shot
   success contributes nothing. A wrong answer starts repair rounds: the policy gets the problem, its previous full
   answer and ``Feedback: The previous answer is incorrect.``; round ``r``'s answer is verified by the task. Every
   round yields a **repair** record (the prompt it was given) and a **verification** record (its answer as the
   candidate, labelled by the verifier). The item is kept only if some round recovers it, so a kept item with ``k``
   rounds gives ``k`` repair and ``k`` verification records, exactly one verification labelled True (the last); an
   item never recovered within ``max_retries`` gives nothing. These rollouts are recorded as eval runs (never trained
   on): REVES trains on the prompts, not on the rollouts that found them.
2. **Train** (:func:`training_bodies`): the round's training prompts, a share ``augmented_share`` of them REVES
   records and the rest original problems, each run ``group`` times through the agent by the current policy. A repair
   prompt's runs are scored by the task's verifier, a verification prompt's by whether the boxed verdict matches the
   label (``agents/reves.py`` builds both prompts and scores them; the label is recomputed there from the candidate).
   Each augmented prompt is its own group (run tag ``reves-r-…``/``reves-v-…``); the update trains on them once they settle.

The pool is rebuilt every round from the then-current policy (REVES's refresh), so earlier rounds' records are dropped.

Not here: prompt wording and scoring (``agents/reves.py``), HTTP (``learner/runs_client.py``), the update (``learner/service.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from learner.config import RevesConfig
from learner.runs_client import post_runs_async

__all__ = ["Attempt", "AugmentReport", "RevesRecord", "augment", "augment_item", "run_attempts", "training_bodies"]

AUGMENT_GROUP = "reves-augment"  # run tag of the augmentation rollouts (eval runs: recorded, never trained on)


@dataclass(frozen=True)
class RevesRecord:
    """One augmented training prompt: a repair of ``previous`` or a verification of it (``label``: is it right)."""

    kind: Literal["repair", "verify"]
    problem_index: int
    round: int  # 1-based repair round that produced it
    previous: str  # repair: the answer being repaired (the previous round's, or the first attempt); verify: the candidate
    label: bool | None = None  # verify only: the verifier's judgment of the candidate

    @property
    def group(self) -> str:
        """The run tag that makes this prompt its own group (a hash of what the prompt is built from)."""
        digest = hashlib.sha256(f"{self.kind}\0{self.problem_index}\0{self.previous}".encode()).hexdigest()[:20]
        return f"reves-{self.kind[0]}-{digest}"


@dataclass(frozen=True)
class Attempt:
    text: str  # the policy's full output (what the next repair prompt quotes)
    correct: bool  # the task verifier's judgment
    tokens: int = 0  # sampled tokens


# (problem_index, previous answer or None for the first attempt, round) -> the attempt, or None when the run failed
AttemptFn = Callable[[int, str | None, int], Awaitable[Attempt | None]]


async def augment_item(problem_index: int, attempt: AttemptFn, max_retries: int, tokens: list[int] | None = None) -> list[RevesRecord] | None:
    """REVES's augmentation of one item (module docstring); None when it is solved first-shot, never recovered, or a run failed."""
    first = await attempt(problem_index, None, 0)
    if tokens is not None and first is not None:
        tokens.append(first.tokens)
    if first is None or first.correct:
        return None
    records: list[RevesRecord] = []
    previous = first.text
    for r in range(1, max_retries + 1):
        y = await attempt(problem_index, previous, r)
        if y is None:
            return None
        if tokens is not None:
            tokens.append(y.tokens)
        records.append(RevesRecord("repair", problem_index, r, previous))
        records.append(RevesRecord("verify", problem_index, r, y.text, y.correct))
        if y.correct:
            return records
        previous = y.text
    return None


@dataclass
class AugmentReport:
    records: list[RevesRecord] = field(default_factory=list)
    items: int = 0
    first_shot_solved: int = 0
    recovered: int = 0
    unrecovered: int = 0
    failed: int = 0
    rounds: dict[int, int] = field(default_factory=dict)  # repair rounds needed -> recovered items
    sampled_tokens: int = 0

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out["records"] = {"repair": sum(r.kind == "repair" for r in self.records), "verify": sum(r.kind == "verify" for r in self.records)}
        return out


async def augment(problem_indices: Sequence[int], attempt: AttemptFn, max_retries: int) -> AugmentReport:
    """Augment every item concurrently (each item's rounds run in order); the records in item order."""
    report = AugmentReport(items=len(problem_indices))
    outcomes: dict[int, str] = {}

    async def one(i: int) -> list[RevesRecord] | None:
        tokens: list[int] = []
        seen: list[bool | None] = []

        async def tracked(idx: int, prev: str | None, r: int) -> Attempt | None:
            a = await attempt(idx, prev, r)
            seen.append(None if a is None else a.correct)
            return a

        recs = await augment_item(i, tracked, max_retries, tokens)
        report.sampled_tokens += sum(tokens)
        if None in seen:
            outcomes[i] = "failed"
        elif recs is not None:
            outcomes[i] = "recovered"
        elif seen[:1] == [True]:
            outcomes[i] = "first_shot_solved"
        else:
            outcomes[i] = "unrecovered"
        return recs

    results = await asyncio.gather(*(one(i) for i in problem_indices))
    for i, recs in zip(problem_indices, results, strict=True):
        setattr(report, outcomes[i], getattr(report, outcomes[i]) + 1)
        if recs is not None:
            report.records += recs
            k = len(recs) // 2
            report.rounds[k] = report.rounds.get(k, 0) + 1
    return report


def run_attempts(
    base_url: str, api_key: str | None, agent: str, *, seed: int, sample_seed: int, model: str | None, concurrency: int = 8, **kw: Any
) -> AttemptFn:
    """An :data:`AttemptFn` over the runs endpoint: one-turn eval runs (the first attempt on the problem's own prompt, then
    REVES repair prompts), sampled by ``model`` (the current policy), at most ``concurrency`` in flight over all items."""
    sem = asyncio.Semaphore(max(1, concurrency))

    async def attempt(problem_index: int, previous: str | None, r: int) -> Attempt | None:
        body: dict[str, Any] = {
            "problem_index": problem_index,
            "seed": seed,
            "sample_seed": sample_seed + r,
            "max_turns": 1,
            "eval": True,
            "group": AUGMENT_GROUP,
        }
        if model is not None:
            body["model"] = model
        if previous is not None:
            body["reves"] = {"kind": "repair", "previous": previous}
        async with sem:
            [out] = await post_runs_async(base_url, api_key, agent, [body], **kw)
        if isinstance(out, str) or not out.get("steps"):
            return None
        return Attempt(text=str(out["steps"][-1].get("text") or ""), correct=bool(out.get("correct")), tokens=int(out.get("completion_tokens") or 0))

    return attempt


def training_bodies(
    records: Sequence[RevesRecord], originals: Sequence[int], cfg: RevesConfig, *, sample_seed: int, model: str | None, rng: random.Random
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The round's training runs: ``round(prompts_per_round * augmented_share)`` REVES records (drawn at random from the
    pool; all of them when it is smaller) and original problems for the rest, ``cfg.group`` runs each."""
    n_aug = min(len(records), round(cfg.prompts_per_round * cfg.augmented_share))
    chosen = rng.sample(list(records), n_aug)
    plain = list(originals[: cfg.prompts_per_round - n_aug])
    bodies: list[dict[str, Any]] = []
    for rec in chosen:
        for k in range(cfg.group):
            body: dict[str, Any] = {
                "problem_index": rec.problem_index,
                "seed": cfg.seed,
                "sample_seed": sample_seed + k,
                "max_turns": 1,
                "reves": {"kind": rec.kind, "previous": rec.previous},
                "group": rec.group,
            }
            bodies.append(body if model is None else {**body, "model": model})
    for i in plain:
        for k in range(cfg.group):
            body = {"problem_index": i, "seed": cfg.seed, "sample_seed": sample_seed + k, "max_turns": 1}
            bodies.append(body if model is None else {**body, "model": model})
    counts = {
        "repair_prompts": sum(r.kind == "repair" for r in chosen),
        "verify_prompts": sum(r.kind == "verify" for r in chosen),
        "original_prompts": len(plain),
    }
    return bodies, counts


def reves_round(
    base_url: str, api_key: str | None, agent: str, cfg: RevesConfig, *, first_item: int, sample_seed: int, model: str | None, concurrency: int = 8
) -> dict[str, Any]:
    """One REVES round through a runtime: augment items ``first_item ..`` with ``model``, then run the round's training
    prompts (they train once they settle). Returns what happened, for the learner's history."""
    items = list(range(first_item, first_item + cfg.items_per_round))
    attempt = run_attempts(base_url, api_key, agent, seed=cfg.seed, sample_seed=sample_seed, model=model, concurrency=concurrency)
    report = asyncio.run(augment(items, attempt, cfg.max_retries))
    rng = random.Random(f"reves:{sample_seed}")
    bodies, counts = training_bodies(report.records, items, cfg, sample_seed=sample_seed + 500, model=model, rng=rng)
    outs = asyncio.run(post_runs_async(base_url, api_key, agent, bodies, concurrency=concurrency)) if bodies else []
    runs = [o for o in outs if isinstance(o, dict)]
    errors = [o for o in outs if isinstance(o, str)]
    return {
        **report.summary(),
        **counts,
        "items": [items[0], items[-1] + 1],
        "training_runs": len(runs),
        "training_failed": len(errors),
        "first_error": errors[0] if errors else None,
        "training_sampled_tokens": sum(int(r.get("completion_tokens") or 0) for r in runs),
        "training_reward_mean": sum(float(r.get("reward") or 0.0) for r in runs) / len(runs) if runs else None,
        "trajectory_ids": [str(r["trajectory_id"]) for r in runs if r.get("trajectory_id")],
    }
