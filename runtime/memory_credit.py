"""Memory credit: the outcome of the runs that used a memory, as a reward on the copilot rewrite that wrote it.

MemoPilot's copilot (``memory/copilot.py``) records each rewrite as a one-turn trajectory of its own, and tags every
player run whose prompt held the memory with the version it read and the rewrite that wrote it (trajectory meta
``memory_scope``, ``memory_version`` and ``memory_rewrite``: the copilot trajectory's id). This module turns the
player runs' rewards into a reward on that rewrite, as the paper's turn-wise reward does (the copilot's action at turn
``t`` is rated by the rounds played with the memory it wrote), so the learner trains the copilot's family like any other
traffic: through the store, with the ordinary sample path, and without knowing about memory.

**The rule.** For a rewrite ``R`` and a player reward source ``S``:

- a run's outcome under ``S`` is its newest trajectory reward of ``S``; without one, the mean of its turns' newest
  rewards of ``S`` (each rated turn counts once); a run with neither has no outcome under ``S``;
- ``R``'s reward of source ``memory:<S>`` is the mean outcome under ``S`` of the runs that used ``R``'s memory (the
  owner's trajectories tagged ``memory_rewrite = R``; the newest ``MAX_RUNS`` of them), stored on ``R``'s trajectory
  by its owner. It is recomputed whenever one of those runs gets a reward of ``S`` or is tagged, and stored again only
  when the mean changed; the learner uses the newest (``learner/samples.py``), so it is the mean over the runs rated
  so far. It is bounded by the runs' own rewards: the mean lies between their smallest and largest outcome.
- One derived source per player source, so the learner's source precedence still applies (``[samples]
  reward_sources = ["memory:verifier:*", "memory:*"]`` ranks a verifier's outcome above users' feedback). An agent
  task's per-turn process scores (``<S>:process``) are part of the run, not an outcome, and derived rewards are never
  derived again.
- A memory used by no rewarded run gives its rewrite no reward (the learner skips it as ``no_reward``). A rewrite
  that is gone (its memory deleted: ``DELETE /v1/memory/{scope}`` deletes the copilot's trajectories too) gets
  nothing. Only the run's owner's runs count and only the owner's rewrite is rewarded (the store refuses a reward on
  another owner's trajectory): one key's outcomes never reach another key's copilot.

**Where it runs.** After the runtime stores a reward (``POST /v1/feedback`` and ``/admin/feedback`` in
``runtime/admin/store.py``; an agent's own verifier and environment rewards through
``runtime.agent_api.LocalRuntimeClient.reward``) and after a run is tagged with its memory
(``LocalRuntimeClient.annotate``): the tag comes after the run, so a verifier's reward stored during the run is
credited then. Both orders end with the same reward. Failures are logged and never fail the reward or the run.
Recomputations in one process are serialized (a lock), so the newest stored mean saw every reward stored before it;
two runtimes on one PostgreSQL store can each store a mean, the later one computed from what it saw.

Cost: a reward on a tagged run reads its trajectory, lists the owner's runs of that rewrite (a scan of the owner's
trajectory metadata, as memory deletion does) and reads each. Not here: the tags (``memory/copilot.py``), what the
learner makes of the rewards (``learner/samples.py``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from typing import Protocol

from learner.records import PROCESS_SUFFIX, Reward, Trajectory, Turn, UnknownTarget
from runtime.recorder import Recorder

log = logging.getLogger(__name__)

MEMORY_SCOPE = "memory_scope"  # trajectory meta: the memory document the run's prompt held (deleting it deletes the run)
MEMORY_VERSION = "memory_version"  # trajectory meta: the document's version the run read
MEMORY_REWRITE = "memory_rewrite"  # trajectory meta: the copilot trajectory whose rewrite wrote that version
CREDIT_PREFIX = "memory:"  # the source of a derived reward: memory:<the player reward's source>
MAX_RUNS = 256  # the newest runs of one rewrite that its mean covers

_lock = threading.Lock()


class CreditStore(Protocol):
    """What memory credit needs from the interaction store (``runtime.recorder.InteractionStore`` has it)."""

    def add_reward(self, reward: Reward) -> tuple[Reward, bool]: ...
    def get_turn(self, turn_id: str) -> Turn | None: ...
    def get_trajectory(self, trajectory_id: str) -> Trajectory | None: ...
    def trajectories_with_meta(self, owner: str, key: str, value: str) -> list[str]: ...


def creditable(source: str) -> bool:
    """Whether a reward of ``source`` rates a run's outcome (not a derived reward, not a process score)."""
    return not source.lower().startswith(CREDIT_PREFIX) and not source.endswith(PROCESS_SUFFIX)


def run_outcome(run: Trajectory, source: str) -> float | None:
    """The run's outcome under ``source`` (module docstring): its newest trajectory reward, else the mean of its
    rated turns' newest rewards; None when it has no reward of ``source``."""
    outcome: float | None = None
    per_turn: dict[str, float] = {}
    for r in run.rewards:  # oldest first: a later reward replaces an earlier one
        if r.source != source or not math.isfinite(r.value):
            continue
        if r.target == "trajectory":
            outcome = r.value
        else:
            per_turn[r.target_id] = r.value
    if outcome is not None:
        return outcome
    return sum(per_turn.values()) / len(per_turn) if per_turn else None


def rewrite_of(run: Trajectory) -> str | None:
    """The copilot trajectory whose rewrite wrote the memory ``run`` read, from its tag; None for a run without one."""
    rewrite = run.meta.get(MEMORY_REWRITE)
    return rewrite if isinstance(rewrite, str) and rewrite else None


def credit_rewrite(store: CreditStore, owner: str, rewrite_id: str, source: str) -> Reward | None:
    """Recompute the reward of ``owner``'s rewrite ``rewrite_id`` from its runs' outcomes under ``source``; the reward
    stored, or None (no rated run, the mean unchanged, the rewrite gone or not ``owner``'s)."""
    if not creditable(source):
        return None
    derived = CREDIT_PREFIX + source
    with _lock:
        runs = store.trajectories_with_meta(owner, MEMORY_REWRITE, rewrite_id)[-MAX_RUNS:]
        outcomes: list[float] = []
        for tid in runs:
            run = store.get_trajectory(tid)
            if run is not None and run.owner == owner and (o := run_outcome(run, source)) is not None:
                outcomes.append(o)
        if not outcomes:
            return None
        value = sum(outcomes) / len(outcomes)
        rewrite = store.get_trajectory(rewrite_id)
        if rewrite is None or rewrite.owner != owner:
            return None
        last = [r.value for r in rewrite.rewards if r.target == "trajectory" and r.source == derived]
        if last and math.isclose(last[-1], value, rel_tol=0.0, abs_tol=1e-12):
            return None
        reward = Reward(
            target="trajectory",
            target_id=rewrite_id,
            value=value,
            source=derived,
            owner=owner,
            comment=f"mean {source} outcome of {len(outcomes)} run(s) that used the memory this rewrite wrote",
        )
        try:
            saved, _ = store.add_reward(reward)
        except UnknownTarget:  # deleted meanwhile
            return None
    return saved


def credit_rewards(store: CreditStore, rewards: Sequence[Reward]) -> list[Reward]:
    """Credit the rewrites behind the runs ``rewards`` (just stored) rated; the derived rewards stored."""
    out: list[Reward] = []
    done: set[tuple[str, str]] = set()
    for r in rewards:
        if not creditable(r.source):
            continue
        tid: str | None = r.target_id
        if r.target == "turn":
            turn = store.get_turn(r.target_id)
            tid = turn.trajectory_id if turn is not None else None
        if tid is None or (tid, r.source) in done:
            continue
        done.add((tid, r.source))
        run = store.get_trajectory(tid)
        rewrite = rewrite_of(run) if run is not None else None
        if run is not None and rewrite is not None and (saved := credit_rewrite(store, run.owner, rewrite, r.source)) is not None:
            out.append(saved)
    return out


def credit_run(store: CreditStore, trajectory_id: str) -> list[Reward]:
    """Credit the rewrite behind a just-tagged run with every outcome it already has; the derived rewards stored."""
    run = store.get_trajectory(trajectory_id)
    rewrite = rewrite_of(run) if run is not None else None
    if run is None or rewrite is None:
        return []
    sources = sorted({r.source for r in run.rewards if creditable(r.source)})
    return [saved for s in sources if (saved := credit_rewrite(store, run.owner, rewrite, s)) is not None]


async def after_rewards(recorder: Recorder, rewards: Sequence[Reward]) -> None:
    """:func:`credit_rewards` off the event loop (the recorder's reader pool); never raises."""
    if not any(creditable(r.source) for r in rewards):
        return
    try:
        await recorder.call(credit_rewards, recorder.store, list(rewards))
    except Exception:  # the reward itself is stored: the rewrite's credit waits for the next one
        log.exception("memory credit failed after %d reward(s)", len(rewards))


async def after_tag(recorder: Recorder, trajectory_id: str) -> None:
    """:func:`credit_run` off the event loop; never raises."""
    try:
        await recorder.call(credit_run, recorder.store, trajectory_id)
    except Exception:
        log.exception("memory credit failed for run %s", trajectory_id)
