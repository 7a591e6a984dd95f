"""Per-turn training samples and groups, read from the interaction store (DESIGN.md decisions 7-8).

    batch = collect_samples(store, family="tools-agent", current_version=3, cursor=Cursor(), cfg=SampleConfig())
    groups = make_groups(batch.samples)          # one Group per task key, for the advantage estimators
    turn_samples = to_turn_samples(batch.samples)  # learner.advantages.TurnSample, same order
    ... train ...; keep batch.cursor (it goes into the trainer's checkpoint) for the next call

A **sample** is one recorded turn exactly as the engine saw it: context ids, output ids, behaviour
logprobs and loss mask (never re-tokenized), its turn index, trajectory id, group id and rewards
(the latest turn-level and the latest trajectory-level reward, as ``SqliteStore.iter_samples``).

Which trajectories a call takes (the **cursor**): each trajectory belongs to the time window that holds
its *last* turn's ``created_at``. A call takes the trajectories whose last turn lies in
``[cursor.since, now - settle_s)`` with all their turns (also turns older than ``since``), and returns
the cursor ``since = now - settle_s`` for the next call; a trajectory that is still growing (its last
turn is newer than the horizon) is left for a later call. So every trajectory is taken once, whole,
provided its turns and rewards arrive within ``settle_s`` of its last turn; a reward that comes later
is not trained on (raise ``settle_s`` for slow feedback).

**Group ids** (which samples an estimator compares): ``task:<agent>:<task_key>`` when the trajectory's
meta has a task key (agent runs; ``-`` for a missing agent). Live chat traffic without one falls back
to ``prompt:<prefix_key>`` of the trajectory's first turn (the hash of the messages it answered, so
the same opening request forms a group), or, if that is empty, ``ctx:<sha256 of its context ids>``.
All turns of a trajectory share its group id; estimators tell turns apart by ``turn_index``.

What is skipped, and counted in ``SkipCounts`` (in turns; untrainable also in trajectories):
- ``untrainable``: trajectory meta ``trainable`` is false (an agent run broke the prefix invariant);
- ``draft``: T²PO resampled drafts (meta ``resampled_draft``), which are discarded by design;
- ``eval``: evaluation runs on held-out problems (meta ``eval``), never trained on;
- ``rerollout``: RTPO siblings and TCPO counterfactuals (meta ``rerollout``): the update that asked for
  them trained on them (``learner/rerollout.py``), so the live stream never takes them again;
- ``stale``: produced by ``family@N`` with ``N < current_version - max_staleness`` (the base model,
  ``adapter=None``, counts as version 0);
- ``other_family``: produced by another family's adapter (kept only with ``include_other_families``);
- ``no_reward``: neither a finite turn reward nor a finite trajectory reward (NaN/None are excluded,
  never treated as 0);
- ``no_tokens``: no output token with loss mask 1.
Samples without behaviour logprobs are kept (the trainer then uses its own detached logprobs, i.e.
ratio 1) and counted in ``missing_logprobs``.

Not here: advantages (``learner.advantages``), tensors or padding (``learner.trainer``), re-rollouts
(``learner.rerollout``).
Importing this module does not import torch.
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from learner.config import SampleConfig
from learner.records import Reward, Trajectory, context_sha256

if TYPE_CHECKING:
    from learner.advantages import TurnSample

log = structlog.get_logger(__name__)


class _Store(Protocol):
    def iter_samples(self, since: float | None = None, rewarded: bool | None = None, page_size: int = 256) -> Iterable[dict[str, Any]]: ...
    def get_trajectory(self, trajectory_id: str) -> Trajectory | None: ...


@dataclass(frozen=True)
class Cursor:
    """Where the learner's data stream stands: trajectories whose last turn is older than ``since`` are taken."""

    since: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"since": self.since}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Cursor:
        return cls(since=float((d or {}).get("since", 0.0)))


@dataclass(frozen=True)
class Sample:
    """One turn to train on; token lists are exactly what the engine saw and produced."""

    turn_id: str
    trajectory_id: str
    group_id: str
    turn_index: int
    context_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # behaviour logprob per output token; [] when the engine recorded none
    loss_mask: list[int]  # per output token, 1 = train on it
    adapter: str | None  # "family@N" that produced it, None = the base model
    adapter_version: int  # N, or 0 for the base model
    reward: float | None  # latest turn-level reward
    trajectory_reward: float | None  # latest trajectory-level reward
    temperature: float  # sampling temperature (the recorded logprobs are of logits / T; 1.0 for greedy)
    created_at: float
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # the trajectory's meta (agent, task_key, ...)
    grammar: dict[str, str] | None = None  # the decoding constraint {"kind", "spec"} the engine masked with; None = free

    @property
    def n_tokens(self) -> int:
        """Output tokens that are trained on (loss mask 1)."""
        return sum(self.loss_mask)

    @property
    def value(self) -> float:
        """The reward used for statistics: the turn reward, else the trajectory reward."""
        r = self.reward if self.reward is not None else self.trajectory_reward
        assert r is not None  # collect_samples drops samples without a finite reward
        return r


@dataclass
class SkipCounts:
    """What a ``collect_samples`` call left out, in turns (``untrainable_trajectories`` in trajectories)."""

    untrainable: int = 0
    untrainable_trajectories: int = 0
    draft: int = 0
    eval: int = 0
    rerollout: int = 0
    stale: int = 0
    other_family: int = 0
    no_reward: int = 0
    no_tokens: int = 0
    missing_logprobs: int = 0  # kept, but trained with ratio 1
    deferred_trajectories: int = 0  # still within settle_s; a later call takes them
    surplus: int = 0  # beyond max_trajectories: the smallest and oldest groups left out

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class SampleBatch:
    samples: list[Sample]
    counts: SkipCounts
    cursor: Cursor  # pass this to the next call


@dataclass(frozen=True)
class Group:
    """Samples that share a group id (same task), for the advantage estimators."""

    group_id: str
    samples: tuple[Sample, ...]

    @property
    def trajectory_ids(self) -> list[str]:
        return list(dict.fromkeys(s.trajectory_id for s in self.samples))


def parse_adapter(adapter: str | None) -> tuple[str | None, int]:
    """``"fam@7"`` → ("fam", 7); ``None`` (the base model) → (None, 0); anything else → (adapter, -1)."""
    if adapter is None:
        return None, 0
    family, at, version = adapter.partition("@")
    if at and version.isdigit():
        return family, int(version)
    return adapter, -1


def group_id_of(trajectory: Trajectory) -> str:
    """The group id of a trajectory (see the module docstring for the rule and its fallbacks)."""
    task_key = trajectory.meta.get("task_key")
    if task_key:
        return f"task:{trajectory.meta.get('agent') or '-'}:{task_key}"
    if not trajectory.turns:
        return f"trajectory:{trajectory.trajectory_id}"
    first = trajectory.turns[0]
    if first.prefix_key:
        return f"prompt:{first.prefix_key}"
    return "ctx:" + hashlib.sha256(array("i", first.context_ids).tobytes()).hexdigest()[:32]


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _latest(rewards: Sequence[Reward], target: str, target_id: str) -> float | None:
    values = [r.value for r in rewards if r.target == target and r.target_id == target_id]
    return _finite(values[-1]) if values else None


def _temperature(sampling: dict[str, Any]) -> float:
    t = sampling.get("temperature")
    return float(t) if isinstance(t, int | float) and t > 0 else 1.0  # greedy logprobs are of the raw logits


def collect_samples(
    store: _Store,
    *,
    family: str,
    current_version: int,
    cursor: Cursor,
    cfg: SampleConfig,
    now: float | None = None,
) -> SampleBatch:
    """Build the samples of every settled trajectory past ``cursor`` (module docstring: window, skips, groups).

    ``current_version`` is the family's latest version (the one the trainer continues from); 0 when
    nothing has been published yet.
    """
    horizon = (time.time() if now is None else now) - cfg.settle_s
    counts = SkipCounts()
    seen: dict[str, None] = {}  # insertion-ordered set
    for row in store.iter_samples(since=cursor.since):  # discovery only: the trajectory is read whole below
        seen.setdefault(row["trajectory_id"], None)
    min_version = current_version - cfg.max_staleness
    samples: list[Sample] = []
    for tid in seen:
        traj = store.get_trajectory(tid)
        if traj is None or not traj.turns:  # deleted since discovery
            continue
        last = max(t.created_at for t in traj.turns)
        if last >= horizon:
            counts.deferred_trajectories += 1
            continue
        if last < cursor.since:  # belongs to an earlier window (only a turn of it was new)
            continue
        if traj.meta.get("resampled_draft"):
            counts.draft += len(traj.turns)
            continue
        if traj.meta.get("eval"):
            counts.eval += len(traj.turns)
            continue
        if traj.meta.get("rerollout"):
            counts.rerollout += len(traj.turns)
            continue
        samples += trajectory_samples(traj, family=family, min_version=min_version, cfg=cfg, counts=counts)
    if cfg.max_trajectories is not None:
        samples = _cap_trajectories(samples, cfg.max_trajectories, counts)
    next_cursor = Cursor(since=max(cursor.since, horizon))
    log.info("collected samples", family=family, samples=len(samples), trajectories=len(seen), **counts.as_dict())
    return SampleBatch(samples=samples, counts=counts, cursor=next_cursor)


def trajectory_samples(traj: Trajectory, *, family: str, min_version: int, cfg: SampleConfig, counts: SkipCounts) -> list[Sample]:
    """The trainable turns of one trajectory (turn-level skips counted in ``counts``); ``collect_samples``
    calls it per settled trajectory, the re-rollout code on the branches it just ran."""
    if traj.meta.get("trainable", True) is False:
        counts.untrainable += len(traj.turns)
        counts.untrainable_trajectories += 1
        return []
    tid = traj.trajectory_id
    gid = group_id_of(traj)
    traj_reward = _latest(traj.rewards, "trajectory", tid)
    out: list[Sample] = []
    for turn in traj.turns:
        fam, version = parse_adapter(turn.adapter)
        if fam is not None and fam != family:
            if not cfg.include_other_families:
                counts.other_family += 1
                continue
        elif version < min_version:
            counts.stale += 1
            continue
        turn_reward = _latest(traj.rewards, "turn", turn.turn_id)
        if turn_reward is None and traj_reward is None:
            counts.no_reward += 1
            continue
        if not any(turn.loss_mask):
            counts.no_tokens += 1
            continue
        if not turn.logprobs:
            counts.missing_logprobs += 1
        out.append(
            Sample(
                turn_id=turn.turn_id,
                trajectory_id=tid,
                group_id=gid,
                turn_index=turn.index,
                context_ids=list(turn.context_ids),
                output_ids=list(turn.output_ids),
                logprobs=list(turn.logprobs),
                loss_mask=list(turn.loss_mask),
                adapter=turn.adapter,
                adapter_version=max(version, 0),
                reward=turn_reward,
                trajectory_reward=traj_reward,
                temperature=_temperature(turn.sampling),
                created_at=turn.created_at,
                meta=dict(traj.meta),
            )
        )
    return out


def _cap_trajectories(samples: list[Sample], limit: int, counts: SkipCounts) -> list[Sample]:
    """Whole groups, largest first then newest, until ``limit`` trajectories (always at least one group)."""
    order = sorted(make_groups(samples), key=lambda g: (len(g.trajectory_ids), max(s.created_at for s in g.samples)), reverse=True)
    kept: set[str] = set()
    taken = 0
    for g in order:
        size = len(g.trajectory_ids)
        if taken and taken + size > limit:
            continue
        kept.add(g.group_id)
        taken += size
    out = [s for s in samples if s.group_id in kept]
    counts.surplus += len(samples) - len(out)
    return out


def make_groups(samples: Iterable[Sample]) -> list[Group]:
    """Samples grouped by group id, groups in first-seen order, samples in their given order."""
    by_id: dict[str, list[Sample]] = {}
    for s in samples:
        by_id.setdefault(s.group_id, []).append(s)
    return [Group(group_id=g, samples=tuple(ss)) for g, ss in by_id.items()]


def to_turn_samples(samples: Sequence[Sample]) -> list[TurnSample]:
    """The estimators' view of ``samples`` (same order).

    ``correct`` and ``score`` come from the trajectory meta when an agent recorded them (bool / number);
    ``anchor`` is the exact context's id (:func:`learner.records.context_sha256`): turns with byte-identical
    contexts (the first turns of one problem's runs, RTPO siblings and their backbone turn) share it, which
    is both RTPO's sibling key and GiGPO's (exact) state anchor.
    """
    from learner.advantages import TurnSample  # numpy-only; imported here so this module stays importable on its own

    return [
        TurnSample(
            trajectory_id=s.trajectory_id,
            group_id=s.group_id,
            turn_index=s.turn_index,
            reward=s.reward,
            trajectory_reward=s.trajectory_reward,
            n_tokens=s.n_tokens,
            correct=_opt_bool(s.meta.get("correct")),
            score=_finite(s.meta.get("score")) if isinstance(s.meta.get("score"), int | float) else None,
            anchor=context_sha256(s.context_ids),
        )
        for s in samples
    ]


def _opt_bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None
