"""The re-rollout planning helpers on tables: branch bodies and turns, RTPO's sweep steps and sibling sets scored by
their continuations, TCPO's selection (the HTTP path runs end to end in ``test_service.py``)."""

from __future__ import annotations

import math
import random

import pytest

from learner.advantages import TurnSample
from learner.config import SampleConfig
from learner.records import Reward, Trajectory, Turn, context_sha256
from learner.rerollout import (
    BranchPoint,
    BranchRun,
    PointRuns,
    branch_body,
    branchable,
    choose_branch_turns,
    counterfactual_score,
    counterfactual_scores,
    plan_rtpo,
    rtpo_estimator_input,
    rtpo_segments,
    rtpo_turn_buckets,
    rtpo_update_order,
    select_counterfactual_turns,
    tcpo_select_turns,
    turn_surprisal,
)
from learner.samples import Sample, SkipCounts, trajectory_samples
from learner.update import estimate
from tests.learner.test_advantages import S, random_samples


def turn(i: int, ctx: list[int], out: list[int]) -> Turn:
    return Turn(
        turn_id=f"t{i}", trajectory_id="tr", session_id="s", index=i, parent_turn_id=f"t{i - 1}" if i else None,
        model="m", context_ids=ctx, output_ids=out, logprobs=[-0.1] * len(out), loss_mask=[1] * len(out), completion_id="c", finish_reason="stop",
    )  # fmt: skip


def traj(meta: dict | None = None) -> Trajectory:
    turns = [turn(0, [1, 2], [3, 4]), turn(1, [1, 2, 3, 4, 9], [5]), turn(2, [1, 2, 3, 4, 9, 5, 9], [6, 7])]
    m = {"task": "calc_arith", "problem_index": 3, "problem_seed": 7, "agent": "a", **(meta or {})}
    return Trajectory(trajectory_id="tr", session_id="s", turns=turns, meta=m)


def test_branch_body_names_the_recorded_backbone_and_pins_its_context():
    body = branch_body(BranchPoint(traj(), 2), sample_seed=11, model="fam@2", kind="rtpo")
    assert body["task"] == "calc_arith" and body["problem_index"] == 3 and body["seed"] == 7 and body["sample_seed"] == 11
    # the runtime replays the backbone from its own store: the body names it, never carries its outputs
    assert body["branch"] == {"trajectory_id": "tr", "turn": 2, "context_sha256": context_sha256([1, 2, 3, 4, 9, 5, 9]), "kind": "rtpo"}
    assert body["model"] == "fam@2"
    one = branch_body(BranchPoint(traj(), 0), sample_seed=0, model=None, kind="tcpo", max_turns=1)
    assert one["branch"]["turn"] == 0 and one["branch"]["kind"] == "tcpo" and one["max_turns"] == 1 and "model" not in one
    with pytest.raises(ValueError, match="outside"):
        branch_body(BranchPoint(traj(), 3), sample_seed=0, model=None, kind="rtpo")


def test_context_ids_hash_is_stable_and_order_sensitive():
    assert context_sha256([1, 2, 3]) == context_sha256((1, 2, 3))
    assert context_sha256([1, 2, 3]) != context_sha256([3, 2, 1])
    assert context_sha256([]) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of nothing


def test_only_replayable_task_runs_are_branched():
    assert branchable(traj())
    assert not branchable(traj({"problem_index": None}))
    assert not branchable(traj({"rerollout": "rtpo"}))  # never branch a branch
    assert not branchable(traj({"eval": True}))
    assert not branchable(traj({"trainable": False}))


@pytest.mark.parametrize("n_turns,k,expected_len", [(1, 2, 0), (2, 2, 1), (5, 2, 2), (5, 0, 0), (4, 9, 3)])
def test_branch_turns_are_distinct_and_never_turn_zero(n_turns, k, expected_len):
    for seed in range(20):
        got = choose_branch_turns(n_turns, k, random.Random(seed))
        assert len(got) == expected_len and got == sorted(set(got)) and all(1 <= t < n_turns for t in got)


def test_branch_turns_cover_all_later_turns_uniformly():
    rng = random.Random(0)
    hits = [0] * 5
    for _ in range(4000):
        for t in choose_branch_turns(5, 1, rng):
            hits[t] += 1
    assert hits[0] == 0 and all(900 < h < 1100 for h in hits[1:])


def test_rtpo_update_order_table() -> None:
    samples = [S(f"t{i}", t, 1.0) for i, t in enumerate([0, 2, 1, 2, 0, 3])]
    assert rtpo_update_order(samples) == [[5], [1, 3], [2], [0, 4]]
    # buckets of two turns from the end: {3, 2} then {1, 0}
    assert rtpo_update_order(samples, bucket_size=2) == [[1, 3, 5], [0, 2, 4]]
    assert rtpo_update_order([]) == []
    with pytest.raises(ValueError):
        rtpo_update_order(samples, bucket_size=0)


@pytest.mark.parametrize("seed", range(10))
def test_rtpo_update_order_strictly_decreasing(seed: int) -> None:
    rng = random.Random(seed)
    samples = random_samples(rng, turn_rewards=False)
    for bucket in (1, 2, 3):
        order = rtpo_update_order(samples, bucket_size=bucket)
        assert sorted(i for b in order for i in b) == list(range(len(samples)))  # every sample exactly once
        for prev, nxt in zip(order, order[1:]):
            assert max(samples[i].turn_index for i in nxt) < min(samples[i].turn_index for i in prev)
        if bucket == 1:
            turns = [samples[b[0]].turn_index for b in order]
            assert turns == sorted(set(turns), reverse=True)


def test_tcpo_selection_by_surprisal() -> None:
    assert turn_surprisal([-1.0, -3.0]) == 2.0
    assert tcpo_select_turns([0.1, 2.0, 0.5, 3.0, 0.2], top_q=0.4) == [False, True, False, True, False]
    assert tcpo_select_turns([0.1, 2.0, 0.5, 3.0, 0.2], threshold=0.4) == [False, True, True, True, False]


def test_rtpo_turn_buckets_run_latest_first_and_match_the_sample_order():
    assert rtpo_turn_buckets([0, 1, 2, 2, 5]) == [[5], [2], [1], [0]]
    assert rtpo_turn_buckets([0, 1, 2, 3, 4], bucket_size=2) == [[3, 4], [1, 2], [0]]
    assert rtpo_turn_buckets([]) == []
    turns = [0, 3, 1, 4, 4, 2, 7]
    samples = [TurnSample(trajectory_id="a", group_id="g", turn_index=t, reward=None, trajectory_reward=1.0) for t in turns]
    for size in (1, 2, 3):
        by_samples = [sorted({turns[i] for i in b}) for b in rtpo_update_order(samples, bucket_size=size)]
        assert rtpo_turn_buckets(turns, size) == by_samples
    with pytest.raises(ValueError):
        rtpo_turn_buckets([1], bucket_size=0)


def sample(tid: str, t: int, lps: list[float]) -> Sample:
    return Sample(
        turn_id=f"{tid}{t}", trajectory_id=tid, group_id="g", turn_index=t, context_ids=[1], output_ids=[2] * max(1, len(lps)),
        logprobs=lps, loss_mask=[1] * max(1, len(lps)), adapter=None, adapter_version=0, reward=None, trajectory_reward=1.0,
        temperature=1.0, created_at=0.0,
    )  # fmt: skip


def test_counterfactual_turns_are_the_most_surprising():
    s = [sample("a", 0, [-0.1, -0.1]), sample("a", 1, [-3.0, -1.0]), sample("b", 0, [-0.5]), sample("b", 1, []), sample("c", 0, [-2.5])]
    chosen = select_counterfactual_turns(s, top_q=0.5, threshold=None)
    assert [(x.trajectory_id, x.turn_index) for x in chosen] == [("a", 1), ("c", 0)]  # ceil(0.5 * 4 with logprobs) = 2
    assert [(x.trajectory_id, x.turn_index) for x in select_counterfactual_turns(s, top_q=0.0, threshold=0.4)] == [("a", 1), ("b", 0), ("c", 0)]
    assert select_counterfactual_turns([sample("z", 0, [])], top_q=1.0, threshold=None) == []


def test_counterfactual_score_prefers_the_sampled_turns_process_score():
    run = {"steps": [{"replayed": True, "process_score": 1.0}, {"replayed": False, "process_score": 0.25}], "reward": 0.0}
    assert counterfactual_score(run) == 0.25
    assert counterfactual_score({"steps": [{"replayed": False, "process_score": None}], "reward": 1.0}) == 1.0
    assert counterfactual_score({"steps": [], "reward": None}) is None


def test_counterfactual_scores_compare_like_with_like():
    # traj() has 3 turns. Process-scored alternatives count at any turn; reward-only alternatives (a task without
    # per-turn scores: the truncated run's outcome) only at the backbone's last turn, whose own score is its outcome
    step = {"replayed": False, "process_score": 0.5}
    runs = [
        BranchRun(BranchPoint(traj(), 0), run={"steps": [step], "reward": 0.0}),
        BranchRun(BranchPoint(traj(), 0), run={"steps": [{"replayed": False}], "reward": 1.0}),  # dropped: not comparable
        BranchRun(BranchPoint(traj(), 1), run={"steps": [{"replayed": False}], "reward": 1.0}),  # dropped
        BranchRun(BranchPoint(traj(), 2), run={"steps": [{"replayed": False}], "reward": 1.0}),
        BranchRun(BranchPoint(traj(), 2), run={}, error="409"),
    ]
    assert counterfactual_scores(runs) == {("tr", 0): [0.5], ("tr", 2): [1.0]}


# ---- RTPO's sweep plan and estimator input ------------------------------------------------------------


def test_sweep_steps_start_at_branch_points_latest_first():
    # a bucket without a branch point joins the step before it, so the next branch bucket's siblings always see
    # every earlier update (the refresh used to be skipped after a bucket without branch points)
    assert rtpo_segments([0, 1, 2, 3], {3, 1}) == [[2, 3], [0, 1]]
    assert rtpo_segments([0, 1, 2], {1, 2}) == [[2], [0, 1]]
    assert rtpo_segments([0, 1, 2, 3, 4], {4, 1}, bucket_size=2) == [[3, 4], [0, 1, 2]]
    # no branch point: one step over every turn, i.e. trajectory GRPO (it used to take one step per turn)
    assert rtpo_segments([0, 1, 2, 2, 0], set()) == [[0, 1, 2]]


def run_traj(tid: str, turns: list[tuple[int, list[int], float | None]], outcome: float | None, meta: dict | None = None) -> Trajectory:
    """A recorded run: (index, context ids, process score) per turn, the verifier's outcome on the trajectory."""
    ts, rewards = [], []
    for i, ctx, r in turns:
        ts.append(
            Turn(
                turn_id=f"{tid}-{i}", trajectory_id=tid, session_id="s", index=i, model="m", context_ids=ctx, output_ids=[7, 8],
                logprobs=[-0.5, -0.5], loss_mask=[1, 1], completion_id="c", finish_reason="stop", adapter=None,
            )
        )  # fmt: skip
        if r is not None:
            rewards.append(Reward(target="turn", target_id=f"{tid}-{i}", value=r, source="verifier:x:process"))
    if outcome is not None:
        rewards.append(Reward(target="trajectory", target_id=tid, value=outcome, source="verifier:x"))
    m = {"task": "x", "task_key": "p1", "agent": "a", "problem_index": 1, "problem_seed": 0, **(meta or {})}
    return Trajectory(trajectory_id=tid, session_id="s", turns=ts, meta=m, rewards=rewards)


CFG = SampleConfig(settle_s=0)


def to_samples(traj: Trajectory) -> list[Sample]:
    return trajectory_samples(traj, family="fam", min_version=0, cfg=CFG, counts=SkipCounts())


def test_rtpo_scores_siblings_by_their_continuations_return():
    c0, c1, c2 = [1, 2], [1, 2, 7, 8, 3], [1, 2, 7, 8, 3, 7, 8, 4]
    backbone = run_traj("B", [(0, c0, 0.5), (1, c1, 0.0), (2, c2, 0.0)], outcome=0.0)
    # the backbone's turn 1 continued by the current policy (a refresh: branch at 2 replaying B's turn 1) succeeds
    refresh = run_traj("R", [(2, c2, 1.0)], outcome=1.0, meta={"rerollout": "rtpo_refresh"})
    s1 = run_traj("S1", [(1, c1, 0.0), (2, [9, 9, 1], 1.0)], outcome=1.0, meta={"rerollout": "rtpo"})  # poor turn, good continuation
    s2 = run_traj("S2", [(1, c1, 0.5), (2, [9, 9, 2], 0.0)], outcome=0.0, meta={"rerollout": "rtpo"})  # good turn score, fails
    bb = to_samples(backbone)
    point = BranchPoint(backbone, 1)
    est_in, train = rtpo_estimator_input(bb, [PointRuns(point, [s1, s2], refresh)], {1}, to_samples, ["verifier:*"])
    adv = estimate(est_in, "rtpo")
    trained = {(est_in[i].trajectory_id, est_in[i].turn_index): adv[i] for i in train}
    # the sibling set at context c1, scored by whole-continuation returns (gamma 1; the outcome arrives with the last turn):
    # B (its turn 1, then R's turn 2): 0 + 1 + 1 = 2;  S1: 0 + 1 + 1 = 2;  S2: 0.5 + 0 + 0 = 0.5
    # mean 1.5, sample std sqrt(0.75)
    sd = math.sqrt(0.75) + 1e-6
    assert trained == pytest.approx({("R", 1): 0.5 / sd, ("S1", 1): 0.5 / sd, ("S2", 1): -1.0 / sd})
    # scored on their own turn (the old sweep passed only the branch turns), S2 (0.5) would have beaten S1 (0) and B (0)
    assert est_in[train[0]].turn_id == "B-1" and est_in[train[0]].output_ids == bb[1].output_ids  # B's own turn is trained
    assert not any(s.trajectory_id == "B" and s.turn_index == 1 for s in (est_in[i] for i in train))


def test_rtpo_a_failed_refresh_never_falls_back_to_the_old_policys_continuation():
    """The refresh run of B's continuation failed: the old code silently compared the siblings (the current policy) with
    B's recorded continuation (the old policy's failure, return 0) as if it were this policy's. Now the point gets no
    sibling set: B's turn 1 keeps its trajectory-GRPO advantage (one backbone: 0) and the siblings train nothing."""
    c0, c1, c2 = [1, 2], [1, 2, 7, 8, 3], [1, 2, 7, 8, 3, 7, 8, 4]
    backbone = run_traj("B", [(0, c0, 0.5), (1, c1, 0.0), (2, c2, 0.0)], outcome=0.0)
    s1 = run_traj("S1", [(1, c1, 0.0), (2, [9, 9, 1], 1.0)], outcome=1.0, meta={"rerollout": "rtpo"})
    s2 = run_traj("S2", [(1, c1, 0.5), (2, [9, 9, 2], 0.0)], outcome=0.0, meta={"rerollout": "rtpo"})
    bb = to_samples(backbone)
    point = BranchPoint(backbone, 1)
    failed = PointRuns(point, [s1, s2], None, refresh_failed=True)
    est_in, train = rtpo_estimator_input(bb, [failed], {1}, to_samples, ["verifier:*"])
    assert est_in == bb and [est_in[i].turn_id for i in train] == ["B-1"]  # no sibling set: only the backbone's own turn
    assert list(estimate(est_in, "rtpo")) == [0.0, 0.0, 0.0]  # one backbone: trajectory GRPO has nothing to compare
    # the same point with refresh off (no refresh asked for): the recorded continuation stands in, by design
    off = PointRuns(point, [s1, s2], None)
    est_in, train = rtpo_estimator_input(bb, [off], {1}, to_samples, ["verifier:*"])
    assert len(est_in) > len(bb) and {est_in[i].trajectory_id for i in train} == {"B#from1", "S1", "S2"}


def test_rtpo_without_branches_is_trajectory_grpo():
    # four runs of one problem: the same first context, then their own histories; outcome rewards only
    turns = [[(0, [1, 2], None), (1, [1, 2, 7, 8, k], None), (2, [1, 2, 7, 8, k, 7, 8], None)] for k in range(4)]
    runs = [run_traj(f"T{k}", t, outcome=float(k % 2)) for k, t in enumerate(turns)]
    samples = [s for r in runs for s in to_samples(r)]
    plan = plan_rtpo(runs, [s.turn_index for s in samples], branches=0, bucket_size=1, rng=random.Random(0))
    assert plan.points == [] and plan.segments == [[0, 1, 2]]  # one step over every turn
    est_in, train = rtpo_estimator_input(samples, [], set(plan.segments[0]), to_samples, ["verifier:*"])
    assert est_in == samples and train == list(range(len(samples)))
    assert list(estimate(est_in, "rtpo")) == pytest.approx(list(estimate(samples, "grpo")))
