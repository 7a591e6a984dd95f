"""One effect test per estimator family on a small synthetic problem where the right credit is known.

The problem: two turns; turn 0's action (L or R) changes nothing, turn 1's action decides success (A wins,
B loses). A tabular softmax policy samples groups of trajectories; each family's advantages drive a plain
policy-gradient update (``theta[t, a] += lr * A``), and we measure what the family is supposed to do:

* trajectory level (grpo, drgrpo, rloo): the outcome's advantage is broadcast to every turn, so the
  irrelevant turn gets as much credit as the deciding one (its policy drifts with the outcome's noise);
* turn level with per-turn rewards (turn_grpo, MemoPilot/SVR reading): a verifier score on each turn
  separates them: the irrelevant turn gets exactly zero credit and its policy stays where it was;
* TCPO: per-turn verifier scores turned into retrospective credit: the turn that broke a right answer
  gets negative credit while the turn that found it gets positive credit, where the outcome gives both
  the same sign.

GiGPO's effect (a state reached by two paths is compared across them) and RTPO's (a turn is judged by
its refreshed continuation, not by its own turn) are in ``test_advantages.py`` and ``test_rerollout.py``.
Expected numbers come from the definitions (or from a clear inequality the definitions imply), never
from the code's own output.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from learner.advantages import TurnSample, compute_advantages


def sample_groups(theta: np.ndarray, rng: np.random.Generator, n_groups: int, g: int) -> list[tuple[str, int, int, float]]:
    """(trajectory id, a0, a1, outcome) per trajectory; a = 0 is L / A, 1 is R / B."""
    out = []
    for k in range(n_groups):
        p = np.exp(theta) / np.exp(theta).sum(axis=1, keepdims=True)  # (2 turns, 2 actions)
        for i in range(g):
            a0, a1 = int(rng.random() < p[0, 1]), int(rng.random() < p[1, 1])
            out.append((f"g{k}-{i}", a0, a1, 1.0 if a1 == 0 else 0.0))
    return out


def turn_samples(trajs: list[tuple[str, int, int, float]], g: int, *, process: bool, outcome: bool) -> list[TurnSample]:
    rows = []
    for n, (tid, _, _, r) in enumerate(trajs):
        gid = f"group{n // g}"
        rows.append(TurnSample(tid, gid, 0, 0.0 if process else None, r if outcome else None, anchor=f"{gid}-start"))
        rows.append(TurnSample(tid, gid, 1, r if process else None, r if outcome else None, anchor=f"{tid}-t1"))
    return rows


def train(estimator: str, seed: int, *, process: bool, outcome: bool, iters: int = 40, lr: float = 0.5, **params) -> np.ndarray:
    rng = np.random.default_rng(seed)
    theta = np.zeros((2, 2))
    for _ in range(iters):
        trajs = sample_groups(theta, rng, n_groups=4, g=4)
        adv = compute_advantages(estimator, turn_samples(trajs, 4, process=process, outcome=outcome), **params)
        for n, (_, a0, a1, _) in enumerate(trajs):
            p = np.exp(theta) / np.exp(theta).sum(axis=1, keepdims=True)
            for t, a in ((0, a0), (1, a1)):
                grad = -p[t].copy()
                grad[a] += 1.0  # d log pi(a) / d theta[t]
                theta[t] += lr * adv[2 * n + t] * grad / len(trajs)
    return np.exp(theta) / np.exp(theta).sum(axis=1, keepdims=True)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_trajectory_estimators_give_the_irrelevant_turn_the_outcomes_credit(estimator: str) -> None:
    rng = np.random.default_rng(0)
    trajs = sample_groups(np.zeros((2, 2)), rng, n_groups=200, g=4)
    adv = np.asarray(compute_advantages(estimator, turn_samples(trajs, 4, process=False, outcome=True)))
    a0, a1 = adv[0::2], adv[1::2]
    assert np.array_equal(a0, a1)  # broadcast: turn 0's credit is turn 1's, to the last bit
    won = np.array([t[2] == 0 for t in trajs])
    assert a1[won].mean() > 0 > a1[~won].mean()  # the deciding action is credited
    # and the policy of the irrelevant turn random-walks with the outcome's noise (mean over seeds)
    drift = np.mean([abs(train(estimator, s, process=False, outcome=True)[0, 0] - 0.5) for s in range(8)])
    learned = np.mean([train(estimator, s, process=False, outcome=True)[1, 0] for s in range(8)])
    assert learned > 0.8 and drift > 0.04


def test_turn_grpo_with_turn_scores_credits_only_the_deciding_turn() -> None:
    # the verifier scores each turn (turn 0: 0, whatever it did; turn 1: 1 if it chose A): per-turn-index
    # normalisation of the turn's own reward gives turn 0 exactly nothing
    rng = np.random.default_rng(0)
    trajs = sample_groups(np.zeros((2, 2)), rng, n_groups=200, g=4)
    adv = np.asarray(compute_advantages("turn_grpo", turn_samples(trajs, 4, process=True, outcome=False), source="reward"))
    assert not adv[0::2].any()
    won = np.array([t[2] == 0 for t in trajs])
    assert adv[1::2][won].mean() > 0 > adv[1::2][~won].mean()
    # the irrelevant turn's policy does not move at all; the deciding turn learns as fast as under GRPO
    for s in range(4):
        p = train("turn_grpo", s, process=True, outcome=False, source="reward")
        assert p[0, 0] == pytest.approx(0.5, abs=1e-12)
    learned = np.mean([train("turn_grpo", s, process=True, outcome=False, source="reward")[1, 0] for s in range(8)])
    grpo = np.mean([train("grpo", s, process=False, outcome=True)[1, 0] for s in range(8)])
    assert learned > 0.8 and learned >= grpo - 0.05


def test_tcpo_blames_the_turn_that_broke_a_right_answer() -> None:
    # four two-turn trajectories, each turn's candidate scored by the verifier (TCPO's setting):
    # right then broken [1, 0]; wrong then fixed [0, 1]; right twice [1, 1]; wrong twice [0, 0]
    scores = {"broke": (1.0, 0.0), "fixed": (0.0, 1.0), "kept": (1.0, 1.0), "never": (0.0, 0.0)}
    best = {k: max(v) for k, v in scores.items()}  # the best-turn outcome TCPO's metric counts
    rows = [TurnSample(k, "g", t, v[t], best[k]) for k, v in scores.items() for t in (0, 1)]
    adv = dict(zip([(r.trajectory_id, r.turn_index) for r in rows], compute_advantages("tcpo", rows), strict=True))
    # credit (lambda 1, gamma 0.9): broke [1, -1]; fixed [0.9 (hindsight), 1]; kept [1, 0]; never [0, 0]
    credit = {("broke", 0): 1, ("broke", 1): -1, ("fixed", 0): 0.9, ("fixed", 1): 1, ("kept", 0): 1, ("kept", 1): 0, ("never", 0): 0, ("never", 1): 0}
    values = list(credit.values())
    mean, sd = float(np.mean(values)), float(np.std(values, ddof=1))
    for key, c in credit.items():
        assert adv[key] == pytest.approx((c - mean) / (sd + 1e-6))
    assert adv[("broke", 0)] > 0 > adv[("broke", 1)]  # the right answer is credited, breaking it is blamed
    # the trajectory-level view cannot do this: both turns of "broke" get the same (positive) advantage
    grpo = dict(
        zip(
            [(r.trajectory_id, r.turn_index) for r in rows],
            compute_advantages("grpo", [TurnSample(r.trajectory_id, "g", r.turn_index, None, r.trajectory_reward) for r in rows]),
            strict=True,
        )
    )
    assert grpo[("broke", 0)] == grpo[("broke", 1)] > 0
    assert not math.isnan(sum(adv.values()))
