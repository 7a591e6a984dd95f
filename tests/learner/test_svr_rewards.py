"""SVR and SVR-R1 rewards against tables computed by hand from the definitions (``learner/svr_rewards.py``).

Weights are chosen distinct (w_c=1, w_v=0.5, w_s=0.25, b=1, b'=2, penalty 0.5, τ=0.7) so a term that is
mixed up or dropped changes the number. Each expected value is worked out in the comment next to it.
"""

from __future__ import annotations

import pytest

from learner.advantages import compute_advantages
from learner.config import LearnerSettings, SVRConfig, SVRR1Config
from learner.records import TurnCheck
from learner.samples import Sample
from learner.svr_rewards import apply_self_check_rewards, svr_r1_reward, svr_turn_reward

SVR = SVRConfig(enabled=True, tau=0.7, w_c=1.0, w_v=0.5, w_s=0.25, b=1.0, b_wrong=2.0, format_penalty=0.5)


def svr_check(correct: bool | None, verdict: str | None, conf: float | None, ok: bool = True) -> TurnCheck:
    return TurnCheck(format="svr", solution="x", verdict=verdict, confidence=conf, format_ok=ok, correct=correct)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("correct", "verdict", "conf", "expected"),
    [
        # c=1, Correct 0.9: q=0.9, 1-(0.1)^2=0.99; stop-ready right +1 -> 1 + 0.5*0.99 + 0.25*1
        (True, "correct", 0.9, 1.745),
        # c=1, Correct 0.7 (= tau: the served policy stops): q=0.7, 1-0.09=0.91 -> 1 + 0.455 + 0.25
        (True, "correct", 0.7, 1.705),
        # c=1, Correct 0.6 (< tau, not stop-ready): 1-0.16=0.84 -> 1 + 0.42
        (True, "correct", 0.6, 1.42),
        # c=1, Incorrect 0.9: q=0.1, 1-0.81=0.19 -> 1 + 0.095
        (True, "incorrect", 0.9, 1.095),
        # c=1, Incorrect 0.6: q=0.4, 1-0.36=0.64 -> 1 + 0.32
        (True, "incorrect", 0.6, 1.32),
        # c=0, Correct 0.9: q=0.9, 1-0.81=0.19; a wrong stop -2 -> 0 + 0.095 - 0.5
        (False, "correct", 0.9, -0.405),
        # c=0, Correct 0.7 (= tau, a wrong stop): 1-0.49=0.51 -> 0.255 - 0.5
        (False, "correct", 0.7, -0.245),
        # c=0, Correct 0.6: 1-0.36=0.64 -> 0.32 (would not stop: no penalty)
        (False, "correct", 0.6, 0.32),
        # c=0, Incorrect 0.9: q=0.1, 1-0.01=0.99 -> 0.495
        (False, "incorrect", 0.9, 0.495),
        # c=0, Incorrect 0.6: q=0.4, 1-0.16=0.84 -> 0.42
        (False, "incorrect", 0.6, 0.42),
    ],
)
def test_svr_turn_reward_table(correct: bool, verdict: str, conf: float, expected: float) -> None:
    assert svr_turn_reward(svr_check(correct, verdict, conf), SVR) == pytest.approx(expected)


def test_svr_unparsable_and_unmeasured_turns() -> None:
    assert svr_turn_reward(svr_check(True, None, None, ok=False), SVR) == pytest.approx(0.5)  # 1 - penalty 0.5
    assert svr_turn_reward(svr_check(False, "correct", None, ok=False), SVR) == pytest.approx(-0.5)  # 0 - 0.5
    assert svr_turn_reward(svr_check(None, "correct", 0.9), SVR) is None  # no verifier: no reward, never a 0


SVR_R1 = SVRR1Config(enabled=True, w_v=0.5, w_f=0.2, alpha=0.3)


def r1(correct: bool, verify: str | None, ok: bool = True) -> TurnCheck:
    return TurnCheck(format="svr_r1", solution="x", verdict=verify, format_ok=ok, correct=correct)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("turns", "expected"),
    [
        # verdict and format terms are shares of the turns: acc + 0.5*(matches/T) + 0.2*(parsed/T) + 0.3*(last - first)
        ([r1(True, "correct")], 1.7),  # acc 1 + 0.5*(1/1) match + 0.2*(1/1) format (one turn: no shaping)
        ([r1(False, "correct")], 0.2),  # acc 0, Yes on a wrong answer: no match; format 0.2
        ([r1(False, "incorrect")], 0.7),  # acc 0, No on a wrong answer matches: 0.5; + 0.2
        ([r1(False, "incorrect"), r1(True, "correct")], 2.0),  # acc 1 + 0.5*(2/2) + 0.2 + 0.3*(1-0): above 1.7 only by the shaping
        ([r1(True, "incorrect"), r1(False, "correct")], -0.1),  # acc 0 + 0.5*(0/2) + 0.2 - 0.3 (right -> wrong flip)
        ([r1(True, "incorrect"), r1(True, "correct")], 1.45),  # acc 1 + 0.5*(1/2) (turn 2 only) + 0.2 + 0 (no change)
        ([r1(False, None, ok=False), r1(True, "correct")], 1.65),  # acc 1 + 0.5*(1/2) + 0.2*(1/2) + 0.3
    ],
)
def test_svr_r1_reward_table(turns: list[TurnCheck], expected: float) -> None:
    assert svr_r1_reward(turns, SVR_R1) == pytest.approx(expected)


def test_svr_r1_reward_does_not_grow_with_turns() -> None:
    """The verdict term is the share of turns whose Yes/No matches, not a count: a run does not score more for
    taking more turns. Default weights (w_v=0.5, w_f=0.25, alpha=0), each number by hand."""
    cfg = SVRR1Config(enabled=True, w_v=0.5, w_f=0.25, alpha=0.0)
    right_first = [r1(True, "correct")]  # acc 1 + 0.5*(1/1) + 0.25*(1/1) = 1.75
    wrong_then_right = [r1(False, "incorrect"), r1(True, "correct")]  # acc 1 + 0.5*(2/2) + 0.25*(2/2) = 1.75
    two_rethinks = [r1(False, "incorrect"), r1(False, "incorrect"), r1(True, "correct")]  # 1 + 0.5*(3/3) + 0.25 = 1.75
    wrong_twice = [r1(False, "incorrect"), r1(False, "correct")]  # acc 0 + 0.5*(1/2) + 0.25*(2/2) = 0.5
    assert svr_r1_reward(right_first, cfg) == pytest.approx(1.75)
    assert svr_r1_reward(wrong_then_right, cfg) == pytest.approx(1.75)
    assert svr_r1_reward(two_rethinks, cfg) == pytest.approx(1.75)
    assert svr_r1_reward(wrong_twice, cfg) == pytest.approx(0.5)


def test_svr_r1_without_shaping_and_unmeasured() -> None:
    plain = SVRR1Config(enabled=True, w_v=0.5, w_f=0.2, alpha=0.0)
    # without shaping a correction scores what a right first answer does: 1 + 0.5*(2/2) + 0.2 = 1 + 0.5*(1/1) + 0.2 = 1.7
    assert svr_r1_reward([r1(False, "incorrect"), r1(True, "correct")], plain) == pytest.approx(1.7)
    assert svr_r1_reward([r1(True, "correct")], plain) == pytest.approx(1.7)
    assert svr_r1_reward([r1(True, "correct"), TurnCheck(format="svr_r1", verdict="correct", format_ok=True)], plain) is None


def sample(tid: str, turn: int, check: TurnCheck | None, *, horizon: int | None = 2, group: str = "g") -> Sample:
    return Sample(
        turn_id=f"{tid}-{turn}",
        trajectory_id=tid,
        group_id=group,
        turn_index=turn,
        context_ids=[1, 2, turn],
        output_ids=[3],
        logprobs=[-0.1],
        loss_mask=[1],
        adapter=None,
        adapter_version=0,
        reward=None,
        trajectory_reward=1.0,
        temperature=1.0,
        created_at=0.0,
        meta={"horizon": horizon} if horizon else {},
        trajectory_reward_source="verifier:t",
        self_check=check,
    )


def test_svr_rewards_replace_the_outcome_and_advantages_are_per_turn_index() -> None:
    # two fixed-horizon runs of one problem, two turns each; rewards from the table above
    a = [sample("a", 0, svr_check(False, "correct", 0.9)), sample("a", 1, svr_check(True, "correct", 0.9))]  # -0.405, 1.745
    b = [sample("b", 0, svr_check(False, "incorrect", 0.9)), sample("b", 1, svr_check(True, "correct", 0.6))]  # 0.495, 1.42
    adaptive = [sample("c", 0, svr_check(True, "correct", 0.9), horizon=None)]
    out, info = apply_self_check_rewards([*a, *b, *adaptive], SVR, SVRR1Config())
    assert info["scored"] == 4 and info["adaptive"] == 1 and [s.trajectory_id for s in out] == ["a", "a", "b", "b"]
    assert [s.reward for s in out] == pytest.approx([-0.405, 1.745, 0.495, 1.42])
    assert all(s.trajectory_reward is None and s.reward_source == "svr" for s in out)
    adv = compute_advantages("turn_grpo", [s.to_turn_sample() for s in out], source="reward", eps=1e-9)
    # turn 0: values -0.405, 0.495 -> mean 0.045, unbiased std = |0.9|/sqrt(2) = 0.63640 -> -/+0.70711
    # turn 1: values 1.745, 1.42 -> mean 1.5825, std = 0.325/sqrt(2) = 0.22981 -> +/-0.70711
    assert list(adv) == pytest.approx([-0.70711, 0.70711, 0.70711, -0.70711], abs=1e-4)


def test_svr_r1_rewards_go_on_the_trajectory() -> None:
    t = [sample("t", 1, r1(True, "correct")), sample("t", 0, r1(False, "incorrect"))]  # given out of order: sorted by turn
    out, info = apply_self_check_rewards(t, SVRConfig(), SVR_R1)
    assert [s.trajectory_reward for s in out] == pytest.approx([2.0, 2.0]) and all(s.reward is None for s in out) and info["scored"] == 2
    untouched, _ = apply_self_check_rewards(t, SVRConfig(), SVRR1Config())
    assert untouched == t


def test_svr_settings_require_the_turn_index_estimator() -> None:
    with pytest.raises(ValueError, match="turn_grpo"):
        LearnerSettings(family="f", svr={"enabled": True})
    ok = LearnerSettings(family="f", svr={"enabled": True}, trainer={"estimator": "turn_grpo", "estimator_params": {"source": "reward"}})
    assert ok.svr.enabled
    with pytest.raises(ValueError, match="one per learner"):
        LearnerSettings(
            family="f", svr={"enabled": True}, svr_r1={"enabled": True}, trainer={"estimator": "turn_grpo", "estimator_params": {"source": "reward"}}
        )


def test_adaptive_report_by_hand() -> None:
    from learner.svr_rollouts import adaptive_report, calibration_error

    runs = [
        {"correct": True, "stop_reason": "verified", "p_correct": 0.9, "turns": 1},
        {"correct": False, "stop_reason": "verified", "p_correct": 0.8, "turns": 1},  # a wrong stop
        {"correct": True, "stop_reason": "max_turns_best", "p_correct": 0.6, "turns": 3},
        {"correct": False, "stop_reason": "max_turns", "p_correct": None, "turns": 3},  # nothing parsed: not calibrated
        "500: boom",  # a failed run: counted, not scored
    ]
    r = adaptive_report(runs)
    got = (r["n"], r["failed"], r["accuracy"], r["mean_turns"], r["verified_stops"], r["wrong_stop_rate"], r["n_calibrated"])
    assert got == (4, 1, 0.5, 2.0, 2, 0.5, 3)
    # bins 9, 8, 6 hold one run each: (|0.9-1| + |0.8-0| + |0.6-1|) / 3; Brier (0.01 + 0.64 + 0.16) / 3
    assert r["ece"] == pytest.approx(1.3 / 3) and r["brier"] == pytest.approx(0.27)
    # two runs in bin 7: |(0.72 + 0.78) - (1 + 0)| / 2 = 0.25; apart (bins 7 and 8): (|0.75 - 1| + |0.85 - 0|) / 2 = 0.55
    assert calibration_error([0.72, 0.78], [True, False]) == pytest.approx(0.25)
    assert calibration_error([0.75, 0.85], [True, False]) == pytest.approx(0.55)
    assert adaptive_report([])["accuracy"] is None
