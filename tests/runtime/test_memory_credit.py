"""Memory credit's rule (``runtime/memory_credit.py``) on a real SQLite store: a run's outcome credits the copilot rewrite
that wrote the memory it read, as the mean over the runs that read it, per source, within one owner.

The records are written by hand (a copilot rewrite ``R``: a one-turn trajectory of the copilot; player runs tagged
``memory_rewrite = R``), so every expected value is computed from the rule in the module docstring. The served path
(the copilot's tags, ``POST /v1/feedback``, an agent's verifier) is in ``tests/memory/test_learning_from_use.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from learner.config import SampleConfig, TrafficFilter
from learner.records import Reward, Turn
from learner.records.store import SqliteStore
from learner.samples import Cursor, collect_samples
from runtime.memory_credit import MEMORY_REWRITE, MEMORY_SCOPE, MEMORY_VERSION, credit_rewards, credit_run

A, B = "key-aaaa", "key-bbbb"


def turn(tid: str, traj: str, owner: str, *, index: int = 0, model: str = "player") -> Turn:
    return Turn(
        turn_id=tid,
        trajectory_id=traj,
        session_id="s",
        index=index,
        completion_id=f"c-{tid}",
        created_at=1_000.0 + index,
        model=model,
        context_ids=[1, 2, 3, len(tid), index],
        output_ids=[10, 11, 12],
        logprobs=[-0.5, -0.5, -0.5],
        loss_mask=[1, 1, 1],
        sampling={"temperature": 1.0},
        finish_reason="stop",
        owner=owner,
    )


def rewrite(store: SqliteStore, rid: str, owner: str = A) -> str:
    """A copilot rewrite: its own one-turn trajectory, as ``memory/copilot.py`` records it."""
    store.append_turns([turn(f"{rid}-t0", rid, owner, model="memopilot")])
    store.set_trajectory_meta(rid, {"agent": "memopilot", MEMORY_SCOPE: "user:alice", "turns": 1, "trainable": True})
    return rid


def run(store: SqliteStore, pid: str, rid: str | None, owner: str = A, turns: int = 1, tag: bool = True) -> list[str]:
    """A player run that read the memory ``rid`` wrote (tagged as the copilot tags it); its turn ids."""
    store.append_turns([turn(f"{pid}-t{i}", pid, owner, index=i) for i in range(turns)])
    meta: dict[str, Any] = {"agent": "mem-agent"}
    if tag and rid is not None:
        meta |= {MEMORY_SCOPE: "user:alice", MEMORY_VERSION: 1, MEMORY_REWRITE: rid}
    store.set_trajectory_meta(pid, meta)
    return [f"{pid}-t{i}" for i in range(turns)]


def rate(store: SqliteStore, target: str, target_id: str, value: float, source: str = "feedback", owner: str = A) -> Reward:
    saved, _ = store.add_reward(Reward(target=target, target_id=target_id, value=value, source=source, owner=owner))  # type: ignore[arg-type]
    return saved


def derived(store: SqliteStore, rid: str) -> list[tuple[str, float]]:
    traj = store.get_trajectory(rid)
    assert traj is not None
    return [(r.source, r.value) for r in traj.rewards if r.target == "trajectory"]


@pytest.fixture
def store(tmp_path: Path):
    s = SqliteStore(tmp_path / "interactions.db")
    yield s
    s.close()


def test_a_rated_run_credits_the_rewrite_then_the_mean_over_the_runs_that_used_it(store):
    r = rewrite(store, "traj-r")
    run(store, "traj-p1", r)
    made = credit_rewards(store, [rate(store, "trajectory", "traj-p1", 0.8)])
    assert [(x.source, x.value, x.owner) for x in made] == [("memory:feedback", 0.8, A)]
    # a second run of the same memory, rated before its tag landed (an agent's verifier rates during the run): the tag
    # credits it, and the rewrite's newest reward is the mean (0.8 + 0.2) / 2 = 0.5
    run(store, "traj-p2", r, tag=False)
    rate(store, "trajectory", "traj-p2", 0.2)
    store.set_trajectory_meta("traj-p2", {MEMORY_SCOPE: "user:alice", MEMORY_VERSION: 1, MEMORY_REWRITE: r})
    assert [x.value for x in credit_run(store, "traj-p2")] == [pytest.approx(0.5)]
    assert derived(store, r) == [("memory:feedback", 0.8), ("memory:feedback", pytest.approx(0.5))]
    # nothing changed: nothing new is stored (the same reward seen twice, a tag repeated)
    assert credit_run(store, "traj-p2") == [] and len(derived(store, r)) == 2


def test_a_runs_outcome_per_source_turn_ratings_process_scores_and_derived_rewards(store):
    r = rewrite(store, "traj-r")
    t0, t1 = run(store, "traj-p1", r, turns=2)
    # only turn ratings: the run's outcome is the mean of its rated turns' newest ratings, (0 + 0.5) / 2 = 0.25
    rate(store, "turn", t0, 0.0)
    rate(store, "turn", t1, 1.0)
    made = credit_rewards(store, [rate(store, "turn", t1, 0.5)])
    assert [(x.source, x.value) for x in made] == [("memory:feedback", 0.25)]
    # a verifier's outcome on a second run is its own derived source; its process scores are not outcomes
    (u0,) = run(store, "traj-p2", r)
    made = credit_rewards(store, [rate(store, "turn", u0, 0.3, "verifier:calc:process"), rate(store, "trajectory", "traj-p2", 1.0, "verifier:calc")])
    assert [(x.source, x.value) for x in made] == [("memory:verifier:calc", 1.0)]
    # a trajectory reward is the run's outcome, whatever its turns got from the same source: the mean is (0.25 + 0) / 2
    rate(store, "turn", u0, 1.0)
    made = credit_rewards(store, [rate(store, "trajectory", "traj-p2", 0.0)])
    assert [(x.source, x.value) for x in made] == [("memory:feedback", 0.125)]
    # a derived reward is never derived again (a rewrite's own rewards rate no run)
    assert credit_rewards(store, made) == []


def test_another_owners_reward_never_reaches_the_rewrite(store):
    r = rewrite(store, "traj-r", owner=A)
    run(store, "traj-b", r, owner=B)  # B's run names A's rewrite (a tag B cannot set: the runtime writes meta)
    assert credit_rewards(store, [rate(store, "trajectory", "traj-b", 1.0, owner=B)]) == []
    assert credit_run(store, "traj-b") == [] and derived(store, r) == []
    run(store, "traj-a", r, owner=A)
    made = credit_rewards(store, [rate(store, "trajectory", "traj-a", 0.0)])
    assert [(x.value, x.owner) for x in made] == [(0.0, A)]  # B's 1.0 is not in A's mean


def test_a_rewrite_whose_memory_was_deleted_gets_nothing(store):
    r = rewrite(store, "traj-r")
    run(store, "traj-p1", r)
    # DELETE /v1/memory/{scope} deletes the copilot's trajectories of the document (runtime/admin/memory.py); a run that
    # read it and outlived the deletion (its tag landed after) is rated later: no reward, no error, the feedback stands
    store.delete_trajectories([r])
    saved = rate(store, "trajectory", "traj-p1", 1.0)
    assert credit_rewards(store, [saved]) == [] and credit_run(store, "traj-p1") == []
    assert store.get_trajectory(r) is None and [x.value for x in store.get_trajectory("traj-p1").rewards] == [1.0]


def test_the_copilot_job_trains_rated_rewrites_and_skips_unused_ones_as_no_reward(store):
    """The learner's ordinary sample path with the copilot job's filter and sources (docs/agents.md)."""
    r1, r2 = rewrite(store, "traj-r1"), rewrite(store, "traj-r2")  # r2's memory was read by no rated run
    run(store, "traj-p1", r1)
    run(store, "traj-p2", r2)
    credit_rewards(store, [rate(store, "trajectory", "traj-p1", 1.0), rate(store, "trajectory", "traj-p1", 0.0, "verifier:calc")])
    cfg = SampleConfig(settle_s=0, reward_sources=["memory:verifier:*", "memory:*"])
    batch = collect_samples(
        store, family="memopilot", cursor=Cursor(), cfg=cfg, current_version=0, now=2_000.0, traffic=TrafficFilter(chat=False, agents=["memopilot"])
    )
    assert [(s.trajectory_id, s.trajectory_reward, s.trajectory_reward_source) for s in batch.samples] == [("traj-r1", 0.0, "memory:verifier:calc")]
    assert batch.counts.no_reward == 1 and batch.counts.other_traffic == 2  # r2's turn; the two player runs
