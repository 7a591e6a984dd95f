"""Per-turn training samples and groups, read from the interaction store.

    batch = collect_samples(store, family="tools-agent", min_version=1, cursor=Cursor(), cfg=SampleConfig())
    groups = make_groups(batch.samples)          # one Group per task key, for the advantage estimators
    turn_samples = to_turn_samples(batch.samples)  # learner.advantages.TurnSample, same order
    ... train ...; keep batch.cursor (it goes into the trainer's checkpoint) for the next call

A **sample** is one recorded turn exactly as the engine saw it: context ids, output ids, behaviour
logprobs and loss mask (never re-tokenized), the grammar it was decoded under (``sampling["grammar"]``,
which the trainer re-applies), its turn index, trajectory id, group id, the environment's state key
(meta ``state_keys``, for GiGPO) and rewards.

**Rewards and their sources** (``SampleConfig.reward_sources``, patterns in precedence order; default
``verifier:*``, ``judge:*``, ``hook:*``, ``feedback``, ``*``). For each turn and each trajectory the reward used is
the newest one of the first pattern any of its rewards match; a source matching no pattern never
trains. Then, within a group, every member is scored by the group's best source (separately for
trajectory rewards and turn rewards): a member whose only reward comes from a lower-ranked source loses
it (``other_source``), so a verifier's 0/1 and a user's thumbs are never normalised against each other.
A sample keeps the turn reward and the trajectory (outcome) reward separately; ``learner.advantages``
combines them by one rule (its docstring: the reward stream).

Which trajectories a call takes (the **cursor**): each trajectory belongs to the time window that holds
its *last* turn's ``created_at``. A call takes the trajectories whose last turn lies in
``[cursor.since, now - settle_s)`` with all their turns (also turns older than ``since``), and returns
the cursor ``since = now - settle_s`` for the next call; a trajectory that is still growing (its last
turn is newer than the horizon) is left for a later call. So every trajectory is taken once, whole,
provided its turns and rewards arrive within ``settle_s`` of its last turn; a reward that comes later
is not trained on (raise ``settle_s`` for slow feedback).

**Group ids** (which samples an estimator compares): ``task:<agent>:<task_key>`` when the trajectory's
meta has a task key (agent runs; ``-`` for a missing agent), with ``#<group>`` when the run was tagged
(meta ``group``, e.g. LEAP's single-turn probes, so they never join the multi-turn episodes' group). Live chat traffic without one falls back
to ``prompt:<prefix_key>`` of the trajectory's first turn (the hash of the messages it answered, so
the same opening request forms a group), or, if that is empty, ``ctx:<sha256 of its context ids>``.
All turns of a trajectory share its group id; estimators tell turns apart by ``turn_index``.

What is skipped, and counted in ``SkipCounts`` (in turns unless said otherwise). A trajectory is taken
whole or not at all, because its outcome reward is the outcome of all its turns:
- ``untrainable``: trajectory meta ``trainable`` is false (an agent run broke the prefix invariant);
- ``draft``: T²PO resampled drafts (meta ``resampled_draft``), which are discarded by design;
- ``eval``: evaluation runs on held-out problems (meta ``eval``), never trained on;
- ``rerollout``: RTPO siblings and TCPO counterfactuals (meta ``rerollout``): the update that asked for
  them trained on them (``learner/rerollout.py``), so the live stream never takes them again;
- ``stale``: a trajectory with a turn produced by ``family@N`` with ``N < min_version`` (the base model,
  ``adapter=None``, counts as version 0); the learner service sets ``min_version`` to the version its
  trainer had ``max_staleness`` updates ago, counting updates it held during an A/B experiment;
- ``other_family``: a trajectory with a turn of another family's adapter (kept with ``include_other_families``);
- ``other_owner``: a trajectory made by an API key outside ``owners`` (when set: train only on the keys you trust);
- ``other_traffic``: a trajectory outside the learner's traffic filter (``TrafficFilter``: chat or agent, which agent,
  the model name the client asked for, the client's tag; :func:`traffic_match`);
- ``grammar_unrecorded``: a trajectory with a constrained turn recorded without its grammar's spec (older
  records): it cannot be scored under the distribution it was sampled from;
- ``no_reward``: a trajectory with no reward from a training source at all (NaN/None are never 0); a
  turn without a reward of its own in a rewarded trajectory is kept (its reward is 0 in the stream);
- ``other_source`` (in rewards): see above;
- ``no_tokens``: a turn with no output token with loss mask 1.
Samples without behaviour logprobs are kept (the trainer then uses its own detached logprobs, i.e.
ratio 1) and counted in ``missing_logprobs``.

Not here: advantages (``learner.advantages``), tensors or padding (``learner.trainer``), re-rollouts
(``learner.rerollout``).
Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import math
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from learner.config import SampleConfig, TrafficFilter
from learner.records import Reward, Trajectory, TurnCheck, context_sha256

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
    reward_source: str | None = None  # the source of ``reward`` (after the reward_sources precedence)
    trajectory_reward_source: str | None = None  # the source of ``trajectory_reward``
    state_key: str | None = None  # the environment's state when the turn was taken (GiGPO's anchor), if it reported one
    self_check: TurnCheck | None = field(default=None, compare=False)  # svr / svr_r1 turns: the stored self-check (learner.svr_rewards)

    @classmethod
    def of_turn(cls, turn: Any, *, trajectory_id: str, group_id: str, version: int, **fields: Any) -> Sample:
        """A sample of one recorded turn: its exact tokens, logprobs, mask, adapter, sampling temperature and time;
        ``version`` is the turn's adapter version (negative = unknown, stored as 0); ``fields`` set the rest."""
        return cls(
            turn_id=turn.turn_id,
            trajectory_id=trajectory_id,
            group_id=group_id,
            turn_index=turn.index,
            context_ids=list(turn.context_ids),
            output_ids=list(turn.output_ids),
            logprobs=list(turn.logprobs),
            loss_mask=list(turn.loss_mask),
            adapter=turn.adapter,
            adapter_version=max(version, 0),
            temperature=_temperature(turn.sampling),
            created_at=turn.created_at,
            **fields,
        )

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
    other_owner: int = 0  # made by an owner outside ``SampleConfig.owners``
    other_traffic: int = 0  # outside the learner's ``TrafficFilter``
    no_reward: int = 0
    no_tokens: int = 0
    stale_trajectories: int = 0
    other_source: int = 0  # rewards (not turns) dropped because their group is scored by a better-ranked source
    grammar_unrecorded: int = 0  # turns of trajectories with a constrained turn whose grammar was not recorded
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
        tag = trajectory.meta.get("group")  # a run's group tag (e.g. LEAP's single-turn probes): never mixed with the untagged runs
        return f"task:{trajectory.meta.get('agent') or '-'}:{task_key}" + (f"#{tag}" if isinstance(tag, str) and tag else "")
    if not trajectory.turns:
        return f"trajectory:{trajectory.trajectory_id}"
    first = trajectory.turns[0]
    if first.prefix_key:
        return f"prompt:{first.prefix_key}"
    return "ctx:" + hashlib.sha256(array("i", first.context_ids).tobytes()).hexdigest()[:32]


def request_meta(traj: Trajectory) -> dict[str, Any]:
    """The trajectory's meta plus what its first turn's request said: ``request_model`` (the name the client asked for)
    and ``tag`` (the client's ``metadata.tag``), when the meta does not already hold them."""
    meta = dict(traj.meta)
    if traj.turns:
        sampling = traj.turns[0].sampling
        for key, name in (("request_model", "model"), ("tag", "tag")):
            if sampling.get(name) is not None:
                meta.setdefault(key, sampling[name])
    return meta


def traffic_match(meta: dict[str, Any], filt: TrafficFilter | None) -> bool:
    """Whether a trajectory (its :func:`request_meta`) is in a learner's traffic: every set field of ``filt`` must pass."""
    if filt is None:
        return True
    agent = meta.get("agent")
    if agent:
        if filt.agents is not None and agent not in filt.agents:
            return False
    elif not filt.chat:
        return False
    if filt.models is not None and meta.get("request_model") not in filt.models:
        return False
    return filt.tags is None or meta.get("tag") in filt.tags


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def source_rank(source: str, patterns: Sequence[str]) -> int | None:
    """The precedence of a reward source under ``reward_sources``: the index of the first matching pattern, None if none matches."""
    return next((i for i, p in enumerate(patterns) if fnmatch.fnmatchcase(source, p)), None)


def _pick(rewards: Sequence[Reward], target: str, target_id: str, patterns: Sequence[str]) -> tuple[float, str, int] | None:
    """The newest reward on ``target_id`` from its best-ranked source: (value, source, rank); None without a matching one.

    A non-finite value (never stored; see ``Reward``) would count as no reward."""
    best: tuple[float, str, int] | None = None
    for r in rewards:  # stored order: oldest first, so a later reward of the same rank replaces an earlier one
        if r.target != target or r.target_id != target_id:
            continue
        rank = source_rank(r.source, patterns)
        value = _finite(r.value)
        if rank is None or value is None:
            continue
        if best is None or rank <= best[2]:
            best = (value, r.source, rank)
    return best


def _temperature(sampling: dict[str, Any]) -> float:
    t = sampling.get("temperature")
    return float(t) if isinstance(t, int | float) and t > 0 else 1.0  # greedy logprobs are of the raw logits


_UNRECORDED = {"kind": "?", "spec": ""}


def recorded_grammar(sampling: dict[str, Any]) -> dict[str, str] | None:
    """The decoding constraint a turn records in ``sampling["grammar"]``: ``{"kind", "spec"}``, None when it was free.

    Records written before the spec was kept hold only the kind; ``json_object`` needs no spec, any other kind
    comes back as ``{"kind": "?"}`` (unknown: such a turn cannot be scored as it was sampled)."""
    g = sampling.get("grammar")
    if not g:
        return None
    if isinstance(g, dict) and isinstance(g.get("kind"), str):
        return {"kind": g["kind"], "spec": str(g.get("spec") or "")}
    if g == "json_object":
        return {"kind": "json_object", "spec": ""}
    return dict(_UNRECORDED)


def collect_samples(
    store: _Store,
    *,
    family: str,
    cursor: Cursor,
    cfg: SampleConfig,
    current_version: int | None = None,
    min_version: int | None = None,
    now: float | None = None,
    traffic: TrafficFilter | None = None,
) -> SampleBatch:
    """Build the samples of every settled trajectory past ``cursor`` (module docstring: window, skips, groups, sources).

    Staleness: give ``min_version`` (the oldest fresh version; the learner service counts it in updates), or
    ``current_version`` (the family's latest version, 0 before the first) for ``current_version - max_staleness``.
    """
    if min_version is None:
        min_version = (current_version or 0) - cfg.max_staleness
    horizon = (time.time() if now is None else now) - cfg.settle_s
    counts = SkipCounts()
    seen: dict[str, None] = {}  # insertion-ordered set
    for row in store.iter_samples(since=cursor.since):  # discovery only: the trajectory is read whole below
        seen.setdefault(row["trajectory_id"], None)
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
        if cfg.owners is not None and traj.owner not in cfg.owners:
            counts.other_owner += len(traj.turns)
            continue
        if not traffic_match(request_meta(traj), traffic):
            counts.other_traffic += len(traj.turns)
            continue
        samples += trajectory_samples(traj, family=family, min_version=min_version, cfg=cfg, counts=counts)
    samples = resolve_sources(samples, cfg.reward_sources, counts)
    if cfg.max_trajectories is not None:
        samples = _cap_trajectories(samples, cfg.max_trajectories, counts)
    next_cursor = Cursor(since=max(cursor.since, horizon))
    log.info("collected samples", family=family, samples=len(samples), trajectories=len(seen), **counts.as_dict())
    return SampleBatch(samples=samples, counts=counts, cursor=next_cursor)


def trajectory_samples(traj: Trajectory, *, family: str, min_version: int, cfg: SampleConfig, counts: SkipCounts) -> list[Sample]:
    """The trainable turns of one trajectory, or none of them (skips counted in ``counts``); ``collect_samples``
    calls it per settled trajectory, the re-rollout code on the branches it just ran. Pass the result (with the
    rest of its groups) through :func:`resolve_sources` before estimating advantages."""
    n = len(traj.turns)
    if traj.meta.get("trainable", True) is False:
        counts.untrainable += n
        counts.untrainable_trajectories += 1
        return []
    versions: list[int] = []
    for turn in traj.turns:  # a trajectory is taken whole or not at all: its outcome is the outcome of all its turns
        fam, version = parse_adapter(turn.adapter)
        if fam is not None and fam != family and not cfg.include_other_families:
            counts.other_family += n
            return []
        if (fam is None or fam == family) and version < min_version:
            counts.stale += n
            counts.stale_trajectories += 1
            return []
        versions.append(version)
    grammars = [recorded_grammar(turn.sampling) for turn in traj.turns]
    if any(g is not None and g["kind"] == "?" for g in grammars):
        counts.grammar_unrecorded += n
        return []
    tid = traj.trajectory_id
    gid = group_id_of(traj)
    patterns = cfg.reward_sources
    traj_pick = _pick(traj.rewards, "trajectory", tid, patterns)
    turn_picks = [_pick(traj.rewards, "turn", turn.turn_id, patterns) for turn in traj.turns]
    if traj_pick is None and all(p is None for p in turn_picks):
        counts.no_reward += n
        return []
    state_keys = traj.meta.get("state_keys")
    out: list[Sample] = []
    for turn, version, grammar, pick in zip(traj.turns, versions, grammars, turn_picks, strict=True):
        if not any(turn.loss_mask):
            counts.no_tokens += 1
            continue
        if not turn.logprobs:
            counts.missing_logprobs += 1
        key = state_keys[turn.index] if isinstance(state_keys, list) and 0 <= turn.index < len(state_keys) else None
        out.append(
            Sample.of_turn(
                turn,
                trajectory_id=tid,
                group_id=gid,
                version=version,
                reward=pick[0] if pick else None,
                trajectory_reward=traj_pick[0] if traj_pick else None,
                meta=request_meta(traj),
                grammar=grammar,
                reward_source=pick[1] if pick else None,
                trajectory_reward_source=traj_pick[1] if traj_pick else None,
                state_key=key if isinstance(key, str) and key else None,
                self_check=turn.self_check,
            )
        )
    return out


def resolve_sources(samples: Sequence[Sample], patterns: Sequence[str], counts: SkipCounts) -> list[Sample]:
    """One reward source per group and target kind: every member is scored by the group's best-ranked source.

    A trajectory reward (or turn reward) from a lower-ranked source than the best one in its group is dropped
    (``counts.other_source``, in rewards); a trajectory left with no reward at all is dropped (``no_reward``)."""
    best_traj: dict[str, int] = {}
    best_turn: dict[str, int] = {}
    for s in samples:
        if s.trajectory_reward_source is not None:
            r = source_rank(s.trajectory_reward_source, patterns)
            if r is not None:
                best_traj[s.group_id] = min(best_traj.get(s.group_id, r), r)
        if s.reward_source is not None:
            r = source_rank(s.reward_source, patterns)
            if r is not None:
                best_turn[s.group_id] = min(best_turn.get(s.group_id, r), r)
    resolved: list[Sample] = []
    dropped_traj: set[str] = set()
    for s in samples:
        tr, tr_src, r, r_src = s.trajectory_reward, s.trajectory_reward_source, s.reward, s.reward_source
        if tr_src is not None and source_rank(tr_src, patterns) != best_traj.get(s.group_id):
            tr, tr_src = None, None
            dropped_traj.add(s.trajectory_id)
        if r_src is not None and source_rank(r_src, patterns) != best_turn.get(s.group_id):
            r, r_src = None, None
            counts.other_source += 1
        resolved.append(dataclasses.replace(s, trajectory_reward=tr, trajectory_reward_source=tr_src, reward=r, reward_source=r_src))
    counts.other_source += len(dropped_traj)
    rewarded = {s.trajectory_id for s in resolved if s.trajectory_reward is not None or s.reward is not None}
    out = [s for s in resolved if s.trajectory_id in rewarded]
    counts.no_reward += len(resolved) - len(out)
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
    contexts (the first turns of one problem's runs, RTPO siblings and their backbone turn) share it (RTPO's
    sibling key). ``state`` is GiGPO's anchor state: the environment's state key when the run recorded one
    (meta ``state_keys``, the observation without the history), else the exact context id.
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
            anchor=(anchor := context_sha256(s.context_ids)),
            state=f"state:{s.state_key}" if s.state_key else anchor,
        )
        for s in samples
    ]


def _opt_bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None
