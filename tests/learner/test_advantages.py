"""Advantage estimators: hand-computed tables, a slow loop reference on random inputs, and the shared policy.

The references below are written as plain Python loops straight from the formulas in
the methods' definitions (``docs/methods.md``), independently of the numpy code.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pytest

from learner.advantages import (
    ADVANTAGES,
    AdvantageInputError,
    Advantages,
    Estimator,
    TurnSample,
    UnknownEstimator,
    compute_advantages,
    rank_wins,
    register_advantage,
    tcpo_counterfactual,
    tcpo_hindsight,
    tcpo_retrospective,
)

EPS = 1e-6
NAN = float("nan")


def S(traj: str, turn: int, R: float | None, *, g: str = "g", r: float | None = None, **kw: object) -> TurnSample:
    return TurnSample(trajectory_id=traj, group_id=g, turn_index=turn, reward=r, trajectory_reward=R, **kw)  # type: ignore[arg-type]


def approx(values: Sequence[float], expected: Sequence[float]) -> None:
    assert len(values) == len(expected)
    for v, e in zip(values, expected):
        if e == 0.0:
            assert v == 0.0, (values, expected)  # zeros must be exact
        else:
            assert v == pytest.approx(e, rel=1e-9, abs=1e-12), (values, expected)


# ---------------------------------------------------------------------------------------------------
# Slow loop references


def is_missing(x: float | None) -> bool:
    return x is None or math.isnan(x)


def ref_norm(values: dict[object, list[tuple[int, float]]], n: int, norm_by_std: bool, eps: float = EPS, tol: float = 1e-9) -> list[float]:
    """Group-wise (x - mean) [/ (stdev + eps)]; groups of < 2 or with zero spread -> 0."""
    out = [0.0] * n
    for members in values.values():
        xs = [x for _, x in members]
        if len(xs) < 2:
            continue
        mean = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        if sd <= tol * max(1.0, max(abs(x) for x in xs)):
            continue
        for i, x in members:
            out[i] = (x - mean) / (sd + eps) if norm_by_std else x - mean
    return out


def ref_score(samples: Sequence[TurnSample], tid: str) -> float:
    """The trajectory's score: the sum of its given turn rewards plus its outcome; NaN if it has neither (or a NaN turn reward)."""
    mine = [s for s in samples if s.trajectory_id == tid]
    given = [s.reward for s in mine if s.reward is not None]
    outcome = mine[0].trajectory_reward
    if not given and is_missing(outcome):
        return NAN
    return sum(given) + (0.0 if is_missing(outcome) else outcome)  # type: ignore[operator]


def ref_grpo(samples: Sequence[TurnSample], norm_by_std: bool = True) -> list[float]:
    per_group: dict[object, list[tuple[int, float]]] = defaultdict(list)
    traj_pos: dict[str, int] = {}
    trajs: list[str] = []
    for s in samples:
        if s.trajectory_id not in traj_pos:
            traj_pos[s.trajectory_id] = len(trajs)
            trajs.append(s.trajectory_id)
            score = ref_score(samples, s.trajectory_id)
            if not math.isnan(score):
                per_group[s.group_id].append((traj_pos[s.trajectory_id], score))
    adv_t = ref_norm(per_group, len(trajs), norm_by_std)
    return [adv_t[traj_pos[s.trajectory_id]] for s in samples]


def ref_rloo(samples: Sequence[TurnSample]) -> list[float]:
    rewards: dict[str, dict[str, float]] = defaultdict(dict)
    for s in samples:
        score = ref_score(samples, s.trajectory_id)
        if not math.isnan(score):
            rewards[s.group_id][s.trajectory_id] = score
    out = []
    for s in samples:
        grp = rewards[s.group_id]
        xs = list(grp.values())
        if s.trajectory_id not in grp or len(xs) < 2 or statistics.stdev(xs) <= 1e-9 * max(1.0, max(map(abs, xs))):
            out.append(0.0)
            continue
        others = [x for t, x in grp.items() if t != s.trajectory_id]
        out.append(grp[s.trajectory_id] - sum(others) / len(others))
    return out


def ref_returns(samples: Sequence[TurnSample], gamma: float) -> list[float]:
    by_traj: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_traj[s.trajectory_id].append(i)
    out = [0.0] * len(samples)
    for idxs in by_traj.values():
        idxs.sort(key=lambda i: samples[i].turn_index)
        given = [samples[i].reward for i in idxs]
        outcome = samples[idxs[-1]].trajectory_reward
        # the stream: turn rewards (None -> 0) and the outcome added on the last turn; nothing at all -> unscorable
        stream = [0.0 if x is None else x for x in given]
        stream[-1] += 0.0 if is_missing(outcome) else outcome  # type: ignore[operator]
        if any(x is not None and math.isnan(x) for x in given) or (all(x is None for x in given) and is_missing(outcome)):
            for i in idxs:
                out[i] = NAN
            continue
        for pos, i in enumerate(idxs):
            total = 0.0
            for k in range(pos, len(idxs)):
                total += gamma ** (samples[idxs[k]].turn_index - samples[i].turn_index) * stream[k]  # type: ignore[operator]
            out[i] = total
    return out


def ref_gigpo(samples: Sequence[TurnSample], omega: float, gamma: float, norm_by_std: bool, cross_steps: bool) -> list[float]:
    n = len(samples)
    ret = ref_returns(samples, gamma)
    score = [ref_score(samples, s.trajectory_id) for s in samples]
    valid = [not math.isnan(score[i]) and not math.isnan(ret[i]) for i, s in enumerate(samples)]
    if cross_steps:
        ep_groups: dict[object, list[tuple[int, float]]] = defaultdict(list)
        for i, s in enumerate(samples):
            if valid[i]:
                ep_groups[s.group_id].append((i, score[i]))
        ep = ref_norm(ep_groups, n, norm_by_std)
    else:
        traj_groups: dict[object, list[tuple[int, float]]] = defaultdict(list)
        first: dict[str, int] = {}
        for i, s in enumerate(samples):
            if valid[i] and s.trajectory_id not in first:
                first[s.trajectory_id] = i
                traj_groups[s.group_id].append((i, score[i]))
        ep_first = ref_norm(traj_groups, n, norm_by_std)
        ep = [ep_first[first[s.trajectory_id]] if valid[i] else 0.0 for i, s in enumerate(samples)]
    step_groups: dict[object, list[tuple[int, float]]] = defaultdict(list)
    for i, s in enumerate(samples):
        key = s.state if s.state is not None else s.anchor
        if valid[i] and key is not None:
            step_groups[(s.group_id, key)].append((i, ret[i]))
    st = ref_norm(step_groups, n, norm_by_std)
    return [ep[i] + omega * st[i] for i in range(n)]


def ref_turn_grpo(samples: Sequence[TurnSample], source: str, gamma: float) -> list[float]:
    xs = ref_returns(samples, gamma) if source == "return" else [NAN if s.reward is None else s.reward for s in samples]
    groups: dict[object, list[tuple[int, float]]] = defaultdict(list)
    for i, s in enumerate(samples):
        if not math.isnan(xs[i]):
            groups[(s.group_id, s.turn_index)].append((i, xs[i]))
    return ref_norm(groups, len(samples), True)


def ref_rtpo(samples: Sequence[TurnSample], norm_by_std: bool) -> list[float]:
    base = ref_grpo(samples, norm_by_std)
    ret = ref_returns(samples, 1.0)
    sets: dict[object, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        if s.anchor is not None:
            sets[(s.group_id, s.anchor)].append(i)
    groups: dict[object, list[tuple[int, float]]] = {}
    for key, members in sets.items():
        if len(members) >= 2:
            groups[key] = [(i, ret[i]) for i in members if not math.isnan(ret[i])]
    sib = ref_norm(groups, len(samples), norm_by_std)
    in_set = {i for members in sets.values() if len(members) >= 2 for i in members}
    return [sib[i] if i in in_set else base[i] for i in range(len(samples))]


def ref_tcpo_credit(v: list[float], lambda_h: float, gamma: float, best0: float) -> list[float]:
    credit = []
    for t in range(len(v)):
        best = best0
        for k in range(t):
            best = max(best, v[k])
        retro = v[t] - best
        hind = 0.0
        if retro <= 0:
            for k in range(t + 1, len(v)):
                if v[k] > best:
                    hind = lambda_h * gamma ** (k - t) * (v[k] - best)
                    break
        credit.append(retro + hind)
    return credit


def ref_tcpo(samples: Sequence[TurnSample], cf: dict[tuple[str, int], list[float]], mu: float, lambda_h: float, gamma: float) -> list[float]:
    by_traj: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_traj[s.trajectory_id].append(i)
    groups: dict[object, list[tuple[int, float]]] = defaultdict(list)
    for idxs in by_traj.values():
        idxs.sort(key=lambda i: samples[i].turn_index)
        v = [samples[i].reward for i in idxs]
        outcome = samples[idxs[-1]].trajectory_reward
        if any(x is not None and math.isnan(x) for x in v) or (all(x is None for x in v) and is_missing(outcome)):
            continue
        if v[-1] is None and not is_missing(outcome):
            v[-1] = outcome  # the last turn's missing score: the outcome
        best = 0.0
        for k, x in enumerate(v):  # another missing score: no progress (v = the best so far)
            v[k] = best if x is None else x
            best = max(best, v[k])  # type: ignore[type-var]
        credit = ref_tcpo_credit(v, lambda_h, gamma, 0.0)  # type: ignore[arg-type]
        for pos, i in enumerate(idxs):
            key = (samples[i].trajectory_id, samples[i].turn_index)
            c = credit[pos]
            # an unscored turn is comparable with its one-step alternatives only as its run's last turn (the outcome)
            if key in cf and (samples[i].reward is not None or pos == len(idxs) - 1):
                c = mu * (v[pos] - sum(cf[key]) / len(cf[key])) + (1 - mu) * c  # type: ignore[operator]
            groups[samples[i].group_id].append((i, c))
    return ref_norm(groups, len(samples), True)


def ref_beats(a: tuple[bool, float | None, float], b: tuple[bool, float | None, float], margin: float = 0.0) -> float:
    (ca, sa, na), (cb, sb, nb) = a, b
    if ca != cb:
        return 1.0 if ca else 0.0
    if ca and sa is not None and sb is not None:
        a_gt, b_gt = sa > sb * (1 + margin), sb > sa * (1 + margin)
        if a_gt and not b_gt:
            return 1.0
        if b_gt and not a_gt:
            return 0.0
    if ca and na != nb:  # tokens break ties between correct kernels only
        return 1.0 if na < nb else 0.0
    return 0.5


def ref_rank(samples: Sequence[TurnSample]) -> list[float]:
    """per='trajectory', normalize='center': last turn's correct/score, summed tokens."""
    last: dict[str, TurnSample] = {}
    tokens: dict[str, float] = defaultdict(float)
    for s in samples:
        tokens[s.trajectory_id] += s.n_tokens
        if s.trajectory_id not in last or s.turn_index > last[s.trajectory_id].turn_index:
            last[s.trajectory_id] = s
    groups: dict[str, list[str]] = defaultdict(list)
    for t, s in last.items():
        if s.correct is not None:
            groups[s.group_id].append(t)
    adv: dict[str, float] = {}
    for members in groups.values():
        for t in members:
            if len(members) < 2:
                adv[t] = 0.0
                continue
            me = (bool(last[t].correct), last[t].score, tokens[t])
            wins = sum(ref_beats(me, (bool(last[k].correct), last[k].score, tokens[k])) for k in members if k != t)
            adv[t] = wins / (len(members) - 1) - 0.5
    return [adv.get(s.trajectory_id, 0.0) for s in samples]


def random_samples(rng: random.Random, *, turn_rewards: bool, nan_p: float = 0.1) -> list[TurnSample]:
    out: list[TurnSample] = []
    for g in range(rng.randint(1, 4)):
        for j in range(rng.randint(1, 5)):
            tid = f"g{g}t{j}"
            R: float | None = rng.choice([0.0, 0.5, 1.0, 1.0, 2.0])
            if rng.random() < nan_p:
                R = rng.choice([None, NAN])
            turns = rng.sample(range(6), rng.randint(1, 4))  # gaps in turn indices on purpose
            for t in turns:
                r: float | None = rng.choice([None, 0.0, 0.25, 0.5, 1.0]) if turn_rewards else None
                if turn_rewards and rng.random() < nan_p / 3:
                    r = NAN
                out.append(
                    TurnSample(
                        trajectory_id=tid,
                        group_id=f"g{g}",
                        turn_index=t,
                        reward=r,
                        trajectory_reward=R,
                        n_tokens=rng.choice([5, 10, 20]),
                        correct=rng.choice([True, False, True, None]) if rng.random() > 0.05 else None,
                        score=rng.choice([None, 1.0, 1.5, 2.0]),
                        anchor=rng.choice([None, "s0", "s1", "s2"]),
                    )
                )
    rng.shuffle(out)
    return out


def close(a: Sequence[float], b: Sequence[float]) -> None:
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=1e-9, atol=1e-12)
    assert all(x == 0.0 for x, y in zip(a, b) if y == 0.0), "where the reference is exactly 0 (excluded, zero spread) so is the estimator"


SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
def test_vectorised_matches_loop_reference(seed: int) -> None:
    rng = random.Random(seed)
    plain = random_samples(rng, turn_rewards=False)
    mixed = random_samples(rng, turn_rewards=True)
    close(compute_advantages("grpo", plain), ref_grpo(plain))
    close(compute_advantages("grpo", plain, norm_by_std=False), ref_grpo(plain, norm_by_std=False))
    close(compute_advantages("drgrpo", plain), ref_grpo(plain, norm_by_std=False))
    close(compute_advantages("rloo", plain), ref_rloo(plain))
    for s in (plain, mixed):
        for cross in (True, False):
            for nbs in (True, False):
                got = compute_advantages("gigpo", s, omega=0.7, gamma=0.9, norm_by_std=nbs, cross_steps=cross)
                close(got, ref_gigpo(s, 0.7, 0.9, nbs, cross))
        close(compute_advantages("turn_grpo", s, gamma=0.8), ref_turn_grpo(s, "return", 0.8))
        close(compute_advantages("turn_grpo", s, source="reward"), ref_turn_grpo(s, "reward", 1.0))
        for nbs in (True, False):
            close(compute_advantages("rtpo", s, norm_by_std=nbs), ref_rtpo(s, nbs))
    cf = {(s.trajectory_id, s.turn_index): [rng.random() for _ in range(3)] for s in mixed if rng.random() < 0.3}
    close(compute_advantages("tcpo", mixed, counterfactual_scores=cf, mu=0.6, lambda_h=0.8, gamma=0.7), ref_tcpo(mixed, cf, 0.6, 0.8, 0.7))
    close(compute_advantages("rank", plain), ref_rank(plain))


# ---------------------------------------------------------------------------------------------------
# Registry and the shared policy


def test_registry_holds_every_estimator_and_rejects_duplicates() -> None:
    assert set(ADVANTAGES) == {e.value for e in Estimator} == {"grpo", "drgrpo", "rloo", "gigpo", "turn_grpo", "rtpo", "tcpo", "rank"}
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda samples: (np.zeros(0), None))
    with pytest.raises(UnknownEstimator):
        compute_advantages("ppo", [])
    with pytest.raises(TypeError):
        compute_advantages("grpo", [], no_such_param=1)


def test_empty_input_gives_empty_output_for_every_estimator() -> None:
    for name in ADVANTAGES:
        out = compute_advantages(name, [])
        assert out == [] and out.stats.n_samples == 0 and out.stats.frac_reward_zero_std == 0.0


@pytest.mark.parametrize("name", sorted(Estimator))
def test_zero_variance_group_gives_exactly_zero(name: str) -> None:
    # same outcome, same turn scores, same rank features, shared anchors: nothing to learn in this group
    samples = [
        S(t, k, 0.1 if t != "c" else 0.1 + 5e-13, r=0.4, correct=True, score=1.0, n_tokens=7, anchor=f"s{k}")
        for t in ("a", "b", "c")
        for k in range(2)
    ]
    # TCPO credits change, not levels: flat scores at the starting level (best0) carry no credit
    out = compute_advantages(name, samples, **({"best0": 0.4} if name == "tcpo" else {}))
    assert isinstance(out, Advantages) and isinstance(out, list)
    assert all(v == 0.0 and math.isfinite(v) for v in out), out
    assert out.stats.frac_reward_zero_std == 1.0


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "gigpo", "turn_grpo", "rtpo"])
def test_nan_and_none_trajectory_rewards_are_excluded_and_counted(name: str) -> None:
    samples = [S("a", 0, 1.0), S("a", 1, 1.0), S("b", 0, 0.0), S("c", 0, NAN), S("c", 1, NAN), S("d", 0, None)]
    out = compute_advantages(name, samples)
    assert out[3] == out[4] == out[5] == 0.0
    assert out.n_excluded == out.stats.n_excluded == 3
    # the excluded trajectories do not move the baseline: same as the group without them
    clean = compute_advantages(name, samples[:3])
    assert list(out[:3]) == list(clean)
    assert out[0] > 0 > out[2]


def test_singleton_group_gives_zero() -> None:
    # verl gives a lone response mean 0 / std 1 (its raw reward); we give 0 (module docstring)
    out = compute_advantages("grpo", [S("a", 0, 3.0, g="alone"), S("b", 0, 1.0, g="x"), S("c", 0, 0.0, g="x")])
    assert out[0] == 0.0 and out.stats.n_groups == 2 and out.stats.n_zero_std_groups == 1


def test_input_errors() -> None:
    with pytest.raises(AdvantageInputError, match="two groups"):
        compute_advantages("grpo", [S("a", 0, 1.0, g="g1"), S("a", 1, 1.0, g="g2")])
    with pytest.raises(AdvantageInputError, match="two different trajectory rewards"):
        compute_advantages("grpo", [S("a", 0, 1.0), S("a", 1, 0.0)])
    with pytest.raises(AdvantageInputError, match="twice"):
        compute_advantages("grpo", [S("a", 0, 1.0), S("a", 0, 1.0)])
    with pytest.raises(AdvantageInputError, match="infinite"):
        compute_advantages("grpo", [S("a", 0, math.inf)])
    with pytest.raises(AdvantageInputError):
        compute_advantages("grpo", [S("a", 0, 1.0)], eps=0.0)


# ---------------------------------------------------------------------------------------------------
# GRPO / Dr.GRPO / RLOO tables


def test_grpo_drgrpo_rloo_table() -> None:
    # group g: trajectories a (2 turns), b, c, d with outcomes 1, 0, 0, 1; group h: 3, 1
    samples = [S("a", 0, 1.0), S("a", 1, 1.0), S("b", 0, 0.0), S("c", 0, 0.0), S("d", 0, 1.0), S("e", 0, 3.0, g="h"), S("f", 0, 1.0, g="h")]
    # g: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3); a's two turns count once
    sd_g = math.sqrt(1 / 3)
    # h: mean 2, std sqrt((1 + 1) / 1) = sqrt(2)
    sd_h = math.sqrt(2)
    up, dn = 0.5 / (sd_g + EPS), -0.5 / (sd_g + EPS)
    approx(compute_advantages("grpo", samples), [up, up, dn, dn, up, 1 / (sd_h + EPS), -1 / (sd_h + EPS)])
    # Dr.GRPO: no std
    approx(compute_advantages("drgrpo", samples), [0.5, 0.5, -0.5, -0.5, 0.5, 1.0, -1.0])
    approx(compute_advantages("grpo", samples, norm_by_std=False), [0.5, 0.5, -0.5, -0.5, 0.5, 1.0, -1.0])
    # RLOO: a: 1 - (0 + 0 + 1)/3 = 2/3; b: 0 - (1 + 0 + 1)/3 = -2/3; e: 3 - 1 = 2; f: 1 - 3 = -2
    approx(compute_advantages("rloo", samples), [2 / 3, 2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0])
    # batch std: centred values over the std of all 6 trajectory rewards [1, 0, 0, 1, 3, 1]
    sd_b = statistics.stdev([1, 0, 0, 1, 3, 1])
    approx(
        compute_advantages("grpo", samples, std_scope="batch"),
        [0.5 / (sd_b + EPS)] * 2 + [-0.5 / (sd_b + EPS)] * 2 + [0.5 / (sd_b + EPS), 1 / (sd_b + EPS), -1 / (sd_b + EPS)],
    )


# ---------------------------------------------------------------------------------------------------
# GiGPO


def test_gigpo_table() -> None:
    # a (R=1) and b (R=0) both start in state s0, then diverge; outcome-only rewards sit at the last turn
    samples = [S("a", 0, 1.0, anchor="s0"), S("a", 1, 1.0, anchor="s1"), S("b", 0, 0.0, anchor="s0"), S("b", 1, 0.0, anchor="s2")]
    # episode (mean_norm): mean over 4 turn samples = 0.5 -> a +0.5, b -0.5
    # returns (gamma 0.5): a: [0.5, 1], b: [0, 0]; step group s0 = {a0: 0.5, b0: 0} -> +-0.25; s1, s2 singletons -> 0
    out = compute_advantages("gigpo", samples, gamma=0.5, omega=1.0, norm_by_std=False)
    approx(out, [0.75, 0.5, -0.75, -0.5])
    # omega scales only the step part
    approx(compute_advantages("gigpo", samples, gamma=0.5, omega=2.0, norm_by_std=False), [1.0, 0.5, -1.0, -0.5])
    # mean_std_norm: episode values [1,1,0,0], std sqrt(1/3); s0 values [0.5, 0], std sqrt(0.125)
    e, s = 0.5 / (math.sqrt(1 / 3) + EPS), 0.25 / (math.sqrt(0.125) + EPS)
    approx(compute_advantages("gigpo", samples, gamma=0.5), [e + s, e, -e - s, -e])


def test_gigpo_cross_steps_weights_long_trajectories() -> None:
    # a: 3 turns, R=1; b: 1 turn, R=0; no anchors
    samples = [S("a", 0, 1.0), S("a", 1, 1.0), S("a", 2, 1.0), S("b", 0, 0.0)]
    # cross steps: mean over [1,1,1,0] = 0.75 -> a +0.25, b -0.75 ; per trajectory: mean 0.5 -> +-0.5
    approx(compute_advantages("gigpo", samples, norm_by_std=False), [0.25, 0.25, 0.25, -0.75])
    approx(compute_advantages("gigpo", samples, norm_by_std=False, cross_steps=False), [0.5, 0.5, 0.5, -0.5])


def test_gigpo_counts_turn_rewards_and_the_outcome() -> None:
    # process rewards on the turns and an outcome on the trajectory: both count (the outcome arrives with the last turn)
    samples = [S("a", 0, 1.0, r=0.0, anchor="x"), S("a", 1, 1.0, r=1.0), S("b", 0, 0.0, r=0.5, anchor="x"), S("b", 1, 0.0, r=0.0)]
    # streams a [0, 1 + 1], b [0.5, 0 + 0]; returns (gamma 1) a [2, 2], b [0.5, 0]; scores a 2, b 0.5
    # episode (cross steps, mean_norm): [2, 2, 0.5, 0.5] mean 1.25 -> a +0.75, b -0.75
    # step: anchor x = {a0: 2, b0: 0.5} -> +-0.75; the turn-1 anchors are singletons -> 0
    approx(compute_advantages("gigpo", samples, gamma=1.0, norm_by_std=False), [1.5, 0.75, -1.5, -0.75])
    # with the old rule (outcome dropped once a turn reward exists) a0 and b0 would get returns 1 and 0.5 and the
    # episode level the outcomes 1 / 0: [0.75, 0.5, -0.75, -0.5]
    assert list(compute_advantages("gigpo", samples, gamma=1.0, norm_by_std=False)) != pytest.approx([0.75, 0.5, -0.75, -0.5])


def test_gigpo_compares_trajectories_that_reach_one_state_by_different_paths() -> None:
    # A: S -> Y -> W (success), B: S -> X -> Y (failure). Both act in state Y, A at turn 1 and B at turn 2, with
    # different histories, so their exact contexts differ there; GiGPO's anchor is the state, not the context
    def samples(with_states: bool) -> list[TurnSample]:
        states = {"A": ["S", "Y", "W"], "B": ["S", "X", "Y"]}
        return [
            S(t, k, 1.0 if t == "A" else 0.0, anchor=f"ctx-{t}-{k}" if k else "ctx-0", state=states[t][k] if with_states else None)
            for t in ("A", "B")
            for k in range(3)
        ]

    # returns (gamma 1, outcome only): A [1, 1, 1], B [0, 0, 0]; episode (cross steps): six entries, mean 0.5,
    # std sqrt(6 * 0.25 / 5) = sqrt(0.3); step groups: S = {A0, B0} and Y = {A1, B2}: +-0.5 / (sqrt(0.5) + eps)
    ep = 0.5 / (math.sqrt(0.3) + EPS)
    st = 0.5 / (math.sqrt(0.5) + EPS)
    approx(compute_advantages("gigpo", samples(True), gamma=1.0), [ep + st, ep + st, ep, -ep - st, -ep, -ep - st])
    # on exact contexts (the old anchor) only the shared first turn matches; the revisited state is never compared
    approx(compute_advantages("gigpo", samples(False), gamma=1.0), [ep + st, ep, ep, -ep - st, -ep, -ep])


def test_turn_level_returns_add_the_outcome_to_process_rewards() -> None:
    # a two-turn task where the process score of turn 0 is the same (1) for both, and only the outcome differs:
    # the first turn's return must carry the outcome, or turn 0 gets no credit at all
    samples = [S("a", 0, 1.0, r=1.0), S("a", 1, 1.0, r=0.0), S("b", 0, 0.0, r=1.0), S("b", 1, 0.0, r=0.0)]
    # returns gamma 1: a [1 + 0 + 1, 0 + 1] = [2, 1], b [1, 0]; per turn index: turn 0 {2, 1}, turn 1 {1, 0}
    # std of two values d apart is d / sqrt(2): A = +-0.5 / (sqrt(0.5) + eps)
    x = 0.5 / (math.sqrt(0.5) + EPS)
    approx(compute_advantages("turn_grpo", samples), [x, x, -x, -x])
    # gamma 0.5: a [1 + 0.5 * 1, 1], b [1, 0] -> turn 0 {1.5, 1}: +-0.25 / (sqrt(0.125) + eps)
    y = 0.25 / (math.sqrt(0.125) + EPS)
    approx(compute_advantages("turn_grpo", samples, gamma=0.5), [y, x, -y, -x])
    # RTPO siblings (one anchor at turn 0) score their continuations the same way
    sib = [S("a", 0, 1.0, r=1.0, anchor="c"), S("a", 1, 1.0, r=0.0), S("b", 0, 0.0, r=1.0, anchor="c"), S("b", 1, 0.0, r=0.0)]
    out = compute_advantages("rtpo", sib)
    assert out[0] == pytest.approx(x) and out[2] == pytest.approx(-x)
    # and trajectory-level GRPO scores each trajectory by its stream's sum (a 2, b 1): the turn rewards do not erase R
    approx(compute_advantages("grpo", samples), [x, x, -x, -x])


def test_turn_rewards_alone_score_a_trajectory() -> None:
    # live chat rated turn by turn (feedback on completions, no outcome): GRPO trains on it instead of excluding it
    samples = [S("a", 0, None, r=1.0), S("b", 0, None, r=0.0), S("c", 0, None)]
    out = compute_advantages("grpo", samples, norm_by_std=False)
    approx(out, [0.5, -0.5, 0.0])
    assert out.n_excluded == 1  # c has no reward at all


# ---------------------------------------------------------------------------------------------------
# turn_grpo


def test_turn_grpo_table() -> None:
    # turn rewards: a [1, 0], b [0, 1], c [0.5, 1]
    samples = [
        S("a", 0, 1.0, r=1.0),
        S("a", 1, 1.0, r=0.0),
        S("b", 0, 1.0, r=0.0),
        S("b", 1, 1.0, r=1.0),
        S("c", 0, 1.0, r=0.5),
        S("c", 1, 1.0, r=1.0),
    ]
    # turn 0: [1, 0, 0.5] mean 0.5 std 0.5 ; turn 1: [0, 1, 1] mean 2/3 std sqrt(1/3)
    s1 = math.sqrt(1 / 3) + EPS
    out = compute_advantages("turn_grpo", samples, source="reward")
    approx(out, [0.5 / (0.5 + EPS), (-2 / 3) / s1, -0.5 / (0.5 + EPS), (1 / 3) / s1, 0.0, (1 / 3) / s1])
    # returns with gamma 1 from the turn rewards: a [1, 0], b [1, 1], c [1.5, 1]
    # turn 0: [1, 1, 1.5] mean 7/6, std sqrt(1/12); turn 1: [0, 1, 1] as above
    s0 = math.sqrt(1 / 12) + EPS
    approx(
        compute_advantages("turn_grpo", samples, gamma=1.0), [(-1 / 6) / s0, (-2 / 3) / s1, (-1 / 6) / s0, (1 / 3) / s1, (1 / 3) / s0, (1 / 3) / s1]
    )


def test_turn_grpo_on_outcomes_groups_by_turn_index() -> None:
    # outcome-only: a (R=1, 2 turns), b (R=0, 2 turns), c (R=1, 1 turn)
    samples = [S("a", 0, 1.0), S("a", 1, 1.0), S("b", 0, 0.0), S("b", 1, 0.0), S("c", 0, 1.0)]
    # turn 0: [1, 0, 1] mean 2/3 std sqrt(1/3); turn 1: [1, 0] mean 0.5 std sqrt(0.5)
    s0, s1 = math.sqrt(1 / 3) + EPS, math.sqrt(0.5) + EPS
    approx(compute_advantages("turn_grpo", samples), [(1 / 3) / s0, 0.5 / s1, (-2 / 3) / s0, -0.5 / s1, (1 / 3) / s0])
    # a turn with no reward is excluded under source="reward"
    assert compute_advantages("turn_grpo", samples, source="reward").n_excluded == 5


# ---------------------------------------------------------------------------------------------------
# RTPO


def test_rtpo_sibling_table() -> None:
    # backbone a (turns 0-2, R=1) and b (turns 0-1, R=0); a's turn 1 is a branch point "ctx-a1" with two
    # siblings s1 (turns 1-2, R=0) and s2 (turn 1, R=0) re-rolled from the same stored context
    samples = [
        S("a", 0, 1.0),
        S("a", 1, 1.0, anchor="ctx-a1"),
        S("a", 2, 1.0),
        S("b", 0, 0.0),
        S("b", 1, 0.0),
        S("s1", 1, 0.0, anchor="ctx-a1"),
        S("s1", 2, 0.0),
        S("s2", 1, 0.0, anchor="ctx-a1"),
    ]
    # sibling set {a1: 1, s1: 0, s2: 0}: mean 1/3 -> +2/3, -1/3, -1/3
    # other turns: trajectory GRPO over {a: 1, b: 0, s1: 0, s2: 0}: mean 0.25 -> a +0.75, b and s1 -0.25
    out = compute_advantages("rtpo", samples, norm_by_std=False)
    approx(out, [0.75, 2 / 3, 0.75, -0.25, -0.25, -1 / 3, -0.25, -1 / 3])
    # with std: sibling std sqrt(1/3), trajectory std 0.5
    sib, traj = math.sqrt(1 / 3) + EPS, 0.5 + EPS
    out = compute_advantages("rtpo", samples)
    approx(out, [0.75 / traj, (2 / 3) / sib, 0.75 / traj, -0.25 / traj, -0.25 / traj, (-1 / 3) / sib, -0.25 / traj, (-1 / 3) / sib])


def test_rtpo_zero_variance_sibling_set_is_zero() -> None:
    samples = [S("a", 0, 1.0), S("a", 1, 1.0, anchor="k"), S("b", 0, 0.0), S("s", 1, 1.0, anchor="k")]
    out = compute_advantages("rtpo", samples)
    assert out[1] == out[3] == 0.0 and out[0] > 0 > out[2]


@pytest.mark.parametrize("seed", range(15))
def test_rtpo_without_branches_is_trajectory_grpo(seed: int) -> None:
    rng = random.Random(1000 + seed)
    samples = [TurnSample(**{**s.__dict__, "anchor": None}) for s in random_samples(rng, turn_rewards=False)]
    for nbs in (True, False):
        assert list(compute_advantages("rtpo", samples, norm_by_std=nbs)) == list(compute_advantages("grpo", samples, norm_by_std=nbs))
    # m = 1: every anchor unique (a branch with one sibling is no branch) -> still GRPO
    single = [TurnSample(**{**s.__dict__, "anchor": f"u{i}"}) for i, s in enumerate(samples)]
    assert list(compute_advantages("rtpo", single)) == list(compute_advantages("grpo", samples))


# ---------------------------------------------------------------------------------------------------
# TCPO


def test_tcpo_monotone_scores_all_progress_no_hindsight() -> None:
    v = [0.2, 0.5, 0.9]
    retro = tcpo_retrospective(v)
    assert np.allclose(retro, [0.2, 0.3, 0.4]) and (retro > 0).all()
    assert (tcpo_hindsight(v) == 0.0).all()


def test_tcpo_flat_then_jump_gives_hindsight_to_flat_turns_only() -> None:
    v = [0.3, 0.3, 0.3, 1.0]
    retro = tcpo_retrospective(v)
    hind = tcpo_hindsight(v, lambda_h=1.0, gamma=0.5)
    assert np.allclose(retro, [0.3, 0.0, 0.0, 0.7])
    # turn 1: best so far 0.3, first better turn 3 -> 0.5^2 * 0.7; turn 2: 0.5 * 0.7; improving turns get none
    assert np.allclose(hind, [0.0, 0.175, 0.35, 0.0])
    assert hind[0] == 0.0 and hind[3] == 0.0 and (hind[1:3] > 0).all()
    # as advantages: one trajectory, credit [0.3, 0.175, 0.35, 0.7] normalised over its 4 turns
    credit = [0.3, 0.175, 0.35, 0.7]
    mean, sd = statistics.mean(credit), statistics.stdev(credit)
    out = compute_advantages("tcpo", [S("a", t, 1.0, r=x) for t, x in enumerate(v)], gamma=0.5)
    approx(out, [(c - mean) / (sd + EPS) for c in credit])
    assert out[3] == max(out) and out[2] > out[1]  # the jump is best; the flat turn nearer the payoff gets more


def test_tcpo_regressing_scores_get_negative_credit() -> None:
    v = [0.8, 0.5, 0.3]
    retro = tcpo_retrospective(v)
    assert np.allclose(retro, [0.8, -0.3, -0.5]) and (retro[1:] < 0).all()
    assert (tcpo_hindsight(v) == 0.0).all()  # no later turn beats 0.8: no delayed payoff
    # regress then recover: the regression is partly redeemed by hindsight (0.5 * (0.9 - 0.5) = 0.2)
    v2 = [0.5, 0.2, 0.9]
    # (turn 2 progresses by 0.9 - best 0.5 = 0.4)
    assert np.allclose(tcpo_retrospective(v2) + tcpo_hindsight(v2, gamma=0.5), [0.5, -0.1, 0.4])
    out = compute_advantages("tcpo", [S("a", t, 0.0, r=x) for t, x in enumerate(v)])
    assert out[0] > 0 > out[1] > out[2]


def test_tcpo_counterfactual() -> None:
    assert tcpo_counterfactual(0.3, [0.1, 0.2]) == pytest.approx(0.15)
    with pytest.raises(AdvantageInputError):
        tcpo_counterfactual(0.3, [])
    # a counterfactual replaces (mu=1) or mixes into (mu=0.5) the turn's credit; two trajectories in one group
    samples = [S("a", 0, 0.0, r=0.3), S("a", 1, 0.0, r=0.3), S("b", 0, 0.0, r=0.0), S("b", 1, 0.0, r=0.6)]
    cf = {("a", 1): [0.1, 0.2]}
    # credits: a [0.3, 0 + hind 0] -> turn 1 replaced by 0.15 ; b [0 + 0.9*0.6, 0.6]
    for mu, a1 in ((1.0, 0.15), (0.5, 0.075)):
        credit = [0.3, a1, 0.9 * 0.6, 0.6]
        mean, sd = statistics.mean(credit), statistics.stdev(credit)
        approx(compute_advantages("tcpo", samples, counterfactual_scores=cf, mu=mu), [(c - mean) / (sd + EPS) for c in credit])


def test_tcpo_fills_missing_scores_and_excludes_only_unscorable_trajectories() -> None:
    # a [0.2, 0.9]; b [0.5, None] with outcome 0 -> the last turn takes the outcome: [0.5, 0.0]; c has a NaN score: excluded
    samples = [S("a", 0, 0.0, r=0.2), S("a", 1, 0.0, r=0.9), S("b", 0, 0.0, r=0.5), S("b", 1, 0.0, r=None), S("c", 0, 0.0, r=NAN)]
    out = compute_advantages("tcpo", samples)
    # credits (lambda 1, gamma 0.9, best0 0): a retro [0.2, 0.7], no hindsight; b retro [0.5, -0.5], nothing later
    credit = [0.2, 0.7, 0.5, -0.5]
    mean, sd = statistics.mean(credit), statistics.stdev(credit)
    approx(out, [(c - mean) / (sd + EPS) for c in credit] + [0.0])
    assert out.n_excluded == 1


def test_tcpo_falls_back_to_the_outcome_when_turns_have_no_score() -> None:
    # a task without per-turn verifier scores: TCPO still trains (it used to exclude every trajectory)
    samples = [S("d", 0, 1.0), S("d", 1, 1.0), S("e", 0, 0.0), S("e", 1, 0.0)]
    # d: v = [best0 = 0, outcome 1] -> retro [0, 1]; turn 0 did not improve, turn 1 beat best_0 = 0 by 1:
    #    hind_0 = lambda * gamma^1 * (1 - 0) = 0.9 -> credit [0.9, 1.0]; e: v = [0, 0] -> credit [0, 0]
    credit = [0.9, 1.0, 0.0, 0.0]
    mean, sd = statistics.mean(credit), statistics.stdev(credit)
    out = compute_advantages("tcpo", samples)
    approx(out, [(c - mean) / (sd + EPS) for c in credit])
    assert out.n_excluded == 0


def test_tcpo_counterfactual_compares_like_with_like_when_turns_have_no_score() -> None:
    # no per-turn scores: d's turn 0 has v_0 = best0 = 0 (a fill-in, not a measurement) while its one-step alternatives
    # are scored by their truncated runs' outcome. Equally good alternatives (1.0 each) used to give
    # cf_0 = 0 - 1 = -1 and, with mu=1, replace d's credit 0.9 -> credits [-1, 1, 0, 0]: A_d0 = -1 / sqrt(2/3) = -1.22.
    # Now an unscored non-final turn has no comparable value: its counterfactual is skipped (retro + hind kept).
    samples = [S("d", 0, 1.0), S("d", 1, 1.0), S("e", 0, 0.0), S("e", 1, 0.0)]
    cf = {("d", 0): [1.0, 1.0], ("d", 1): [1.0, 1.0]}
    # d's last turn: v_1 = outcome 1 and its one-step alternatives end the run too (same measure): cf_1 = 1 - 1 = 0
    credit = [0.9, 0.0, 0.0, 0.0]
    mean, sd = 0.225, 0.45  # ss = 0.675^2 + 3 * 0.225^2 = 0.6075; sd = sqrt(0.6075 / 3) = 0.45
    out = compute_advantages("tcpo", samples, counterfactual_scores=cf, mu=1.0)
    approx(out, [(c - mean) / (sd + EPS) for c in credit])
    assert out[0] == pytest.approx(1.5, abs=1e-5)  # the successful run's first turn keeps its positive credit
    # only d's turn 0 alternatives: credits [0.9, 1, 0, 0] as without counterfactuals (A_d0 = 0.425 / 0.55 = +0.77)
    approx(compute_advantages("tcpo", samples, counterfactual_scores={("d", 0): [1.0, 1.0]}, mu=1.0), compute_advantages("tcpo", samples))
    assert compute_advantages("tcpo", samples, counterfactual_scores={("d", 0): [1.0, 1.0]})[0] == pytest.approx(0.425 / 0.55, abs=1e-5)


# ---------------------------------------------------------------------------------------------------
# LEAP rank rewards


def test_rank_table() -> None:
    # A correct 2.0x 100 tok; B correct 2.0x 50 tok; C correct 1.0x 10 tok; D incorrect (its 5.0x ignored) 10 tok
    # A: loses to B (tokens), beats C (speed), beats D (correct) -> 2
    # B: beats A, C, D -> 3 ; C: beats D -> 1 ; D: 0 ; total 6 = 4*3/2
    wins = rank_wins([True, True, True, False], [2.0, 2.0, 1.0, 5.0], [100, 50, 10, 10])
    assert wins.tolist() == [2.0, 3.0, 1.0, 0.0]
    samples = [
        S("A", 0, 1.0, correct=True, score=2.0, n_tokens=100),
        S("B", 0, 1.0, correct=True, score=2.0, n_tokens=50),
        S("C", 0, 1.0, correct=True, score=1.0, n_tokens=10),
        S("D", 0, 0.0, correct=False, score=5.0, n_tokens=10),
    ]
    # r = wins / 3 = [2/3, 1, 1/3, 0]; A = r - 0.5
    approx(compute_advantages("rank", samples), [1 / 6, 0.5, -1 / 6, -0.5])
    r = [2 / 3, 1.0, 1 / 3, 0.0]
    mean, sd = statistics.mean(r), statistics.stdev(r)
    approx(compute_advantages("rank", samples, normalize="std"), [(x - mean) / (sd + EPS) for x in r])
    # score_when_incorrect only compares scores between two incorrect entries; with one incorrect entry nothing changes
    assert rank_wins([True, True, True, False], [2.0, 2.0, 1.0, 5.0], [100, 50, 10, 10], score_when_incorrect=True).tolist() == [2.0, 3.0, 1.0, 0.0]


def test_rank_ties_margin_and_multi_turn() -> None:
    # full tie 0.5 each
    assert rank_wins([True, True], [1.0, 1.0], [5, 5]).tolist() == [0.5, 0.5]
    # within the 10 % margin the speeds tie, so the shorter one wins
    assert rank_wins([True, True], [1.0, 1.05], [5, 9], margin=0.1).tolist() == [1.0, 0.0]
    assert rank_wins([True, True], [1.0, 1.05], [5, 9]).tolist() == [0.0, 1.0]
    # both incorrect: scores ignored by default, and tokens do not break the tie (brevity of a failure earns nothing)
    assert rank_wins([False, False], [9.0, 1.0], [20, 10]).tolist() == [0.5, 0.5]
    assert rank_wins([False, False], [9.0, 1.0], [20, 10], score_when_incorrect=True).tolist() == [1.0, 0.0]
    # per trajectory: the last turn decides correctness, tokens are summed over turns (a: 30, b: 25)
    samples = [
        S("a", 0, 1.0, correct=False, n_tokens=10),
        S("a", 1, 1.0, correct=True, score=1.0, n_tokens=20),
        S("b", 0, 1.0, correct=True, score=1.0, n_tokens=25),
        S("x", 0, 1.0, correct=None),  # no verdict: excluded
    ]
    out = compute_advantages("rank", samples)
    approx(out, [-0.5, -0.5, 0.5, 0.0])
    assert out.n_excluded == 1
    # per turn: turn 0 is {a0 incorrect, b0 correct, x excluded}, turn 1 is {a1} alone -> 0
    approx(compute_advantages("rank", samples, per="turn"), [-0.5, 0.0, 0.5, 0.0])


def test_rank_all_wrong_group_has_zero_advantage() -> None:
    # four failing kernels of different lengths: nobody beats anybody, so nothing is learned from this group
    # (with the token tie-break between failures, the shortest failure would get +0.5 and the longest -0.5)
    samples = [S(f"k{i}", 0, 0.0, correct=False, n_tokens=n) for i, n in enumerate([10, 40, 80, 200])]
    out = compute_advantages("rank", samples)
    assert list(out) == [0.0, 0.0, 0.0, 0.0]
    assert list(compute_advantages("rank", samples, normalize="std")) == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("seed", range(20))
def test_rank_wins_sum_and_permutation_invariance(seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = int(rng.integers(2, 10))
    correct = rng.random(g) < 0.6
    score = [float(x) if rng.random() < 0.8 else None for x in rng.choice([0.5, 1.0, 1.5], size=g)]
    tokens = rng.choice([10, 20, 30], size=g).tolist()
    wins = rank_wins(correct.tolist(), score, tokens, margin=float(rng.choice([0.0, 0.2])))
    assert wins.sum() == g * (g - 1) / 2 and (wins >= 0).all() and (wins <= g - 1).all()
    samples = [S(f"t{i}", 0, 1.0, correct=bool(correct[i]), score=score[i], n_tokens=tokens[i]) for i in range(g)]
    base = dict(zip((s.trajectory_id for s in samples), compute_advantages("rank", samples)))
    assert sum(base.values()) == pytest.approx(0.0, abs=1e-12)
    for _ in range(5):
        perm = rng.permutation(g)
        shuffled = [samples[i] for i in perm]
        assert rank_wins([bool(correct[i]) for i in perm], [score[i] for i in perm], [tokens[i] for i in perm]).tolist() == [
            rank_wins(correct.tolist(), score, tokens)[i] for i in perm
        ]
        out = compute_advantages("rank", shuffled)
        assert {s.trajectory_id: a for s, a in zip(shuffled, out)} == base


def test_rank_all_tie_group_is_exactly_zero() -> None:
    samples = [S(f"t{i}", 0, 1.0, correct=True, score=1.5, n_tokens=12) for i in range(7)]
    out = compute_advantages("rank", samples)
    assert list(out) == [0.0] * 7 and out.stats.frac_reward_zero_std == 1.0
