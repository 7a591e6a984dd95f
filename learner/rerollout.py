"""Re-rollouts from stored contexts: RTPO's sparse reverse trees and TCPO's fixed-history counterfactuals.

    runner = BranchRunner("http://127.0.0.1:8000", admin_key, agent="calc-agent", store=store)
    runs = runner.run([BranchPoint(traj, 2)], n=2, model="calc-lora@3", kind="rtpo")   # list[BranchRun]

A **branch point** is turn ``t`` of a recorded task run (its meta names ``task``, ``problem_index`` and
``problem_seed``). A branch run asks the runtime's admin runs endpoint for the same agent and task
problem with ``branch`` = the trajectory id, ``t`` and the sha256 of its recorded context at turn ``t``:
the runtime reads the backbone from its store, replays turns ``0..t-1`` as recorded (no tool runs
again), refuses with 409 if the backbone does not fit (another problem, a changed agent, a context
that differs from the learner's copy), and samples from turn ``t`` with the given model to the end of
the run (``agents/loop.py``, "Re-rollouts"). The verifier rewards the branch like any run;
its trajectory is recorded with meta ``branch_of``/``branch_turn``/``anchor``/``rerollout``, which keeps
it out of the live sample stream (``learner.samples``: the update that asked for it trains on it).
``BranchRunner`` reads each branch back from the interaction store, waiting out the recorder's commit
window, so training uses the exact recorded ids, never the HTTP answer.

Planning (pure; the service executes the plan: runs, estimator, trainer, publish):
- RTPO: :func:`plan_rtpo` picks ``K`` branch turns per backbone (:func:`choose_branch_turns`, uniform over
  turns ``1..T-1``; turn 0 needs no branch: a problem's runs already share that context, so they are its
  siblings) and the sweep's optimizer steps, latest turns first (:func:`rtpo_segments` over the turn buckets of
  :func:`rtpo_turn_buckets`; :func:`rtpo_update_order` gives those buckets as sample indices); for each branch
  point the service runs ``m`` siblings and one *refresh* of the backbone's own continuation
  (:func:`refresh_point`), both with the policy of that moment, and :func:`rtpo_estimator_input` builds
  the sibling sets the ``rtpo`` estimator scores (whole continuations, not the branch turn alone).
- TCPO: :func:`tcpo_branch_points` picks the high-surprisal turns (:func:`turn_surprisal`, :func:`tcpo_select_turns`) that
  can be replayed; :func:`counterfactual_scores` collects the verifier's scores of their one-step
  alternatives (:func:`counterfactual_score`: the step's process score, else the run's reward, the latter only
  for a backbone's last turn, where the backbone's own score is its outcome too).

Not here: running the sweep against the trainer (``learner/rollout_steps.py``), advantages (``learner.advantages``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import numpy as np
import structlog

from learner.advantages import TurnSample
from learner.records import Trajectory, context_sha256
from learner.samples import Sample

log = structlog.get_logger(__name__)


class _Store(Protocol):
    def get_trajectory(self, trajectory_id: str) -> Trajectory | None: ...


@dataclass(frozen=True)
class BranchPoint:
    trajectory: Trajectory  # the backbone, as recorded
    turn: int  # the position of the branch turn in ``trajectory.turns`` (= its turn index for agent runs)


@dataclass
class BranchRun:
    point: BranchPoint
    run: dict[str, Any] = field(default_factory=dict)  # the runs endpoint's answer ({} on failure)
    trajectory: Trajectory | None = None  # the recorded branch (sampled turns only), None on failure
    error: str | None = None  # why there is no branch (409 mismatch, HTTP error, not recorded in time)


def branchable(traj: Trajectory) -> bool:
    """A task run the runtime can replay: it names its problem and was not itself a branch or an eval run."""
    m = traj.meta
    return (
        isinstance(m.get("problem_index"), int)
        and m.get("task") is not None
        and not m.get("rerollout")
        and not m.get("eval")
        and m.get("trainable", True) is not False
        and [t.index for t in traj.turns] == list(range(len(traj.turns)))
    )


def branch_body(point: BranchPoint, *, sample_seed: int, model: str | None, kind: str, max_turns: int | None = None) -> dict[str, Any]:
    """The ``POST /admin/agents/{agent}/runs`` body of one branch run (the runtime reads the backbone from its store)."""
    traj, t = point.trajectory, point.turn
    if not 0 <= t < len(traj.turns):
        raise ValueError(f"branch turn {t} outside the trajectory's {len(traj.turns)} turns")
    m = traj.meta
    body: dict[str, Any] = {
        "task": m["task"],
        "problem_index": m["problem_index"],
        "seed": m.get("problem_seed") or 0,
        "sample_seed": sample_seed,
        "branch": {"trajectory_id": traj.trajectory_id, "turn": t, "context_sha256": context_sha256(traj.turns[t].context_ids), "kind": kind},
    }
    if model is not None:
        body["model"] = model
    if max_turns is not None:
        body["max_turns"] = max_turns
    return body


def choose_branch_turns(n_turns: int, k: int, rng: random.Random) -> list[int]:
    """RTPO's sparse branch turns of one backbone: ``min(k, n_turns - 1)`` distinct turns of ``1..n_turns-1``, ascending."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    pool = list(range(1, n_turns))
    return sorted(rng.sample(pool, min(k, len(pool))))


def rtpo_turn_buckets(turn_indices: Sequence[int], bucket_size: int = 1) -> list[list[int]]:
    """RTPO's reverse sweep over turn indices: the distinct turns in buckets of ``bucket_size``, latest first, each ascending.

    Bucket k holds the turns in ``(t_max - (k+1)*bucket_size, t_max - k*bucket_size]``; empty buckets are
    dropped, so every turn in a bucket is strictly below every turn of the bucket before it."""
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    turns = sorted(set(turn_indices))
    buckets: dict[int, list[int]] = {}
    for t in turns:
        buckets.setdefault((turns[-1] - t) // bucket_size, []).append(t)
    return [buckets[k] for k in sorted(buckets)]


def rtpo_update_order(samples: Sequence[TurnSample], *, bucket_size: int = 1) -> list[list[int]]:
    """RTPO's reverse sweep (``docs/methods.md#rtpo``): sample indices by :func:`rtpo_turn_buckets`, latest first.

    Indices inside a bucket are ascending."""
    turns = [s.turn_index for s in samples]
    bucket_of = {t: k for k, b in enumerate(rtpo_turn_buckets(turns, bucket_size)) for t in b}
    out: list[list[int]] = [[] for _ in set(bucket_of.values())]
    for i, t in enumerate(turns):
        out[bucket_of[t]].append(i)
    return out


# ---- RTPO: the sweep's plan and its estimator input ------------------------------------------------------


@dataclass(frozen=True)
class RtpoPlan:
    """One update's reverse sweep: the branch points, and the turn indices each optimizer step trains, latest first."""

    points: list[BranchPoint]
    segments: list[list[int]]


def rtpo_segments(turn_indices: Sequence[int], branch_turns: Collection[int], bucket_size: int = 1) -> list[list[int]]:
    """The sweep's optimizer steps: turn buckets latest first (``rtpo_turn_buckets``); a bucket with a branch point
    starts a new step (its siblings must be sampled by the policy the steps before it made), a bucket without one
    joins the step before it. No branch point at all: one step over every turn, i.e. trajectory GRPO."""
    segments: list[list[int]] = []
    for bucket in rtpo_turn_buckets(turn_indices, bucket_size):
        if not segments or any(t in branch_turns for t in bucket):
            segments.append(list(bucket))
        else:
            segments[-1] = sorted(segments[-1] + list(bucket))
    return segments


def plan_rtpo(backbones: Sequence[Trajectory], turn_indices: Sequence[int], *, branches: int, bucket_size: int, rng: random.Random) -> RtpoPlan:
    """RTPO's sparse reverse trees for one update: ``branches`` turns per branchable backbone, and the step segments."""
    points = [BranchPoint(t, k) for t in backbones if branchable(t) for k in choose_branch_turns(len(t.turns), branches, rng)]
    return RtpoPlan(points, rtpo_segments([*turn_indices, *(p.turn for p in points)], {p.turn for p in points}, bucket_size))


def refresh_point(point: BranchPoint) -> BranchPoint | None:
    """The backbone's own continuation re-rolled by the current policy: a branch one turn later, replaying the backbone's
    turn ``t`` itself (None when ``t`` is the backbone's last turn: nothing follows it)."""
    return BranchPoint(point.trajectory, point.turn + 1) if point.turn + 1 < len(point.trajectory.turns) else None


@dataclass
class PointRuns:
    """What one branch point's re-rollouts gave: the sibling branches and the backbone's refreshed continuation."""

    point: BranchPoint
    siblings: list[Trajectory] = field(default_factory=list)
    refresh: Trajectory | None = None
    refresh_failed: bool = False  # a refresh run was asked for and failed: the point gets no sibling set


def rtpo_estimator_input(
    backbone_samples: Sequence[Sample],
    point_runs: Sequence[PointRuns],
    train_turns: Collection[int],
    to_samples: Callable[[Trajectory], list[Sample]],
    reward_sources: Sequence[str],
) -> tuple[list[Sample], list[int]]:
    """The samples one sweep step gives the ``rtpo`` estimator, and the indices of those it trains.

    Every backbone sample goes in (their trajectories' scores are the un-branched turns' GRPO baseline); the
    backbone turns whose indices are in ``train_turns`` are trained. A branch point with at least one sibling
    becomes its own group (``<group>|branch:<backbone>:<t>``, so partial trajectories never enter the backbones'
    baseline) holding, at the same exact context: the backbone's turn ``t`` continued by its refreshed
    continuation (the current policy's, like the siblings'; the backbone's recorded one if there is none) and
    each sibling with its whole continuation. Those turn-``t`` samples are trained in place of the backbone's
    own turn ``t``; their later turns only provide the returns. ``to_samples`` turns a recorded branch into
    samples (``learner.samples.trajectory_samples``); sources are resolved within each branch group by
    ``reward_sources`` (the learner's ``SampleConfig.reward_sources``)."""
    from learner.samples import SkipCounts, resolve_sources

    by_turn = {(s.trajectory_id, s.turn_index): s for s in backbone_samples}
    out = list(backbone_samples)
    replaced: set[tuple[str, int]] = set()
    train: list[int] = []
    for pr in point_runs:
        bb, t = pr.point.trajectory, pr.point.turn
        own = by_turn.get((bb.trajectory_id, t))
        sib_samples = [[s for s in to_samples(traj) if s.turn_index >= t] for traj in pr.siblings]
        sib_samples = [ss for ss in sib_samples if ss and ss[0].turn_index == t]
        if own is None or not sib_samples or pr.refresh_failed:
            continue  # no sibling set: the backbone turn keeps its trajectory-GRPO advantage
        gid = f"{own.group_id}|branch:{bb.trajectory_id}:{t}"
        group: list[Sample] = []
        refreshed = [s for s in to_samples(pr.refresh) if s.turn_index > t] if pr.refresh is not None else []
        if refreshed:
            rt = refreshed[0]
            copy = dataclasses.replace(
                own,
                trajectory_id=rt.trajectory_id,
                trajectory_reward=rt.trajectory_reward,
                trajectory_reward_source=rt.trajectory_reward_source,
            )
            group += [copy, *refreshed]
        else:  # the backbone's recorded continuation (t is its last turn, or refresh is off)
            tid = f"{bb.trajectory_id}#from{t}"
            group += [
                dataclasses.replace(s, trajectory_id=tid) for s in backbone_samples if s.trajectory_id == bb.trajectory_id and s.turn_index >= t
            ]
        for ss in sib_samples:
            group += ss
        group = [dataclasses.replace(s, group_id=gid) for s in group]
        group = resolve_sources(group, reward_sources, SkipCounts())
        start = len(out)
        out += group
        train += [start + i for i, s in enumerate(group) if s.turn_index == t]
        replaced.add((bb.trajectory_id, t))
    train = [i for i, s in enumerate(backbone_samples) if s.turn_index in train_turns and (s.trajectory_id, s.turn_index) not in replaced] + train
    return out, sorted(train)


# ---- TCPO: the counterfactuals' plan and scores ----------------------------------------------------------


def turn_surprisal(logprobs: Sequence[float]) -> float:
    """``-(1/|a_t|) sum_j log pi_old(a_{t,j})``: the mean negative log-probability of one turn's tokens."""
    if len(logprobs) == 0:
        return 0.0
    return -float(np.mean(np.asarray(logprobs, dtype=np.float64)))


def tcpo_select_turns(surprisals: Sequence[float], *, top_q: float = 0.2, threshold: float | None = None) -> list[bool]:
    """Which turns get counterfactual re-rollouts: ``surprisal > threshold`` if given, else the top ``top_q`` fraction.

    The top-q rule keeps ``ceil(top_q * n)`` turns, ties broken by position (earlier first), so the cost is bounded.
    """
    s = np.asarray(surprisals, dtype=np.float64)
    if threshold is not None:
        return [bool(x) for x in s > threshold]
    if not 0.0 <= top_q <= 1.0:
        raise ValueError(f"top_q must be in [0, 1], got {top_q}")
    k = math.ceil(top_q * s.shape[0])
    chosen = np.zeros(s.shape[0], dtype=np.bool_)
    chosen[np.argsort(-s, kind="stable")[:k]] = True
    return chosen.tolist()


def select_counterfactual_turns(samples: Sequence[Sample], *, top_q: float, threshold: float | None) -> list[Sample]:
    """TCPO's selective counterfactuals: the samples whose behaviour-policy surprisal is in the top ``top_q`` (or above ``threshold``).

    The surprisal is over the turn's trained tokens (loss mask 1: forced tokens are not the policy's choice). Samples
    without recorded logprobs have no surprisal and are never selected."""
    with_lp = [s for s in samples if s.logprobs]
    if not with_lp:
        return []
    surprisal = [turn_surprisal([lp for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m]) for s in with_lp]
    chosen = tcpo_select_turns(surprisal, top_q=top_q, threshold=threshold)
    return [s for s, c in zip(with_lp, chosen, strict=True) if c]


def tcpo_branch_points(samples: Sequence[Sample], store: _Store, *, top_q: float, threshold: float | None) -> tuple[list[Sample], list[BranchPoint]]:
    """The selected high-surprisal turns and the branch points of those that can be replayed (their runs name a problem)."""
    chosen = select_counterfactual_turns(samples, top_q=top_q, threshold=threshold)
    trajs: dict[str, Trajectory | None] = {}
    points: list[BranchPoint] = []
    for s in chosen:
        if s.trajectory_id not in trajs:
            trajs[s.trajectory_id] = store.get_trajectory(s.trajectory_id)
        traj = trajs[s.trajectory_id]
        if traj is not None and branchable(traj) and s.turn_index < len(traj.turns):
            points.append(BranchPoint(traj, s.turn_index))
    return chosen, points


def counterfactual_scores(runs: Sequence[BranchRun]) -> dict[tuple[str, int], list[float]]:
    """``(backbone trajectory id, turn) → the verifier's scores of its one-step alternatives`` (what ``tcpo`` takes).

    Like with like: an alternative scored only by its truncated run's reward (the task has no per-turn score)
    is comparable with the backbone turn only where that turn is the backbone's last (its own run ended there
    too, so ``v_t`` is the outcome); for an earlier turn the backbone has no such value and the alternative is
    dropped (counted in the log line; ``tcpo`` applies the same rule to what it is given)."""
    scores: dict[tuple[str, int], list[float]] = {}
    incomparable = 0
    for r in runs:
        v = counterfactual_score(r.run) if r.error is None else None
        if v is None:
            continue
        if not _process_scored(r.run) and r.point.turn < len(r.point.trajectory.turns) - 1:
            incomparable += 1
            continue
        scores.setdefault((r.point.trajectory.trajectory_id, r.point.turn), []).append(v)
    if incomparable:
        log.info("tcpo counterfactuals without a comparable turn score dropped", runs=incomparable)
    return scores


def _process_scored(run: dict[str, Any]) -> bool:
    steps = [s for s in run.get("steps", []) if not s.get("replayed")]
    return bool(steps) and isinstance(steps[-1].get("process_score"), int | float)


def counterfactual_score(run: dict[str, Any]) -> float | None:
    """The verifier's score of a one-step alternative: its process score, else the run's reward; None if neither."""
    steps = [s for s in run.get("steps", []) if not s.get("replayed")]
    if steps and isinstance(steps[-1].get("process_score"), int | float):
        return float(steps[-1]["process_score"])
    r = run.get("reward")
    return float(r) if isinstance(r, int | float) else None


class BranchRunner:
    """Runs branch points through a runtime's runs endpoint and reads the recorded branches back."""

    def __init__(
        self,
        base_url: str,
        admin_key: str | None,
        *,
        agent: str,
        store: _Store,
        concurrency: int = 8,
        timeout_s: float = 900.0,
        record_wait_s: float = 30.0,
    ) -> None:
        self.base_url, self.agent, self.store = base_url.rstrip("/"), agent, store
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.concurrency, self.timeout_s, self.record_wait_s = concurrency, timeout_s, record_wait_s

    def run(self, points: Sequence[BranchPoint], *, n: int, model: str | None, kind: str, one_step: bool = False, seed: int = 0) -> list[BranchRun]:
        """``n`` branch runs per point (sampling seeds ``seed*10007 + k``); ``one_step`` stops each after its first sampled turn."""
        return asyncio.run(self._run_all(points, n, model, kind, one_step, seed))

    async def _run_all(self, points: Sequence[BranchPoint], n: int, model: str | None, kind: str, one_step: bool, seed: int) -> list[BranchRun]:
        sem = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout_s) as client:

            async def one(point: BranchPoint, k: int) -> BranchRun:
                body = branch_body(point, sample_seed=seed * 10007 + k, model=model, kind=kind, max_turns=point.turn + 1 if one_step else None)
                async with sem:
                    try:
                        r = await client.post(f"/admin/agents/{self.agent}/runs", json=body)  # branches are admin-only
                    except httpx.HTTPError as exc:
                        return BranchRun(point, error=f"{type(exc).__name__}: {exc}")
                if r.status_code != 200:
                    return BranchRun(point, error=f"{r.status_code}: {r.text[:300]}")
                run = r.json()
                traj = await self._recorded(run)
                return BranchRun(point, run, traj, None if traj is not None else "the branch was not recorded in time")

            results = await asyncio.gather(*(one(p, k) for p in points for k in range(n)))
        failed = [r.error for r in results if r.error]
        if failed:
            log.warning("branch runs failed", kind=kind, failed=len(failed), of=len(results), first=failed[0])
        return list(results)

    async def _recorded(self, run: dict[str, Any]) -> Trajectory | None:
        """The branch's trajectory once all its sampled turns, its meta and (if the run got one) its reward are stored."""
        sampled = sum(1 for s in run.get("steps", []) if not s.get("replayed"))
        want_reward = run.get("reward") is not None
        deadline = time.monotonic() + self.record_wait_s
        while True:
            traj = self.store.get_trajectory(run["trajectory_id"])
            if (
                traj is not None
                and len(traj.turns) == sampled
                and traj.meta.get("rerollout")
                and (not want_reward or any(r.target == "trajectory" for r in traj.rewards))
            ):
                return traj
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)
