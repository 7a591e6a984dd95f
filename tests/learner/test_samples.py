"""Turn samples from a real SqliteStore: exact tokens, group ids (task key and chat fallbacks), the staleness
bound (whole trajectories), reward sources and their precedence, recorded grammars and state keys,
untrainable/draft/unrewarded/NaN turns skipped and counted, the settle window and cursor."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from learner.advantages import compute_advantages
from learner.config import SampleConfig
from learner.records import Reward, Trajectory, Turn
from learner.records.store import SqliteStore
from learner.samples import Cursor, Sample, collect_samples, group_id_of, make_groups, parse_adapter

NOW = 10_000.0
CFG = SampleConfig(max_staleness=2, settle_s=100.0)


def make_turn(
    tid: str,
    traj: str,
    *,
    index: int = 0,
    adapter: str | None = "fam@3",
    created_at: float = 1_000.0,
    prefix_key: str = "",
    temperature: float = 0.7,
    owner: str = "public",
) -> Turn:
    n = 3 + index
    return Turn(
        turn_id=tid,
        trajectory_id=traj,
        session_id="s",
        index=index,
        completion_id=f"c-{tid}",
        created_at=created_at,
        model="tiny",
        adapter=adapter,
        context_ids=[1, 2, 3 + index, 40 + len(tid)],
        output_ids=list(range(10, 10 + n)),
        logprobs=[-0.5] * n,
        loss_mask=[1] * n,
        sampling={"temperature": temperature},
        finish_reason="stop",
        prefix_key=prefix_key,
        owner=owner,
    )


def add_trajectory(
    store: SqliteStore,
    traj: str,
    *,
    turns: int = 1,
    reward: float | None = 1.0,
    meta: dict[str, Any] | None = None,
    adapter: str | None = "fam@3",
    t0: float = 1_000.0,
    prefix_key: str = "",
    source: str = "verifier:x",
    owner: str = "public",
) -> list[Turn]:
    ts = [make_turn(f"{traj}-t{i}", traj, index=i, adapter=adapter, created_at=t0 + i, prefix_key=prefix_key, owner=owner) for i in range(turns)]
    store.append_turns(ts)
    if meta is not None:
        store.set_trajectory_meta(traj, meta)
    if reward is not None:
        store.add_reward(Reward(target="trajectory", target_id=traj, value=reward, source=source, owner=owner))
    return ts


@pytest.fixture
def store(tmp_path: Path):
    s = SqliteStore(tmp_path / "interactions.db")
    yield s
    s.close()


def collect(store: Any, *, current: int = 3, cursor: Cursor | None = None, cfg: SampleConfig = CFG, now: float = NOW):
    return collect_samples(store, family="fam", current_version=current, cursor=cursor or Cursor(), cfg=cfg, now=now)


def test_samples_carry_the_exact_recorded_turn(store: SqliteStore) -> None:
    turns = add_trajectory(store, "tr-a", turns=2, meta={"agent": "calc", "task_key": "arith:7", "correct": True, "score": 0.5})
    store.add_reward(Reward(target="turn", target_id=turns[1].turn_id, value=0.25, source="verifier:x:process"))  # the task's process score
    batch = collect(store)
    assert [s.turn_id for s in batch.samples] == [t.turn_id for t in turns]
    for s, t in zip(batch.samples, turns, strict=True):
        assert (s.context_ids, s.output_ids, s.logprobs, s.loss_mask) == (t.context_ids, t.output_ids, t.logprobs, t.loss_mask)
        assert (s.turn_index, s.trajectory_id, s.adapter, s.adapter_version, s.temperature) == (t.index, "tr-a", "fam@3", 3, 0.7)
        assert s.group_id == "task:calc:arith:7"
        assert s.trajectory_reward == 1.0
    assert [s.reward for s in batch.samples] == [None, 0.25]
    ts = [s.to_turn_sample() for s in batch.samples]
    assert [(x.trajectory_id, x.group_id, x.turn_index, x.reward, x.trajectory_reward, x.n_tokens, x.correct, x.score) for x in ts] == [
        ("tr-a", "task:calc:arith:7", 0, None, 1.0, 3, True, 0.5),
        ("tr-a", "task:calc:arith:7", 1, 0.25, 1.0, 4, True, 0.5),
    ]


def test_groups_by_task_key_with_chat_fallbacks(store: SqliteStore) -> None:
    for i in range(3):
        add_trajectory(store, f"tr-task1-{i}", meta={"agent": "calc", "task_key": "t1"}, reward=float(i))
    for i in range(2):
        add_trajectory(store, f"tr-task2-{i}", meta={"agent": "calc", "task_key": "t2"}, reward=float(i))
    add_trajectory(store, "tr-other-agent", meta={"agent": "coder", "task_key": "t1"})  # same key, other agent → own group
    for i in range(2):  # live chat without a task key, same opening messages → one group by prefix key
        add_trajectory(store, f"tr-chat-{i}", prefix_key="pk-hello", reward=float(i))
    add_trajectory(store, "tr-chat-nokey")  # no prefix key either → hash of the first context
    groups = {g.group_id: g.trajectory_ids for g in make_groups(collect(store).samples)}
    assert groups["task:calc:t1"] == ["tr-task1-0", "tr-task1-1", "tr-task1-2"]
    assert groups["task:calc:t2"] == ["tr-task2-0", "tr-task2-1"]
    assert groups["task:coder:t1"] == ["tr-other-agent"]
    assert groups["prompt:public:pk-hello"] == ["tr-chat-0", "tr-chat-1"]
    ctx_groups = [g for g in groups if g.startswith("ctx:")]
    assert len(ctx_groups) == 1 and groups[ctx_groups[0]] == ["tr-chat-nokey"]
    assert len(groups) == 5


def test_two_keys_same_opening_messages_never_share_a_group(store: SqliteStore) -> None:
    """Chat groups were keyed by the opening messages alone: a key sending a victim's template (or a common one) and
    rating it +-100 joined the victim's group and moved its mean and spread, flipping the sign of the victim's
    advantages. GRPO within the victim's own group: its rewards 1 and 0 give +1 and -1 whatever the other key sends."""
    for i, r in enumerate((1.0, 0.0)):
        add_trajectory(store, f"tr-victim-{i}", prefix_key="pk-template", reward=r, owner="victim", source="feedback")
    for i in range(4):
        add_trajectory(store, f"tr-hostile-{i}", prefix_key="pk-template", reward=100.0, owner="hostile", source="feedback")
    cfg = CFG.model_copy(update={"reward_sources": ["feedback"], "max_owner_share": 1.0})  # grouping alone, no share cut
    groups = {g.group_id: g.trajectory_ids for g in make_groups(collect(store, cfg=cfg).samples)}
    assert groups == {
        "prompt:victim:pk-template": ["tr-victim-0", "tr-victim-1"],
        "prompt:hostile:pk-template": [f"tr-hostile-{i}" for i in range(4)],
    }
    [victim] = [g for g in make_groups(collect(store, cfg=cfg).samples) if g.group_id == "prompt:victim:pk-template"]
    # GRPO over the victim's two: (r - 0.5) / std, std = sqrt(((0.5)^2 + (0.5)^2) / (2 - 1)) (unbiased) = 1/sqrt(2)
    assert compute_advantages("grpo", victim.samples) == pytest.approx([2**-0.5, -(2**-0.5)], abs=1e-5)


def test_max_trajectories_keeps_whole_groups_largest_then_newest(store: SqliteStore) -> None:
    sizes = {"old-full": (4, 1_000.0), "new-full": (4, 2_000.0), "cut": (2, 3_000.0), "newest-small": (1, 4_000.0)}
    for key, (n, t0) in sizes.items():
        for i in range(n):
            add_trajectory(store, f"tr-{key}-{i}", meta={"agent": "calc", "task_key": key}, reward=float(i % 2), t0=t0 + i)
    capped = collect(store, cfg=SampleConfig(max_staleness=2, settle_s=100.0, max_trajectories=8))
    groups = {g.group_id: len(g.trajectory_ids) for g in make_groups(capped.samples)}
    assert groups == {"task:calc:new-full": 4, "task:calc:old-full": 4}  # the groups of four first, whole, then nothing fits
    assert capped.counts.surplus == 3
    one = collect(store, cfg=SampleConfig(max_staleness=2, settle_s=100.0, max_trajectories=6))
    assert {g.group_id for g in make_groups(one.samples)} == {"task:calc:new-full", "task:calc:cut"}  # 4, then 2 fits
    tiny = collect(store, cfg=SampleConfig(max_staleness=2, settle_s=100.0, max_trajectories=1))
    assert {g.group_id for g in make_groups(tiny.samples)} == {"task:calc:new-full"}  # never less than one whole group
    assert len(collect(store).samples) == 11 and collect(store).counts.surplus == 0  # no cap: everything
    assert tiny.cursor == collect(store).cursor  # the rest is skipped, not deferred


def test_group_id_of_same_context_is_stable() -> None:
    a = Trajectory(trajectory_id="a", session_id="s", turns=[make_turn("x", "a")])
    b = Trajectory(trajectory_id="b", session_id="s", turns=[make_turn("x", "b")])  # same context ids
    c = Trajectory(trajectory_id="c", session_id="s", turns=[make_turn("xy", "c")])  # other context
    assert group_id_of(a) == group_id_of(b) != group_id_of(c)


def test_staleness_bound_and_other_families(store: SqliteStore) -> None:
    add_trajectory(store, "tr-v3", adapter="fam@3")
    add_trajectory(store, "tr-v1", adapter="fam@1")  # current 3 - staleness 2 = 1: still fresh enough
    add_trajectory(store, "tr-v0-base", adapter=None)  # the base model is version 0: stale
    add_trajectory(store, "tr-other", adapter="other@9")
    batch = collect(store, current=3)
    assert sorted(s.trajectory_id for s in batch.samples) == ["tr-v1", "tr-v3"]
    assert (batch.counts.stale, batch.counts.other_family) == (1, 1)
    # before anything is published (current 0), base-model traffic is exactly on-policy
    fresh = collect(store, current=0)
    assert "tr-v0-base" in {s.trajectory_id for s in fresh.samples}
    assert parse_adapter("fam@12") == ("fam", 12) and parse_adapter(None) == (None, 0) and parse_adapter("weird") == ("weird", -1)


def test_untrainable_drafts_and_unrewarded_are_skipped_and_counted(store: SqliteStore) -> None:
    add_trajectory(store, "tr-ok", turns=2)
    add_trajectory(store, "tr-broken", turns=3, meta={"trainable": False, "task_key": "k"})
    add_trajectory(store, "tr-draft", meta={"resampled_draft": True, "trainable": True})
    add_trajectory(store, "tr-unrewarded", turns=2, reward=None)
    add_trajectory(store, "tr-eval", turns=2, meta={"eval": True, "task_key": "k", "correct": True})  # held out: never trained on
    batch = collect(store)
    assert {s.trajectory_id for s in batch.samples} == {"tr-ok"}
    c = batch.counts
    assert (c.untrainable, c.untrainable_trajectories, c.draft, c.no_reward, c.eval) == (3, 1, 1, 2, 2)


def test_turn_without_loss_tokens_is_skipped(store: SqliteStore) -> None:
    t = make_turn("masked", "tr-masked").model_copy(update={"loss_mask": [0, 0, 0]})
    store.append_turns([t])
    store.add_reward(Reward(target="turn", target_id="masked", value=1.0))
    batch = collect(store)
    assert batch.samples == [] and batch.counts.no_tokens == 1


class NaNRewardStore:
    """A real SqliteStore whose trajectories also carry a NaN reward. The store itself refuses NaN
    (``Reward`` validates, the column is NOT NULL), so this wrapper stands in for a foreign writer."""

    def __init__(self, inner: SqliteStore, nan_targets: dict[str, str]) -> None:
        self.inner, self.nan_targets = inner, nan_targets

    def iter_samples(self, **kw: Any):
        return self.inner.iter_samples(**kw)

    def get_trajectory(self, trajectory_id: str) -> Trajectory | None:
        traj = self.inner.get_trajectory(trajectory_id)
        assert traj is not None
        extra = [
            Reward.model_construct(reward_id=f"nan-{tid}", target=kind, target_id=tid, value=math.nan, source="buggy", created_at=2e9)
            for tid, kind in self.nan_targets.items()
            if tid == trajectory_id or tid.startswith(trajectory_id + "-")
        ]
        return traj.model_copy(update={"rewards": [*traj.rewards, *extra]})


def test_nan_rewards_are_excluded_and_counted(store: SqliteStore) -> None:
    add_trajectory(store, "tr-nan", reward=None)  # only a NaN trajectory reward → excluded
    add_trajectory(store, "tr-nan-turn", reward=0.5)  # NaN turn reward but a real trajectory reward → kept, turn reward None
    add_trajectory(store, "tr-good", reward=1.0)
    wrapped = NaNRewardStore(store, {"tr-nan": "trajectory", "tr-nan-turn-t0": "turn"})
    batch = collect(wrapped)
    by_traj = {s.trajectory_id: s for s in batch.samples}
    assert set(by_traj) == {"tr-nan-turn", "tr-good"}
    assert by_traj["tr-nan-turn"].reward is None and by_traj["tr-nan-turn"].trajectory_reward == 0.5
    assert batch.counts.no_reward == 1
    assert all(math.isfinite(s.trajectory_reward) for s in batch.samples if s.trajectory_reward is not None)


def test_cursor_takes_each_settled_trajectory_once_and_whole(store: SqliteStore) -> None:
    add_trajectory(store, "tr-old", turns=2, t0=1_000.0)
    add_trajectory(store, "tr-growing", turns=1, t0=9_950.0)  # last turn within settle_s of NOW: deferred
    first = collect(store)
    assert {s.trajectory_id for s in first.samples} == {"tr-old"}
    assert first.counts.deferred_trajectories == 1
    assert first.cursor == Cursor(since=NOW - CFG.settle_s)
    assert Cursor.from_dict(first.cursor.to_dict()) == first.cursor
    # the growing trajectory gets a second turn; later both its turns come out together, tr-old not again
    store.append_turns([make_turn("tr-growing-t1", "tr-growing", index=1, created_at=9_990.0)])
    add_trajectory(store, "tr-new", t0=9_980.0)
    second = collect(store, cursor=first.cursor, now=NOW + 200)
    assert sorted(s.turn_id for s in second.samples) == ["tr-growing-t0", "tr-growing-t1", "tr-new-t0"]
    third = collect(store, cursor=second.cursor, now=NOW + 400)
    assert third.samples == [] and third.cursor.since == NOW + 300


def test_sample_counts_its_trained_tokens() -> None:
    s = Sample("t", "tr", "g", 0, [1], [2, 3], [-1.0, -1.0], [1, 0], None, 0, reward=0.2, trajectory_reward=1.0, temperature=1.0, created_at=0.0)
    assert s.n_tokens == 1


def test_a_stale_turn_drops_its_whole_trajectory(store: SqliteStore) -> None:
    # a chat trajectory whose first turn an old version served and whose second turn a fresh one did: its outcome
    # is the outcome of both turns, so it is taken whole or not at all (dropping the stale turn alone left a
    # partial trajectory that was trained on the full outcome)
    ts = add_trajectory(store, "tr-mixed", turns=2)
    store.append_turns([make_turn("tr-mixed-t2", "tr-mixed", index=2, adapter="fam@1", created_at=1_002.0)])
    old = ts[0].model_copy(update={"turn_id": "tr-mixed-old", "index": 3, "adapter": None, "created_at": 1_003.0})
    store.append_turns([old])
    batch = collect_samples(store, family="fam", min_version=1, cursor=Cursor(), cfg=CFG, now=NOW)
    assert batch.samples == [] and (batch.counts.stale, batch.counts.stale_trajectories) == (4, 1)


def test_reward_sources_precedence_and_one_source_per_group(store: SqliteStore) -> None:
    meta = {"agent": "calc", "task_key": "k"}
    # a and b: a verifier outcome, and b also got a user's thumbs-down; c only a user's feedback; d a self-verdict
    add_trajectory(store, "tr-a", meta=meta, reward=1.0)
    add_trajectory(store, "tr-b", meta=meta, reward=0.0)
    store.add_reward(Reward(target="trajectory", target_id="tr-b", value=1.0, source="feedback", created_at=3e9))  # newer, lower rank
    add_trajectory(store, "tr-c", meta=meta, reward=1.0, source="feedback")
    add_trajectory(store, "tr-d", meta={"agent": "calc", "task_key": "other"}, reward=0.7, source="self-verdict")
    batch = collect(store)
    got = {s.trajectory_id: (s.trajectory_reward, s.trajectory_reward_source) for s in batch.samples}
    # b is scored by the verifier (higher precedence), not by the newer feedback; c's feedback is not normalised
    # against the verifier's 0/1 in group k (it loses it, and with it its only reward); d trains under "*"
    assert got == {"tr-a": (1.0, "verifier:x"), "tr-b": (0.0, "verifier:x"), "tr-d": (0.7, "self-verdict")}
    assert batch.counts.other_source == 1 and batch.counts.no_reward == 1
    # a learner configured to train on user feedback only sees b's thumbs and c's, and nothing else
    only_feedback = collect(store, cfg=SampleConfig(max_staleness=2, settle_s=100.0, reward_sources=["feedback"]))
    got = {s.trajectory_id: s.trajectory_reward for s in only_feedback.samples}
    assert got == {"tr-b": 1.0, "tr-c": 1.0}
    with pytest.raises(ValueError, match="reward_sources"):
        SampleConfig(reward_sources=["feedback", ""])


def test_turns_of_a_rewarded_trajectory_are_kept_without_their_own_reward(store: SqliteStore) -> None:
    # feedback on the second completion of a chat only: the first turn stays (its return carries that reward)
    ts = add_trajectory(store, "tr-chat", turns=2, reward=None)
    store.add_reward(Reward(target="turn", target_id=ts[1].turn_id, value=1.0, source="feedback"))
    batch = collect(store)
    assert [(s.turn_index, s.reward, s.trajectory_reward) for s in batch.samples] == [(0, None, None), (1, 1.0, None)]


def test_a_click_never_cancels_a_verifier_one_rank_per_group(store: SqliteStore) -> None:
    """A verifier failed run with a user's thumbs-up on its turn vs a verifier-passed run: the thumbs used to add to the
    failed run's score (1 = 0 + 1, a tie with the passed run's 1); ranked once across turn and trajectory rewards, the
    group is scored by the verifier alone. A task's own process scores stay beside their outcome."""
    meta = {"agent": "calc", "task_key": "k"}
    failed = add_trajectory(store, "tr-failed", meta=meta, reward=0.0)
    store.add_reward(Reward(target="turn", target_id=failed[0].turn_id, value=1.0, source="thumbs"))
    passed = add_trajectory(store, "tr-passed", meta=meta, reward=1.0, turns=2)
    store.add_reward(Reward(target="turn", target_id=passed[1].turn_id, value=0.5, source="verifier:x:process"))
    batch = collect(store)
    got = {(s.trajectory_id, s.turn_index): (s.reward, s.trajectory_reward) for s in batch.samples}
    assert got == {("tr-failed", 0): (None, 0.0), ("tr-passed", 0): (None, 1.0), ("tr-passed", 1): (0.5, 1.0)}
    assert batch.counts.other_source == 1
    from learner.update import estimate

    adv = dict(zip([(s.trajectory_id, s.turn_index) for s in batch.samples], estimate(batch.samples, "grpo"), strict=True))
    assert adv[("tr-failed", 0)] < 0 < adv[("tr-passed", 0)]  # scores 0 and 1.5 (outcome + process): no tie


def test_turns_after_the_last_rating_are_never_judged(store: SqliteStore) -> None:
    """A three-turn chat rated on its middle reply: the first two train (the first led to the rated one), the third is
    left out; the same chat with a trajectory rating keeps all three."""
    ts = add_trajectory(store, "tr-mid", turns=3, reward=None)
    store.add_reward(Reward(target="turn", target_id=ts[1].turn_id, value=1.0, source="user"))
    add_trajectory(store, "tr-whole", turns=3, reward=1.0, source="user", t0=1_010.0)
    batch = collect(store)
    kept = sorted((s.trajectory_id, s.turn_index) for s in batch.samples)
    assert kept == [("tr-mid", 0), ("tr-mid", 1), ("tr-whole", 0), ("tr-whole", 1), ("tr-whole", 2)]
    assert batch.counts.after_last_reward == 1


def test_grammar_and_state_keys_come_with_the_samples(store: SqliteStore) -> None:
    spec = '{"type": "object"}'
    t = make_turn("g0", "tr-g").model_copy(update={"sampling": {"temperature": 1.0, "grammar": {"kind": "json_schema", "spec": spec}}})
    store.append_turns([t])
    store.set_trajectory_meta("tr-g", {"state_keys": ["cell:0,0"]})
    store.add_reward(Reward(target="trajectory", target_id="tr-g", value=1.0))
    # an old record that kept only the grammar's kind cannot be scored as sampled: its trajectory is left out
    old = make_turn("o0", "tr-old").model_copy(update={"sampling": {"temperature": 1.0, "grammar": "json_schema"}})
    store.append_turns([old])
    store.add_reward(Reward(target="trajectory", target_id="tr-old", value=1.0))
    batch = collect(store)
    [s] = batch.samples
    assert s.grammar == {"kind": "json_schema", "spec": spec} and s.state_key == "cell:0,0"
    assert batch.counts.grammar_unrecorded == 1
    ts = s.to_turn_sample()
    assert ts.state == "state:cell:0,0" and ts.anchor is not None and ts.anchor != ts.state
