"""RODS's replay pool: boundary scores on hand-made reward tables, eviction, and priority sampling on a seeded pool."""

from __future__ import annotations

import math

import pytest

from learner.rods import ItemRef, ReplayPool, boundary_score


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [
        ([1, 0, 1, 0], 1.0),  # p = 1/2: Var = 1/4, the Popoviciu maximum
        ([1, 1, 1, 0], 0.75),  # p = 3/4: Var = 3/16
        ([1, 0, 0, 0, 0, 0, 0, 0], 4 * (1 / 8) * (7 / 8)),  # 0.4375
        ([1, 1, 1, 1], 0.0),  # mastered
        ([0, 0, 0, 0], 0.0),  # hopeless
        ([0.2, 0.6], 4 * 0.04),  # partial credit: mean 0.4, Var 0.04
        ([0.5, 0.5], 0.0),
        ([1], 0.0),  # one rollout: no variance to read
        ([], 0.0),
    ],
)
def test_boundary_score_is_four_times_the_population_variance(rewards, expected):
    assert boundary_score(rewards) == pytest.approx(expected)


def refs(*pairs: tuple[int, int]) -> list[ItemRef]:
    return [ItemRef(i, s) for i, s in pairs]


def test_zero_variance_variants_are_evicted_after_patience_visits_and_seeds_never():
    pool = ReplayPool(capacity=10, patience=2)
    seed, v1, v2 = ItemRef(0, 0), ItemRef(1, 7), ItemRef(2, 7)
    pool.add_seeds([seed])
    assert pool.add_variants([v1, v2], parent=seed) == 2
    assert pool.observe(v1, [1, 1, 1, 1]) == 0.0 and v1 in pool  # one zero-variance visit: patience 2 keeps it
    assert pool.observe(v1, [1, 0, 1, 1]) == 0.75 and v1 in pool  # a boundary visit resets the streak
    pool.observe(v1, [1, 1, 1, 1])
    assert v1 in pool
    pool.observe(v1, [0, 0, 0, 0])
    assert v1 not in pool  # two zero-variance visits in a row: evicted
    for _ in range(5):
        pool.observe(seed, [0, 0, 0, 0])
    assert seed in pool and pool.items[seed.key].zero_streak == 5  # seeds stay eligible
    assert seed in pool.sample(5)


def test_a_full_pool_makes_room_by_evicting_the_longest_zero_streak_then_the_oldest():
    pool = ReplayPool(capacity=3, patience=5)
    pool.add_seeds(refs((0, 0)))
    a, b = ItemRef(1, 9), ItemRef(2, 9)
    pool.add_variants([a])
    pool.end_update()
    pool.add_variants([b])
    pool.observe(a, [1, 0])  # b = 1: the boundary
    pool.observe(b, [1, 1])  # zero variance once
    c = ItemRef(3, 9)
    assert pool.add_variants([c]) == 1
    assert b not in pool and a in pool and c in pool  # b had the zero-variance streak
    d = ItemRef(4, 9)
    assert pool.add_variants([d]) == 1
    assert a not in pool and c in pool  # no streaks left: the oldest (a entered an update before c) goes
    only_seeds = ReplayPool(capacity=1)
    only_seeds.add_seeds(refs((0, 0)))
    assert only_seeds.add_variants([ItemRef(5, 9)]) == 0 and len(only_seeds) == 1  # seeds are never displaced
    assert only_seeds.end_update()["rejected_full"] == 1


def test_duplicates_do_not_enter_twice():
    pool = ReplayPool()
    pool.add_seeds(refs((0, 0), (1, 0)))
    assert pool.add_seeds(refs((0, 0))) == 0
    assert pool.add_variants(refs((1, 0), (2, 5), (2, 5))) == 1
    assert len(pool) == 3


def test_priority_sampling_follows_boundary_scores_on_a_seeded_pool():
    # b = 1, 0.5, 0 with floor 0.05: P(first pick) = 1.05 : 0.55 : 0.05 of 1.65; an unvisited item counts as b = 1
    pool = ReplayPool(floor=0.05, seed=123)
    hi, mid, zero = ItemRef(0, 0), ItemRef(1, 0), ItemRef(2, 0)
    pool.add_seeds([hi, mid, zero])
    pool.observe(hi, [1, 0])
    assert pool.observe(mid, [0, 0.5, 1, 0.5]) == pytest.approx(0.5)  # mean 0.5, Var 1/8
    pool.observe(zero, [1, 1])
    n = 6000
    counts = {hi.key: 0, mid.key: 0, zero.key: 0}
    for _ in range(n):
        counts[pool.sample(1)[0].key] += 1
    for ref, w in ((hi, 1.05), (mid, 0.55), (zero, 0.05)):
        p = w / 1.65
        assert abs(counts[ref.key] / n - p) < 4 * math.sqrt(p * (1 - p) / n), (ref, counts)
    assert sorted(r.key for r in pool.sample(10)) == sorted([hi.key, mid.key, zero.key])  # without replacement
    fresh = ReplayPool(floor=0.05, seed=1)
    fresh.add_seeds([ItemRef(7, 0)])
    assert fresh.items["0/7"].priority(0.05, 1.0) == pytest.approx(1.05)  # unvisited: b counts as 1
    same = [ReplayPool(seed=5) for _ in range(2)]
    for p_ in same:
        p_.add_seeds(refs(*((i, 0) for i in range(20))))
    assert same[0].sample(5) == same[1].sample(5)  # seeded: reproducible


def test_update_figures_and_boundary_set():
    pool = ReplayPool(patience=9)
    items = refs((0, 0), (1, 0), (2, 0), (3, 0))
    pool.add_seeds(items)
    for ref, rewards in zip(items, ([1, 0], [1, 1], [0, 0], [1, 1, 1, 0])):
        pool.observe(ref, rewards)  # b = 1, 0, 0, 0.75
    assert pool.boundary(0.5) == [items[0], items[3]]
    fig = pool.end_update()
    assert fig["visited"] == 4 and fig["zero_variance_fraction"] == 0.5
    assert fig["boundary_histogram"] == [2, 0, 0, 2]  # [0, .25): two zeros; [.75, 1]: 0.75 and 1
    assert pool.end_update()["visited"] == 0  # a new update starts from zero


def test_the_pool_round_trips_through_json():
    import json

    pool = ReplayPool(capacity=5, seed=3)
    pool.add_seeds(refs((0, 0), (1, 0)))
    pool.add_variants(refs((4, 77)), parent=ItemRef(0, 0))
    pool.observe(ItemRef(0, 0), [1, 0])
    back = ReplayPool.from_dict(json.loads(json.dumps(pool.to_dict())), patience=2, floor=0.05, exponent=1.0)
    assert {k: (v.is_seed, v.boundary, v.parent) for k, v in back.items.items()} == {
        k: (v.is_seed, v.boundary, v.parent) for k, v in pool.items.items()
    }
    assert back.sample(3) == pool.sample(3)  # the sampling RNG's state rides along


# ---- issue 39: the reward scale and independent rollouts -------------------------------------------


@pytest.mark.parametrize(
    ("rewards", "reward_range", "expected"),
    [
        # b = Var / ((r_max - r_min)^2 / 4) over the stated range: no saturation outside [0, 1]
        ([0, 2, 0, 2], (0.0, 2.0), 1.0),  # Var 1 over a range of 2: the Popoviciu maximum
        ([0.5, 1.5, 0.5, 1.5], (0.0, 2.0), 0.25),  # Var 1/4 over a range of 2 (4 * Var would say 1.0: saturated)
        ([-0.5, 0.5], (-1.0, 1.0), 0.25),  # negative rewards: Var 1/4 over a range of 2
        ([0.3, 1.8], (0.0, 3.0), 0.25),  # mean 1.05, Var 0.75^2 = 0.5625 over 3^2 / 4 = 2.25
        # rewards outside the stated range widen it: [0, 1] -> [0, 1.8], 0.5625 / (1.8^2 / 4) = 0.5625 / 0.81
        ([0.3, 1.8], (0.0, 1.0), 0.5625 / 0.81),
        ([1, 0, 1, 0], (0.0, 1.0), 1.0),  # [0, 1] rewards keep 4 * Var
    ],
)
def test_boundary_score_is_normalised_by_the_reward_range(rewards, reward_range, expected):
    assert boundary_score(rewards, reward_range=reward_range) == pytest.approx(expected)
    assert boundary_score(rewards, reward_range=reward_range) <= 1.0


def test_the_pool_scores_on_the_reward_range_seen_so_far_and_keeps_it():
    # Kevin-style uncapped rewards: A's spread 0..2 sets the scale [0, 2] (b = 1); B's narrower spread then scores
    # Var 1/4 / (2^2 / 4) = 0.25, not the clipped 4 * Var = 1.0 that made A and B look alike
    pool = ReplayPool(reward_range=(0.0, 1.0))
    a, b = ItemRef(0, 0), ItemRef(1, 0)
    pool.add_seeds([a, b])
    assert pool.observe(a, [0, 2, 0, 2]) == pytest.approx(1.0)
    assert pool.observe(b, [0.5, 1.5, 0.5, 1.5]) == pytest.approx(0.25)
    assert pool.boundary(0.5) == [a]
    import json

    back = ReplayPool.from_dict(json.loads(json.dumps(pool.to_dict())), patience=2, floor=0.05, exponent=1.0)
    assert back.reward_range == (0.0, 2.0)
    with pytest.raises(ValueError):
        ReplayPool(reward_range=(1.0, 1.0))


def _tree():
    from learner.patr import Node, NodeRun, Tree

    def node(i, parent, depth, reward=None):
        return Node(i, parent, depth, NodeRun(f"t{i}", 1, reward is not None, reward), leaf_reward=reward)

    # two independent root runs. Root 0 was forked into three children that all succeed (leaves 2, 3, 4: reward 1);
    # root 1 went on without a fork and failed (leaf 5: reward 0). Leaves 2-4 share root 0's prefix: one root run.
    nodes = {0: node(0, None, 1), 1: node(1, None, 1), 2: node(2, 0, 2, 1.0), 3: node(3, 0, 2, 1.0), 4: node(4, 0, 2, 1.0), 5: node(5, 1, 2, 0.0)}
    nodes[0].children, nodes[1].children = [2, 3, 4], [5]
    return Tree(nodes=nodes, leaves=[2, 3, 4, 5], fork_points=[0])


def test_patr_boundary_score_uses_one_leaf_per_independent_root_run(tmp_path, monkeypatch):
    # the leaves [1, 1, 1, 0] would give 4 * Var = 4 * 3/16 = 0.75: three correlated leaves under one fork counted as
    # three samples. One leaf per root run (its first child at every fork: an unselected policy continuation):
    # [1 (leaf 2), 0 (leaf 5)] -> p = 1/2, b = 4 * 1/4 = 1.0
    import learner.sources as src
    from learner.config import LearnerSettings, RodsConfig

    settings = LearnerSettings(family="fam", rollouts="patr", rods=RodsConfig(enabled=True, seeds=1, items_per_update=1, variants=0))
    monkeypatch.setattr(src, "RuntimeStepper", lambda *a, **k: None)
    monkeypatch.setattr(src, "grow_tree", lambda *a, **k: _tree())
    monkeypatch.setattr(src, "read_nodes", lambda *a, **k: {})
    sources = src.RolloutSources(settings, tmp_path, "http://x", None, agent="a", store=None, family="fam")  # type: ignore[arg-type]
    _, _, info = sources.round(None, 1, {})
    assert sources.pool is not None and sources.pool.items[ItemRef(0, 0).key].boundary == pytest.approx(1.0)
    assert info["rods"]["boundary_histogram"] == [0, 0, 0, 1]
    assert src.independent_leaf_rewards(_tree()) == [1.0, 0.0]
