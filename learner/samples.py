"""Per-turn training samples and groups, read from the interaction store.

    batch = collect_samples(store, family="tools-agent", min_version=1, cursor=Cursor(), cfg=SampleConfig())
    groups = make_groups(batch.samples)          # one Group per task key, for the advantage estimators
    turn_samples = [s.to_turn_sample() for s in batch.samples]  # the estimators' rows (learner.advantages.TurnSample)
    ... train ...; keep batch.cursor (it goes into the trainer's checkpoint) for the next call

A **sample** is one recorded turn exactly as the engine saw it: context ids, output ids, behaviour
logprobs and loss mask (never re-tokenized), the grammar it was decoded under (``sampling["grammar"]``,
which the trainer re-applies), its turn index, trajectory id, group id, the environment's state key
(meta ``state_keys``, for GiGPO) and rewards.

**Rewards and their sources** (``SampleConfig.reward_sources``, patterns in precedence order; default
``verifier:*``, ``judge:*``, ``hook:*``, ``feedback``, ``*``). For each turn and each trajectory the reward used is
the newest one of the first pattern any of its rewards match; a source matching no pattern never
trains. Then, within a group, every member is scored by the group's best source, ranked **once across turn
and trajectory rewards** (:func:`resolve_sources`): a reward from a lower-ranked source is dropped
(``other_source``), so a verifier's 0/1 and a user's thumbs are never normalised against each other, and a
click on a turn never adds to (or cancels) a verifier's outcome; an agent task's own process scores
(``<S>:process`` beside an outcome of source ``<S>``) stay with that outcome.
A sample keeps the turn reward and the trajectory (outcome) reward separately; ``learner.advantages``
combines them by one rule (its docstring: the reward stream).

**Multi-turn conversations** (a stitched chat, a Responses ``previous_response_id`` chain, an agent run). A
reward on the trajectory rates the whole conversation: every turn is kept. Without one, the conversation is
judged up to its last rated turn: the unrated turns before it are kept with reward 0 in the stream (each one's
return, and the trajectory's score, is the later rating: the reply the user rated answered a context those
turns wrote), the turns after it are left out (``after_last_reward``: nobody judged them, and a later reply
cannot have caused an earlier rating). A regenerated or edited turn starts its own trajectory
(``parent_turn_id``), judged by its own rewards; each of ``n`` choices is a trajectory of its own.

**Owners** (``SampleConfig.max_owner_share``, default 0.5): no API key makes up more than that share of one
update's trajectories (with K keys present, ``max(share, 1/K)``); a key over it keeps its oldest ones
(``owner_share``). The learner's own runs (owner ``admin``) are not a tenant and are never cut.

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
to ``prompt:<owner>:<prefix_key>`` of the trajectory's first turn (the hash of the messages it answered, so
the same opening request of one API key forms a group; two keys' never share one), or, if that is empty,
``ctx:<owner>:<sha256 of its context ids>``.
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
- ``sampling_penalties``: a trajectory with a turn sampled under OpenAI's ``presence_penalty``,
  ``frequency_penalty`` or a ``logit_bias`` (recorded in the turn's ``sampling``; :func:`sampled_with_penalties`):
  its behaviour logprobs are of the penalized distribution (``runtime/engine.py``), which the trainer's
  ``logits / T`` does not reproduce, so its importance ratios would be wrong;
- ``no_reward``: a trajectory with no reward from a training source at all (NaN/None are never 0); a
  turn without a reward of its own in a rewarded trajectory is kept (its reward is 0 in the stream);
- ``other_source`` (in rewards): see above;
- ``after_last_reward``: a turn after the last rated turn of a trajectory without an outcome (above);
- ``owner_share``: a trajectory over its owner's share (above);
- ``quarantined``: a trajectory of a batch that failed the learner twice (``learner/quarantine.py``);
- ``no_tokens``: a turn with no output token with loss mask 1.
Samples without behaviour logprobs are kept (the trainer then uses its own detached logprobs, i.e.
ratio 1) and counted in ``missing_logprobs``.

Not here: advantages (``learner.advantages``), tensors or padding (``learner.trainer``), re-rollouts
(``learner.rerollout``).
Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from array import array
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import structlog

from learner.advantages import TurnSample
from learner.config import SampleConfig, TrafficFilter
from learner.records import ADMIN_OWNER, PROCESS_SUFFIX, Reward, Trajectory, TurnCheck, context_sha256, owner_quota, source_rank

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
    owner: str | None = None  # the API key identity that made the trajectory (``Trajectory.owner``)

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

    def to_turn_sample(self) -> TurnSample:
        """This turn as the estimators see it (``learner.advantages.TurnSample``).

        ``correct`` and ``score`` (LEAP's rank) are the turn's own result when the trajectory recorded one for its index
        (meta ``turn_correct``: bool, and ``turn_scores``: number, lists indexed by turn index like ``state_keys``;
        ``result_of="turn"``), else the trajectory's final outcome (meta ``correct`` / ``score``, ``result_of="trajectory"``),
        which rank's ``per="turn"`` leaves out;
        ``anchor`` is the exact context's id (:func:`learner.records.context_sha256`): turns with byte-identical
        contexts (the first turns of one problem's runs, RTPO siblings and their backbone turn) share it (RTPO's
        sibling key). ``state`` is GiGPO's anchor state: the environment's state key when the run recorded one
        (meta ``state_keys``, the observation without the history), else the exact context id.
        """
        own = _opt_bool(per_turn(self.meta, "turn_correct", self.turn_index))
        anchor = context_sha256(self.context_ids)
        return TurnSample(
            trajectory_id=self.trajectory_id,
            group_id=self.group_id,
            turn_index=self.turn_index,
            reward=self.reward,
            trajectory_reward=self.trajectory_reward,
            n_tokens=self.n_tokens,
            correct=own if own is not None else _opt_bool(self.meta.get("correct")),
            score=_number(per_turn(self.meta, "turn_scores", self.turn_index)) if own is not None else _number(self.meta.get("score")),
            result_of="turn" if own is not None else "trajectory",
            anchor=anchor,
            state=f"state:{self.state_key}" if self.state_key else anchor,
        )


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
    sampling_penalties: int = 0  # turns of trajectories with a turn sampled under penalties or a logit bias
    missing_logprobs: int = 0  # kept, but trained with ratio 1
    deferred_trajectories: int = 0  # still within settle_s; a later call takes them
    surplus: int = 0  # beyond max_trajectories: the smallest and oldest groups left out
    after_last_reward: int = 0  # turns after the last rated turn of a trajectory without an outcome: never judged
    owner_share: int = 0  # turns of trajectories over their owner's share (``SampleConfig.max_owner_share``)
    quarantined: int = 0  # turns of trajectories the learner quarantined (a batch that failed it twice)

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


PART_SEP = "#"  # a sample's trajectory id "<stored id>#<part>" names a part of a stored trajectory trained as its own one


def stored_trajectory_id(trajectory_id: str) -> str:
    """The stored trajectory a sample's ``trajectory_id`` belongs to: itself, or for a part of one (group completion
    trains a multi-turn conversation's earlier turns apart from its completed turn, ``learner.group_completion``) the
    id before :data:`PART_SEP` (the runtime's ids never hold it)."""
    return trajectory_id.partition(PART_SEP)[0]


def group_id_of(trajectory: Trajectory) -> str:
    """The group id of a trajectory (see the module docstring for the rule and its fallbacks)."""
    task_key = trajectory.meta.get("task_key")
    if task_key:
        tag = trajectory.meta.get("group")  # a run's group tag (e.g. LEAP's single-turn probes): never mixed with the untagged runs
        return f"task:{trajectory.meta.get('agent') or '-'}:{task_key}" + (f"#{tag}" if isinstance(tag, str) and tag else "")
    if not trajectory.turns:
        return f"trajectory:{trajectory.trajectory_id}"
    first = trajectory.turns[0]
    # chat groups are per owner: one key's ratings of the same opening messages (a shared template, or copied on purpose)
    # must not move another key's group mean and spread, and so the sign of its advantages
    if first.prefix_key:
        return f"prompt:{trajectory.owner}:{first.prefix_key}"
    return f"ctx:{trajectory.owner}:" + hashlib.sha256(array("i", first.context_ids).tobytes()).hexdigest()[:32]


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


def sampled_with_penalties(sampling: dict[str, Any]) -> bool:
    """Whether a turn was sampled under a presence or frequency penalty or a non-zero logit bias (as
    ``runtime/generation.py`` records them in ``sampling``): its logprobs are not of the model's ``logits / T``."""
    bias = sampling.get("logit_bias")
    biased = isinstance(bias, dict) and any(bias.values())
    return bool(sampling.get("presence_penalty") or sampling.get("frequency_penalty") or biased)


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
    exclude: Collection[str] = (),
) -> SampleBatch:
    """Build the samples of every settled trajectory past ``cursor`` (module docstring: window, skips, groups, sources).

    Staleness: give ``min_version`` (the oldest fresh version; the learner service counts it in updates), or
    ``current_version`` (the family's latest version, 0 before the first) for ``current_version - max_staleness``.
    ``exclude``: trajectory ids never to take (the learner's quarantine, ``learner/quarantine.py``), counted as ``quarantined``.
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
        if tid in exclude:
            counts.quarantined += len(traj.turns)
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
    samples = bound_owner_share(samples, cfg.max_owner_share, counts)
    if cfg.max_trajectories is not None:
        samples = _cap_trajectories(samples, cfg.max_trajectories, counts)
    next_cursor = Cursor(since=max(cursor.since, horizon))
    log.info("collected samples", family=family, samples=len(samples), trajectories=len(seen), **counts.as_dict())
    return SampleBatch(samples=samples, counts=counts, cursor=next_cursor)


def per_turn(meta: dict[str, Any], key: str, index: int) -> Any:
    """Turn ``index``'s entry of a per-turn list in a trajectory's meta (``state_keys``, ``turn_correct``, ``turn_scores``);
    None when the meta has no such list or it is too short."""
    v = meta.get(key)
    return v[index] if isinstance(v, list) and 0 <= index < len(v) else None


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
    if any(sampled_with_penalties(turn.sampling) for turn in traj.turns):
        counts.sampling_penalties += n
        return []
    tid = traj.trajectory_id
    gid = group_id_of(traj)
    patterns = cfg.reward_sources
    traj_pick = _pick(traj.rewards, "trajectory", tid, patterns)
    turn_picks = [_pick(traj.rewards, "turn", turn.turn_id, patterns) for turn in traj.turns]
    if traj_pick is None and all(p is None for p in turn_picks):
        counts.no_reward += n
        return []
    out: list[Sample] = []
    for turn, version, grammar, pick in zip(traj.turns, versions, grammars, turn_picks, strict=True):
        if not any(turn.loss_mask):
            counts.no_tokens += 1
            continue
        if not turn.logprobs:
            counts.missing_logprobs += 1
        key = per_turn(traj.meta, "state_keys", turn.index)
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
                owner=traj.owner,
            )
        )
    return out


def resolve_sources(samples: Sequence[Sample], patterns: Sequence[str], counts: SkipCounts) -> list[Sample]:
    """One reward source per group: every member is scored by the group's best-ranked source, ranked once across its
    turn rewards and trajectory rewards; then every trajectory is cut to its judged turns.

    * A reward (turn or trajectory) of a lower rank than the group's best is dropped (``counts.other_source``, in
      rewards), so a user's click never adds to or cancels a verifier's outcome, and a verifier's 0/1 is never
      normalised against a thumbs. The one exception is an agent task's own process scores (turn rewards of source
      ``<S>:process`` beside a kept outcome of source ``<S>``): they are part of that outcome's reward stream, so they
      neither compete for the group's rank nor are dropped by it.
    * A trajectory without a trajectory reward is judged up to its last rewarded turn: the turns after it were never
      rated and could not have caused an earlier rating, so they are left out (``counts.after_last_reward``, in turns).
      The unrated turns before a rated one stay (reward 0 in the stream: they share the later rating through the
      return or the trajectory score; ``learner/advantages.py``).
    * A trajectory left with no reward at all is dropped (``no_reward``)."""

    def is_process(s: Sample) -> bool:
        return (
            s.reward_source is not None and s.trajectory_reward_source is not None and s.reward_source == s.trajectory_reward_source + PROCESS_SUFFIX
        )

    best: dict[str, int] = {}
    for s in samples:
        for src in (s.trajectory_reward_source, None if is_process(s) else s.reward_source):
            rank = source_rank(src, patterns) if src is not None else None
            if rank is not None:
                best[s.group_id] = min(best.get(s.group_id, rank), rank)
    resolved: list[Sample] = []
    dropped_traj: set[str] = set()
    for s in samples:
        tr, tr_src, r, r_src = s.trajectory_reward, s.trajectory_reward_source, s.reward, s.reward_source
        process = is_process(s)
        if tr_src is not None and source_rank(tr_src, patterns) != best.get(s.group_id):
            tr, tr_src = None, None
            dropped_traj.add(s.trajectory_id)
        if r_src is not None and not (process and tr_src is not None) and source_rank(r_src, patterns) != best.get(s.group_id):
            r, r_src = None, None
            counts.other_source += 1
        resolved.append(dataclasses.replace(s, trajectory_reward=tr, trajectory_reward_source=tr_src, reward=r, reward_source=r_src))
    counts.other_source += len(dropped_traj)
    last_judged: dict[str, float] = {}  # trajectory -> the last turn index it is judged to (inf: it has an outcome)
    for s in resolved:
        if s.trajectory_reward is not None:
            last_judged[s.trajectory_id] = math.inf
        elif s.reward is not None:
            last_judged[s.trajectory_id] = max(last_judged.get(s.trajectory_id, -1.0), float(s.turn_index))
    out: list[Sample] = []
    for s in resolved:
        if s.trajectory_id not in last_judged:
            counts.no_reward += 1
        elif s.turn_index > last_judged[s.trajectory_id]:
            counts.after_last_reward += 1
        else:
            out.append(s)
    return out


def bound_owner_share(samples: Sequence[Sample], max_share: float, counts: SkipCounts) -> list[Sample]:
    """No API key makes up more than ``max_share`` of the trajectories (``learner.records.owner_quota``: with K owners
    the bound is ``max(max_share, 1/K)``); an owner over it keeps its oldest trajectories (by last turn), the rest are
    skipped as ``owner_share`` (in turns). The learner's own runs (owner ``admin``) are not a tenant: never cut, not
    counted among the owners."""
    if max_share >= 1.0:
        return list(samples)
    last: dict[str, tuple[float, str]] = {}  # trajectory -> (its last turn's time, owner)
    for s in samples:
        if s.owner == ADMIN_OWNER:
            continue
        t, _ = last.get(s.trajectory_id, (-math.inf, ""))
        last[s.trajectory_id] = (max(t, s.created_at), s.owner or "")
    by_owner: dict[str, list[tuple[float, str]]] = {}
    for tid, (t, owner) in last.items():
        by_owner.setdefault(owner, []).append((t, tid))
    quota = owner_quota({o: len(ts) for o, ts in by_owner.items()}, max_share)
    dropped = {tid for o, ts in by_owner.items() for _, tid in sorted(ts)[quota[o] :]}
    out = [s for s in samples if s.trajectory_id not in dropped]
    counts.owner_share += len(samples) - len(out)
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


def _opt_bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _number(v: Any) -> float | None:
    return _finite(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
