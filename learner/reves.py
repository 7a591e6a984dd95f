"""REVES as a learner data source: revision and verification prompts from the current policy's recovered mistakes.

REVES (Liu et al. 2026, arXiv 2606.18910; the augmentation follows its public planners,
``planner/math_reflection_planner.py``) alternates prompt augmentation with policy optimisation. Each learner round:

1. **Augment** (:func:`augment`): the current policy answers each of the next training items once. A first-shot
   success contributes nothing. A wrong answer starts repair rounds: the policy gets the problem, its previous full
   answer and ``Feedback: The previous answer is incorrect.``; round ``r``'s answer is verified by the task. Every
   round yields a **repair** record (the prompt it was given) and a **verification** record (its answer as the
   candidate, labelled by the verifier); the first wrong answer is a verification candidate too (labelled False:
   REVES's planner gives it none, see *Verification labels*). The item is kept only if some round recovers it, so a
   kept item with ``k`` rounds gives ``k`` repair and ``k + 1`` verification records, ``k`` labelled False and one
   True (the last); an item never recovered within ``max_retries`` gives nothing. These rollouts are recorded as eval
   runs (never trained on): REVES trains on the prompts, not on the rollouts that found them.
2. **Train** (:func:`training_bodies`): the round's training prompts, a share ``augmented_share`` of them REVES
   records and the rest original problems, each run ``group`` times through the agent by the current policy. A repair
   prompt's runs are scored by the task's verifier, a verification prompt's by whether the boxed verdict matches the
   label (``agents/reves.py`` builds both prompts and scores them; the label is recomputed there from the candidate).
   Each augmented prompt is its own group (run tag ``reves-r-…``/``reves-v-…``); the update trains on them once they settle.

**Verification labels.** REVES rewards a verification rollout 1 when its boxed verdict matches the label and 0
otherwise: the objective is verdict accuracy over the verification prompts. Verification is trained so that the
policy can judge its own answers while it revises, which takes both of a judge's rates — True for right answers,
False for wrong ones. Accuracy over a pool in which the two labels weigh equally is exactly the mean of those two
rates (balanced accuracy), and there a constant verdict earns chance, 1/2; that is the objective we read REVES's as.
Its planner's pool is not balanced: one True per recovered item, one False per failed repair round, so a policy that
mostly recovers in one round makes a pool of almost only Trues, on which "always True" is almost always rewarded. So
the first wrong answer is a False candidate too (every recovered item has at least one candidate of each label), each
round's pool keeps as many verification records of each label, the majority label subsampled at random
(:func:`balanced_pool`), and the round's draw takes verification prompts in True/False pairs
(:func:`training_bodies`). Subsampled, not weighted: the reward stays REVES's 0/1 match, the runs endpoint has no
per-prompt weight, and scaling a prompt's rewards would be undone by GRPO's per-group normalisation. The counts go
with the round into the learner's history (``reves``): ``verify_labels`` of the augmentation's pool,
``balanced_pool``, and the ``verify_true_prompts`` / ``verify_false_prompts`` drawn.

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

__all__ = ["Attempt", "AugmentReport", "RevesRecord", "augment", "augment_item", "balanced_pool", "run_attempts", "training_bodies"]

AUGMENT_GROUP = "reves-augment"  # run tag of the augmentation rollouts (eval runs: recorded, never trained on)


@dataclass(frozen=True)
class RevesRecord:
    """One augmented training prompt: a repair of ``previous`` or a verification of it (``label``: is it right)."""

    kind: Literal["repair", "verify"]
    problem_index: int
    round: int  # the repair round that produced it (1-based); 0: the first attempt (a verification candidate only)
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
    records = [RevesRecord("verify", problem_index, 0, first.text, False)]  # the first wrong answer: a False candidate
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
        out["verify_labels"] = _label_counts(self.records)  # before balancing: what the augmentation found
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
            k = sum(r.kind == "repair" for r in recs)
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


def _label_counts(records: Sequence[RevesRecord]) -> dict[str, int]:
    """How many verification records are labelled True and False."""
    verify = [r for r in records if r.kind == "verify"]
    return {"true": sum(r.label is True for r in verify), "false": sum(r.label is False for r in verify)}


def balanced_pool(records: Sequence[RevesRecord], rng: random.Random) -> list[RevesRecord]:
    """``records`` with as many verification records labelled True as False (module docstring): the majority label is
    subsampled at random to the minority's count; every repair record is kept, in pool order. Identical prompts (an
    answer repeated word for word: same kind, item and text, so the same group tag) count once. A pool whose
    verification records all have one label keeps none of them: alone they would reward a constant verdict."""
    firsts: dict[str, RevesRecord] = {}
    for r in records:
        firsts.setdefault(r.group, r)
    unique = list(firsts.values())
    trues = [i for i, r in enumerate(unique) if r.kind == "verify" and r.label is True]
    falses = [i for i, r in enumerate(unique) if r.kind == "verify" and r.label is False]
    m = min(len(trues), len(falses))
    keep = {*rng.sample(trues, m), *rng.sample(falses, m)}
    return [r for i, r in enumerate(unique) if r.kind == "repair" or i in keep]


def training_bodies(
    records: Sequence[RevesRecord], originals: Sequence[int], cfg: RevesConfig, *, sample_seed: int, model: str | None, rng: random.Random
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The round's training runs, ``cfg.group`` runs per prompt: ``n = round(prompts_per_round * augmented_share)``
    REVES prompts (all of the balanced pool when it is smaller) and original problems for the rest.

    The REVES prompts are drawn at random from :func:`balanced_pool` of ``records``: verification prompts in
    True/False pairs, as many pairs as the pool's verification share of ``n`` (``n · m / P`` for ``m`` pairs in a pool
    of ``P``, rounded half up), so the two labels weigh equally in every round; repair prompts for the rest."""
    pool = balanced_pool(records, rng)
    repairs = [r for r in pool if r.kind == "repair"]
    trues = [r for r in pool if r.kind == "verify" and r.label is True]
    falses = [r for r in pool if r.kind == "verify" and r.label is False]
    n = min(len(pool), round(cfg.prompts_per_round * cfg.augmented_share))
    pairs = min(len(trues), n // 2, (2 * n * len(trues) + len(pool)) // (2 * len(pool))) if pool else 0
    chosen = [*rng.sample(repairs, min(len(repairs), n - 2 * pairs)), *rng.sample(trues, pairs), *rng.sample(falses, pairs)]
    plain = list(originals[: cfg.prompts_per_round - len(chosen)])
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
        "verify_prompts": 2 * pairs,
        "verify_true_prompts": pairs,
        "verify_false_prompts": pairs,
        "original_prompts": len(plain),
        "balanced_pool": {"repair": len(repairs), "verify_true": len(trues), "verify_false": len(falses)},
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
