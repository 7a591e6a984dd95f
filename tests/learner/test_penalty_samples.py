"""Turns sampled under presence/frequency penalties or a logit bias: their behaviour logprobs are of the penalized
distribution, which the trainer's ``logits / T`` cannot reproduce, so ``collect_samples`` leaves their trajectories
out (counted as ``sampling_penalties``, with its reason in words) and the parity probe never picks them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from learner.config import SampleConfig
from learner.parity import PROBE_FILE, probe_turns
from learner.reasons import REASONS, unused_reasons
from learner.records import Reward, Turn
from learner.records.store import SqliteStore
from learner.samples import Cursor, Sample, collect_samples, sampled_with_penalties

NOW = 10_000.0
CFG = SampleConfig(max_staleness=2, settle_s=100.0)


def sampling(temperature: float = 0.7, **penalties: Any) -> dict[str, Any]:
    """A turn's ``sampling`` as ``runtime/generation.py`` records it (penalties and bias included, off by default)."""
    off = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None}
    return {"temperature": temperature, "top_p": 1.0, "grammar": None, **off} | penalties


def add(store: SqliteStore, traj: str, samplings: list[dict[str, Any]], t0: float = 1_000.0) -> list[Turn]:
    turns = [
        Turn(
            turn_id=f"{traj}-t{i}",
            trajectory_id=traj,
            session_id="s",
            index=i,
            completion_id=f"c-{traj}-{i}",
            created_at=t0 + i,
            model="tiny",
            adapter="fam@3",
            context_ids=[1, 2, 3 + i],
            output_ids=[10, 11, 12],
            logprobs=[-0.5] * 3,
            loss_mask=[1] * 3,
            sampling=s,
            finish_reason="stop",
        )
        for i, s in enumerate(samplings)
    ]
    store.append_turns(turns)
    store.add_reward(Reward(target="trajectory", target_id=traj, value=1.0, source="verifier:x"))
    return turns


@pytest.fixture
def store(tmp_path: Path):
    s = SqliteStore(tmp_path / "interactions.db")
    yield s
    s.close()


def test_what_counts_as_penalized() -> None:
    assert not sampled_with_penalties(sampling())
    assert not sampled_with_penalties({"temperature": 1.0})  # records from before penalties were served
    assert not sampled_with_penalties(sampling(logit_bias={"5": 0.0}))  # a zero bias changes nothing
    assert sampled_with_penalties(sampling(presence_penalty=0.5))
    assert sampled_with_penalties(sampling(frequency_penalty=-0.1))
    assert sampled_with_penalties(sampling(logit_bias={"5": -100.0}))


def test_penalized_trajectories_are_skipped_counted_and_explained(store: SqliteStore) -> None:
    add(store, "tr-plain", [sampling()])
    add(store, "tr-zero-bias", [sampling(logit_bias={"5": 0.0})])
    add(store, "tr-presence", [sampling(presence_penalty=0.6)])
    add(store, "tr-bias", [sampling(temperature=0.0, logit_bias={"7": 100.0})])
    add(store, "tr-multi", [sampling(), sampling(frequency_penalty=1.0), sampling()])  # one penalized turn: the whole trajectory
    batch = collect_samples(store, family="fam", current_version=3, cursor=Cursor(), cfg=CFG, now=NOW)
    assert sorted({s.trajectory_id for s in batch.samples}) == ["tr-plain", "tr-zero-bias"]
    assert batch.counts.sampling_penalties == 1 + 1 + 3  # in turns
    assert batch.counts.no_reward == 0  # they were rewarded: skipped for their penalties, not for a missing reward
    why = unused_reasons(batch.counts.as_dict(), batch.samples, [1.0] * len(batch.samples))
    assert why["counts"] == {"sampling_penalties": 5}
    assert why["top_key"] == "sampling_penalties" and why["top"] == REASONS["sampling_penalties"]
    assert "logit_bias" in why["top"] and "penalties" in why["top"]


def _candidate(turn: Turn) -> Sample:
    return Sample.of_turn(turn, trajectory_id=turn.trajectory_id, group_id="g", version=3, reward=1.0, trajectory_reward=None)


def test_the_parity_probe_never_picks_a_penalized_turn(store: SqliteStore, tmp_path: Path) -> None:
    plain = add(store, "tr-plain", [sampling(temperature=0.5)], t0=1_000.0)
    pen = add(store, "tr-pen", [sampling(temperature=0.5, frequency_penalty=2.0)], t0=2_000.0)  # the newest candidate
    biased = add(store, "tr-biased", [sampling(temperature=0.0, logit_bias={"7": 50.0})], t0=3_000.0)
    batch = collect_samples(store, family="fam", current_version=3, cursor=Cursor(), cfg=CFG, now=NOW)
    assert [s.turn_id for s in batch.samples] == [plain[0].turn_id]  # never a candidate: it never trains
    learner_dir = tmp_path / "learner"
    learner_dir.mkdir()
    assert probe_turns(learner_dir, store, batch.samples, k=4) == {"greedy": [plain[0].turn_id], "sampled": [plain[0].turn_id]}
    # even handed over as candidates (a caller that did not go through collect_samples), they are dropped
    (learner_dir / PROBE_FILE).unlink()
    candidates = [_candidate(t) for t in (*pen, *biased, *plain)]
    chosen = probe_turns(learner_dir, store, candidates, k=4)
    assert chosen == {"greedy": [plain[0].turn_id], "sampled": [plain[0].turn_id]}
    # and a saved probe that lists one is chosen again
    (learner_dir / PROBE_FILE).write_text(json.dumps({"greedy": [pen[0].turn_id], "sampled": [biased[0].turn_id]}))
    assert probe_turns(learner_dir, store, batch.samples, k=4) == {"greedy": [plain[0].turn_id], "sampled": [plain[0].turn_id]}
