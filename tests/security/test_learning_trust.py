"""What learning trusts: the learner can train on chosen owners only, and an A/B experiment without an explicit
metric counts only the runtime's own evaluators (``verifier:*``, ``judge:*``), never a client's feedback."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.config import SampleConfig
from learner.records import Reward, Turn
from learner.records.store import SqliteStore
from learner.samples import Cursor, collect_samples


def _turn(tid: str, traj: str, owner: str, adapter: str | None = "fam@1", created_at: float = 1_000.0) -> Turn:
    return Turn(
        turn_id=tid,
        trajectory_id=traj,
        session_id="s",
        index=0,
        completion_id=f"c-{tid}",
        created_at=created_at,
        model="tiny",
        adapter=adapter,
        context_ids=[1, 2, 3],
        output_ids=[4, 5],
        logprobs=[-0.5, -0.5],
        loss_mask=[1, 1],
        finish_reason="stop",
        owner=owner,
    )


@pytest.fixture
def store(tmp_path: Path):
    s = SqliteStore(tmp_path / "interactions.db")
    yield s
    s.close()


def test_the_learner_trains_only_on_the_owners_it_trusts(store: SqliteStore) -> None:
    for owner in ("key-trusted", "key-stranger", "admin"):
        store.append_turns([_turn(f"t-{owner}", f"tr-{owner}", owner)])
        store.add_reward(Reward(target="trajectory", target_id=f"tr-{owner}", value=1.0, source="verifier:x", owner=owner))

    def trained(cfg: SampleConfig) -> tuple[set[str], int]:
        batch = collect_samples(store, family="fam", current_version=1, cursor=Cursor(), cfg=cfg, now=10_000.0)
        return {s.trajectory_id for s in batch.samples}, batch.counts.other_owner

    assert trained(SampleConfig(settle_s=0)) == ({"tr-key-trusted", "tr-key-stranger", "tr-admin"}, 0)
    assert trained(SampleConfig(settle_s=0, owners=("key-trusted", "admin"))) == ({"tr-key-trusted", "tr-admin"}, 1)


def test_an_experiment_counts_only_trusted_sources_by_default(store: SqliteStore) -> None:
    for i in range(4):
        store.append_turns([_turn(f"t{i}", f"tr{i}", "key-a", adapter="fam@2", created_at=2_000.0 + i)])
    store.add_reward(Reward(target="trajectory", target_id="tr0", value=1.0, source="verifier:calc", owner="key-a"))
    store.add_reward(Reward(target="turn", target_id="t1", value=0.0, source="judge:helpful", owner="key-a"))
    store.add_reward(Reward(target="turn", target_id="t2", value=100.0, source="feedback", owner="key-a"))  # a client's word
    store.add_reward(Reward(target="turn", target_id="t3", value=-5.0, source="thumbs", owner="key-a"))
    trusted = store.arm_observations("fam@2", 0.0, None)["rewards"]
    assert sorted(trusted) == [0.0, 1.0]
    assert sorted(store.arm_observations("fam@2", 0.0, None, trusted_only=False)["rewards"]) == [-5.0, 0.0, 1.0, 100.0]
    assert store.arm_observations("fam@2", 0.0, "feedback")["rewards"] == [100.0]  # an explicit metric is the admin's choice


def test_experiment_config_says_which_sources_count() -> None:
    from runtime.adapters.experiments import ExperimentConfig

    cfg = ExperimentConfig(name="e", family="fam", arms=[{"adapter": "fam@1"}, {"adapter": "fam@2"}])
    assert cfg.metric is None and cfg.sources == "trusted"
