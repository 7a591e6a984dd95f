"""Experiments in process, on a real SQLite store and a real adapter registry (the engine load is the
only fake, at the engine edge): creation rules, rollback, no decision below min_samples, routing of a
stopped arm, persistence."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from learner.records import Reward, Turn
from learner.records.store import SqliteStore
from runtime.adapters.experiments import ExperimentConfig, ExperimentError, Experiments
from runtime.adapters.names import AdapterRef
from runtime.adapters.registry import AdapterRegistry


async def _noop_load(ref: AdapterRef) -> None:
    return None


async def _noop_unload(name: str) -> None:
    return None


def registry_with(*names: str) -> AdapterRegistry:
    reg = AdapterRegistry(max_loaded=8, load_fn=_noop_load, unload_fn=_noop_unload)

    async def main() -> None:
        for i, n in enumerate(names):
            fam, ver = n.split("@")
            await reg.register(AdapterRef(fam, int(ver), f"/tmp/{n}"), make_alias=i == 0)

    asyncio.run(main())
    return reg


def add_rewards(
    store: SqliteStore, adapter: str, values: list[float], start: int, *, source: str = "verifier:exact", owner: str = "public", target: str = "turn"
) -> None:
    turns = [
        Turn(
            turn_id=f"t-{adapter}-{start + i}",
            trajectory_id=f"tr-{adapter}-{start + i}",
            session_id="s",
            index=0,
            completion_id=f"c-{adapter}-{start + i}",
            model="m",
            adapter=adapter,
            context_ids=[1],
            output_ids=[2],
            logprobs=[-0.1],
            loss_mask=[1],
            finish_reason="stop",
            owner=owner,
        )
        for i in range(len(values))
    ]
    store.append_turns(turns)
    for t, v in zip(turns, values, strict=True):
        target_id = t.turn_id if target == "turn" else t.trajectory_id
        store.add_reward(Reward(target=target, target_id=target_id, value=v, source=source, owner=owner))


def config(**kw) -> ExperimentConfig:
    base = {"name": "e", "family": "f", "arms": [{"adapter": "f@1"}, {"adapter": "f@2"}], "metric": "verifier:exact", "min_samples": 30}
    return ExperimentConfig.model_validate({**base, **kw})


def test_creation_rules(tmp_path):
    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    with pytest.raises(ExperimentError, match="not loaded"):
        exps.create(config(arms=[{"adapter": "f@1"}, {"adapter": "f@3"}]), {"f@1", "f@2"})
    with pytest.raises(ValueError, match="not a version of family"):
        config(arms=[{"adapter": "f@1"}, {"adapter": "g@1"}])
    status = exps.create(config(), {"f@1", "f@2"})
    assert status["champion"] == "f@1" and status["status"] == "running"
    with pytest.raises(ExperimentError, match="already"):
        exps.create(config(name="e2"), {"f@1", "f@2"})


def test_rollback_only_after_min_samples_and_stopped_arm_routes_to_champion(tmp_path):
    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    exps.create(config(auto_rollback=True, auto_promote=True), {"f@1", "f@2"})
    rng = random.Random(0)
    add_rewards(store, "f@1", [float(rng.random() < 0.7) for _ in range(20)], 0)
    add_rewards(store, "f@2", [0.0] * 20, 0)
    status = exps.evaluate("e")
    assert status["status"] == "running" and status["stopped_arms"] == []  # below min_samples: no decision
    add_rewards(store, "f@1", [float(rng.random() < 0.7) for _ in range(200)], 20)
    add_rewards(store, "f@2", [float(rng.random() < 0.2) for _ in range(200)], 20)
    status = exps.evaluate("e")
    assert status["stopped_arms"] == ["f@2"] and [d["action"] for d in status["decisions"]] == ["rollback", "end"]
    assert status["status"] == "rolled_back"  # no challenger left: the experiment is over
    assert reg.aliases()["f"] == "f@1"  # no promotion of the worse arm
    routed = {exps.route("f", f"session-{i}", None) for i in range(200)}
    assert routed == {None}  # the experiment is over: every request goes to the alias, the champion
    arms = {a["adapter"]: a for a in status["arms"]}
    assert arms["f@1"]["n"] == 220 and arms["f@2"]["n"] == 220
    assert arms["f@2"]["msprt_p_value"] < 0.05 and "welch_p_fixed_horizon" in arms["f@2"]
    # persisted: a new manager over the same store sees the same state
    again = Experiments(SqliteStore(tmp_path / "x.db"), reg)
    assert again.states["e"]["stopped_arms"] == ["f@2"]


def test_equal_arms_are_not_promoted(tmp_path):
    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    exps.create(config(auto_rollback=True, auto_promote=True), {"f@1", "f@2"})
    rng = random.Random(1)
    for look in range(10):  # checked after every batch, as the evaluator does
        add_rewards(store, "f@1", [float(rng.random() < 0.5) for _ in range(50)], look * 50)
        add_rewards(store, "f@2", [float(rng.random() < 0.5) for _ in range(50)], look * 50)
        status = exps.evaluate("e")
    assert status["status"] == "running" and status["stopped_arms"] == [] and reg.aliases()["f"] == "f@1"


def test_routing_is_sticky_and_split(tmp_path):
    store = SqliteStore(tmp_path / "x.db")
    exps = Experiments(store, registry_with("f@1", "f@2"))
    exps.create(config(arms=[{"adapter": "f@1", "weight": 3}, {"adapter": "f@2", "weight": 1}]), {"f@1", "f@2"})
    picks = [exps.route("f", f"s{i}", None) for i in range(4000)]
    assert picks == [exps.route("f", f"s{i}", None) for i in range(4000)]
    share = picks.count("f@2") / len(picks)
    assert 0.22 < share < 0.28
    assert exps.route("other-family", "s1", None) is None


def test_max_samples_ends_an_undecided_experiment_inconclusive(tmp_path):
    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    with pytest.raises(ValueError, match="at least min_samples"):
        config(max_samples=10)
    exps.create(config(auto_rollback=True, auto_promote=True, max_samples=60), {"f@1", "f@2"})
    same = [float(i % 2) for i in range(50)]
    add_rewards(store, "f@1", same, 0)
    add_rewards(store, "f@2", same, 0)
    assert exps.evaluate("e")["status"] == "running"  # undecided, below max_samples
    add_rewards(store, "f@1", same, 50)
    add_rewards(store, "f@2", same, 50)
    status = exps.evaluate("e")
    assert status["status"] == "inconclusive" and status["decisions"][-1]["action"] == "end"
    assert reg.aliases()["f"] == "f@1" and exps.route("f", "any-session", None) is None  # no experiment: the alias (champion) serves
    assert Experiments(store, reg).status("e")["status"] == "inconclusive"  # persisted


def test_a_rolled_back_arm_of_a_running_experiment_routes_to_the_champion(tmp_path):
    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2", "f@3")
    exps = Experiments(store, reg)
    arms = [{"adapter": "f@1"}, {"adapter": "f@2"}, {"adapter": "f@3"}]
    exps.create(config(arms=arms, auto_rollback=True, auto_promote=True), {"f@1", "f@2", "f@3"})
    rng = random.Random(0)
    add_rewards(store, "f@1", [float(rng.random() < 0.7) for _ in range(200)], 0)
    add_rewards(store, "f@2", [float(rng.random() < 0.1) for _ in range(200)], 0)
    add_rewards(store, "f@3", [float(rng.random() < 0.7) for _ in range(200)], 0)
    status = exps.evaluate("e")
    assert status["status"] == "running" and status["stopped_arms"] == ["f@2"]  # f@3 is still undecided
    routed = {exps.route("f", f"session-{i}", None) for i in range(300)}
    assert routed == {"f@1", "f@3"}  # f@2's keys go to the champion


def test_p_value_history_records_each_change_and_stays_bounded(tmp_path, monkeypatch):
    import runtime.adapters.experiments as experiments_module

    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    exps.create(config(min_samples=20), {"f@1", "f@2"})  # no auto actions: it keeps running
    rng = random.Random(3)
    for look in range(4):
        add_rewards(store, "f@1", [float(rng.random() < 0.3) for _ in range(25)], look * 25)
        add_rewards(store, "f@2", [float(rng.random() < 0.7) for _ in range(25)], look * 25)
        exps.evaluate("e")
        exps.evaluate("e")  # nothing new: no new point
    hist = exps.evaluate("e")["p_history"]["f@2"]
    assert [(h["n_champion"], h["n"]) for h in hist] == [(25, 25), (50, 50), (75, 75), (100, 100)]
    ps = [h["p"] for h in hist]
    assert ps == sorted(set(ps), reverse=True) and ps[-1] == exps.evaluate("e")["arms"][1]["msprt_p_value"]  # always-valid: never rises
    assert Experiments(SqliteStore(tmp_path / "x.db"), reg).states["e"]["p_history"]["f@2"] == hist  # persisted
    monkeypatch.setattr(experiments_module, "P_HISTORY_MAX", 4)
    state = {"p_history": {}}
    for i in range(9):
        experiments_module._append_p(state, "a", 1.0 / (i + 1), i, i)
    kept = [h["n"] for h in state["p_history"]["a"]]
    assert len(kept) <= 4 and kept[0] == 0 and kept[-1] == 8  # thinned evenly, first and newest kept


def test_a_learners_source_rule_counts_the_feedback_clients_name(tmp_path):
    """An experiment with the learner's reward_sources rule judges by whatever source a client names its feedback
    ("user", "thumbs": both rank with "*"), ranked once across turn and trajectory rewards; the metric "feedback" the
    learner used to pass saw none of it (n = 0 on both arms while the users rated thousands of turns)."""
    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    sources = ["verifier:*", "judge:*", "hook:*", "feedback", "*"]
    exps.create(config(metric=None, reward_sources=sources, min_samples=20, auto_promote=True, auto_rollback=True), {"f@1", "f@2"})
    add_rewards(store, "f@1", [0.0, 1.0] * 8, 0, source="user")
    add_rewards(store, "f@1", [-1.0, 1.0] * 7, 16, source="thumbs", target="trajectory")
    add_rewards(store, "f@2", [1.0] * 16, 0, source="user")
    add_rewards(store, "f@2", [1.0] * 14, 16, source="thumbs", target="trajectory")
    assert [len(store.arm_observations(a, 0.0, "feedback")["rewards"]) for a in ("f@1", "f@2")] == [0, 0]
    status = exps.evaluate("e")
    assert {a["adapter"]: a["n"] for a in status["arms"]} == {"f@1": 30, "f@2": 30}
    assert status["status"] == "promoted" and status["winner"] == "f@2"


def test_arms_that_share_no_source_are_not_compared_across_scales(tmp_path):
    # one arm rated only with 0/1, the other only with thumbs +1: within source there is nothing to compare them by
    # (the scales differ, and which users rated which arm decides the raw means), so nothing is decided
    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    exps.create(config(metric=None, reward_sources=["*"], min_samples=20, auto_promote=True, auto_rollback=True), {"f@1", "f@2"})
    add_rewards(store, "f@1", [0.0, 1.0] * 15, 0, source="user")
    add_rewards(store, "f@2", [1.0] * 30, 0, source="thumbs", target="trajectory")
    status = exps.evaluate("e")
    assert status["status"] == "running" and all(a["mean_score"] == 0.0 for a in status["arms"])


def test_a_verifier_outranks_clicks_in_the_experiment_as_in_training(tmp_path):
    store = SqliteStore(tmp_path / "x.db")
    exps = Experiments(store, registry_with("f@1", "f@2"))
    exps.create(config(metric=None, reward_sources=["verifier:*", "feedback", "*"], min_samples=5), {"f@1", "f@2"})
    add_rewards(store, "f@1", [1.0] * 10, 0, source="user")
    add_rewards(store, "f@2", [1.0] * 10, 0, source="user")
    assert [a["n"] for a in exps.evaluate("e")["arms"]] == [10, 10]
    add_rewards(store, "f@1", [0.0, 1.0, 1.0], 10, source="verifier:task", target="trajectory")  # one verified run on the champion
    arms = exps.evaluate("e")["arms"]
    assert [a["n"] for a in arms] == [3, 0] and arms[0]["mean_reward"] == pytest.approx(2 / 3)  # the clicks no longer count


def test_the_admins_own_runs_are_never_evidence(tmp_path):
    """The learner's runs (re-rollouts, siblings, gates) go through the admin API and are owned by "admin": never counted."""
    store = SqliteStore(tmp_path / "x.db")
    exps = Experiments(store, registry_with("f@1", "f@2"))
    exps.create(config(min_samples=5), {"f@1", "f@2"})
    add_rewards(store, "f@2", [1.0] * 40, 0, owner="admin", target="trajectory")
    add_rewards(store, "f@2", [0.0] * 40, 100, owner="admin")
    status = exps.evaluate("e")
    assert [a["n"] for a in status["arms"]] == [0, 0] and [a["requests"] for a in status["arms"]] == [0, 0]
    assert status["evidence"].startswith("no evidence yet on f@1, f@2")


def test_one_key_weighs_at_most_its_share_of_an_arm(tmp_path):
    """max_owner_share 0.5 with three keys: the loud key keeps its oldest observations up to half of the arm's."""
    store = SqliteStore(tmp_path / "x.db")
    exps = Experiments(store, registry_with("f@1", "f@2"))
    exps.create(config(max_owner_share=0.5, min_samples=5), {"f@1", "f@2"})
    add_rewards(store, "f@2", [0.0] * 100, 0, owner="key-loud")
    add_rewards(store, "f@2", [1.0] * 10, 100, owner="key-a")
    add_rewards(store, "f@2", [1.0] * 10, 200, owner="key-b")
    arm = {a["adapter"]: a for a in exps.evaluate("e")["arms"]}["f@2"]
    # water-filling: caps c with c <= 0.5 (20 + min(100, c)) -> c = 20; kept 20 + 10 + 10 = 40, the loud key half of it
    assert arm["n"] == 40 and arm["mean_reward"] == pytest.approx(0.5)


def test_an_experiment_without_evidence_ends_inconclusive_after_its_time(tmp_path, monkeypatch):
    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    exps.create(config(max_duration_s=600, auto_promote=True, auto_rollback=True), {"f@1", "f@2"})
    status = exps.evaluate("e")
    assert status["status"] == "running" and "no evidence yet" in status["evidence"] and "ends undecided in" in status["evidence"]
    start = exps.states["e"]["started_at"]
    monkeypatch.setattr("runtime.adapters.experiments.time.time", lambda: start + 601)
    status = exps.evaluate("e")
    assert status["status"] == "inconclusive" and "no decision after 600 s" in status["decisions"][-1]["reason"]
    assert reg.aliases()["f"] == "f@1"


def test_a_decided_experiments_figures_stay_as_they_were_at_its_end(tmp_path):
    store = SqliteStore(tmp_path / "x.db")
    exps = Experiments(store, registry_with("f@1", "f@2"))
    exps.create(config(max_samples=40), {"f@1", "f@2"})
    same = [float(i % 2) for i in range(40)]
    add_rewards(store, "f@1", same, 0)
    add_rewards(store, "f@2", same, 0)
    ended = exps.evaluate("e")
    assert ended["status"] == "inconclusive" and ended["ended_at"] >= ended["started_at"]
    add_rewards(store, "f@1", [1.0] * 30, 100)  # the champion goes on serving, and its users go on rating
    again = exps.status("e")
    assert [a["n"] for a in again["arms"]] == [40, 40] and again["arms"][0]["mean_reward"] == ended["arms"][0]["mean_reward"]


def _equal_arms_ended(db, n: int, **extra: Any) -> tuple[dict, AdapterRegistry]:
    """An experiment with non_inferiority_margin 0.2 between two arms of n identical 0/1 rewards, evaluated at max_samples n."""
    store, reg = SqliteStore(db), registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    exps.create(config(auto_rollback=True, auto_promote=True, max_samples=n, non_inferiority_margin=0.2, **extra), {"f@1", "f@2"})
    same = [float(i % 2) for i in range(n)]
    add_rewards(store, "f@1", same, 0)
    add_rewards(store, "f@2", same, 0)
    assert Experiments(store, reg).status("e")["status"] == "running"
    status = exps.evaluate("e")
    assert Experiments(store, reg).status("e")["status"] == status["status"]  # persisted
    return status, reg


def test_an_undecided_experiment_promotes_a_challenger_shown_non_inferior(tmp_path):
    # equal arms, 100 per arm of 0/1: sd 0.5025, margin 0.2 sd = 0.1005; Welch se = sqrt(2 * 0.25253 / 100) = 0.0711,
    # t(0.95, 198) = 1.6526, lower bound = 0 - 0.1174 < -0.1005: not shown non-inferior at 100. At 200 per arm:
    # se 0.0501, lower = -0.0826 > -0.1003: non-inferior, so the experiment that ends there promotes the challenger.
    status, reg = _equal_arms_ended(tmp_path / "x.db", 100)
    assert status["status"] == "inconclusive" and reg.aliases()["f"] == "f@1"
    status, reg = _equal_arms_ended(tmp_path / "y.db", 200)
    assert status["status"] == "promoted" and status["winner"] == "f@2", status["decisions"]
    assert "non-inferior" in status["decisions"][-1]["reason"] and status["decisions"][-1]["action"] == "promote"
    assert reg.aliases()["f"] == "f@2"  # the alias follows the promotion


def test_a_chain_of_non_inferior_promotions_is_bounded_as_a_whole(tmp_path):
    # equal arms, 200 per arm of 0/1: var 200 * 0.25 / 199 = 0.25126 on each arm, pooled sd 0.50125, this step's
    # d = 0 and v = se^2 / sd^2 = (2 * 0.25126 / 200) / 0.25126 = 0.01; alone it passes (above). After one earlier step
    # of the same size and no gain (prior 0, 0.01) the chain's bound is 0 - t(0.95, 398) * sqrt(0.02) = -1.6487 * 0.14142
    # = -0.233 < -0.2: the champion stays, so two "non-inferior" steps cannot add up to more than the margin. A chain
    # that has gained +0.1 sd so far passes: 0.1 - 0.233 = -0.133 > -0.2.
    flat = {"anchor": "f@0", "steps": 1, "diff_sd": 0.0, "var_sd": 0.01}
    status, reg = _equal_arms_ended(tmp_path / "x.db", 200, non_inferiority_chain=flat)
    assert status["status"] == "inconclusive" and reg.aliases()["f"] == "f@1"
    assert "f@2 not shown non-inferior" in status["decisions"][-1]["reason"] and "lower bound -0.233 sd" in status["decisions"][-1]["reason"]
    gained = {**flat, "diff_sd": 0.1}
    status, reg = _equal_arms_ended(tmp_path / "y.db", 200, non_inferiority_chain=gained)
    assert status["status"] == "promoted" and reg.aliases()["f"] == "f@2"
    assert "the chain so far +0.1 sd" in status["decisions"][-1]["reason"], status["decisions"][-1]
    # every promotion records its step for the next experiment's chain: d 0, v 0.01
    assert status["effect"] == {"arm": "f@2", "diff_sd": pytest.approx(0.0), "var_sd": pytest.approx(0.01)}
    with pytest.raises(ValueError):
        config(non_inferiority_margin=0.2, non_inferiority_chain={"diff_sd": 0.0, "var_sd": -1.0})


def test_a_worse_challenger_is_not_promoted_when_undecided_and_time_ends_without_evidence(tmp_path, monkeypatch):
    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    exps.create(config(auto_rollback=False, auto_promote=True, max_samples=200, non_inferiority_margin=0.2), {"f@1", "f@2"})
    # champion 0.5, challenger 0.4 (worse by 0.2 sd): the mSPRT alone (no auto rollback) leaves it undecided; the
    # non-inferiority bound (0.4 - 0.5 - 1.65 * 0.049 = -0.18) is below -0.1: the champion stays
    add_rewards(store, "f@1", [float(i % 2) for i in range(200)], 0)
    add_rewards(store, "f@2", [float(i % 5 < 2) for i in range(200)], 0)
    status = exps.evaluate("e")
    assert status["status"] == "inconclusive" and reg.aliases()["f"] == "f@1"

    # no evidence at all when the time runs out: nothing to show non-inferiority with, the champion stays
    store2 = SqliteStore(tmp_path / "y.db")
    reg2 = registry_with("f@1", "f@2")
    exps2 = Experiments(store2, reg2)
    exps2.create(config(max_duration_s=600, auto_promote=True, non_inferiority_margin=0.2), {"f@1", "f@2"})
    start = exps2.states["e"]["started_at"]
    monkeypatch.setattr("runtime.adapters.experiments.time.time", lambda: start + 601)
    assert exps2.evaluate("e")["status"] == "inconclusive" and reg2.aliases()["f"] == "f@1"


def test_several_sources_are_compared_within_source_not_by_a_mixed_raw_mean(tmp_path):
    # seen live: the challenger is worse within both sources (0/1 checks 0.12 -> 0.067, thumbs -0.70 -> -0.80) but drew
    # fewer of the -1 thumbs, so its raw mean is higher (-0.15 vs -0.19) and a raw non-inferiority test promoted it.
    # Within source (each reward standardized by its source's pooled mean and sd) it is 0.17 sd worse: not promoted.
    store = SqliteStore(tmp_path / "x.db")
    reg = registry_with("f@1", "f@2")
    exps = Experiments(store, reg)
    cfg = config(metric=None, reward_sources=["*"], max_samples=160, non_inferiority_margin=0.2, auto_promote=True)
    exps.create(cfg, {"f@1", "f@2"})
    add_rewards(store, "f@1", [1.0] * 12 + [0.0] * 88, 0, source="feedback")
    add_rewards(store, "f@1", [1.0] * 9 + [-1.0] * 51, 100, source="thumbs")
    add_rewards(store, "f@2", [1.0] * 8 + [0.0] * 112, 0, source="feedback")
    add_rewards(store, "f@2", [1.0] * 4 + [-1.0] * 36, 200, source="thumbs")
    status = exps.evaluate("e")
    champion, challenger = status["arms"]
    assert challenger["mean_reward"] == pytest.approx(-0.15) and champion["mean_reward"] == pytest.approx(-0.1875)  # raw: challenger "better"
    # by hand: feedback pooled mean 20/220, sd sqrt(20/220 * 200/220 * 220/219); thumbs pooled mean -0.74, sd sqrt((1 - 0.74^2) * 100/99)
    f_mean, t_mean = 20 / 220, -0.74
    f_sd, t_sd = (20 / 220 * 200 / 220 * 220 / 219) ** 0.5, ((1 - 0.74**2) * 100 / 99) ** 0.5
    champ = (100 * (0.12 - f_mean) / f_sd + 60 * (-0.7 - t_mean) / t_sd) / 160
    chall = (120 * (8 / 120 - f_mean) / f_sd + 40 * (-0.8 - t_mean) / t_sd) / 160
    assert champion["mean_score"] == pytest.approx(champ) and challenger["mean_score"] == pytest.approx(chall) and chall < champ
    assert status["status"] == "inconclusive" and reg.aliases()["f"] == "f@1"
