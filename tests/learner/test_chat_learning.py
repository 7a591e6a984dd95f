"""Learning from ordinary chat traffic: every feedback form trains, one-off prompts get a running baseline, and
an update that learns nothing says why.

The traffic is real: chat completions through the app's HTTP surface (the ``openai`` client, in process, a
scripted engine at the engine edge with the tiny model's tokenizer) recorded in a real SQLite store, feedback
through ``POST /v1/feedback``; the samples are read back with ``collect_samples`` and stepped by a real
``LoRATrainer`` on the tiny model. Expected advantages are hand-computed from the definitions.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from learner.baseline import apply_to_singletons, running_baseline
from learner.config import LearnerSettings, SampleConfig, TrafficFilter
from learner.reasons import unused_reasons
from learner.samples import Cursor, collect_samples
from learner.service import LearnerService, ServiceConfig
from learner.update import estimate
from tests.runtime._inproc import InProc, scripted_app

REPLIES = ["yes", "no", "maybe", "sure", "never", "often", "rarely", "always"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def srv(tokenizer, tmp_path):
    count = {"n": 0}

    def reply(*_: Any, **__: Any) -> str:
        count["n"] += 1
        return REPLIES[count["n"] % len(REPLIES)]

    app, engine, store = scripted_app(tokenizer, reply, tmp_path)
    s = InProc(app)
    s.store, s.data = store, tmp_path
    yield s
    s.close()


@pytest.fixture(scope="module")
def trainer(tiny_model_path):
    from learner.config import LoRAConfig, TrainerConfig
    from learner.trainer import LoRATrainer

    return LoRATrainer(tiny_model_path, TrainerConfig(lr=1e-3, progress=False), LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))


def client(s: InProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key="user-key", http_client=s.client, max_retries=0)


def chat(s: InProc, prompt: str, n: int = 1, **kw: Any) -> Any:
    return client(s).chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], n=n, max_tokens=4, **kw)


def feedback(s: InProc, **body: Any) -> None:
    r = s.client.post("/v1/feedback", json=body, headers={"Authorization": "Bearer user-key"})
    assert r.status_code == 200, r.text


def ids(resp: Any) -> dict[str, Any]:
    return resp.model_extra["loopwise"]


def collect(s: InProc, **cfg: Any) -> Any:
    return collect_samples(s.store, family="chat-lora", cursor=Cursor(), cfg=SampleConfig(settle_s=0, **cfg), current_version=0)


def test_every_feedback_form_trains(srv, trainer):
    """turn_id, trajectory_id, completion_id + choice_index, and completion_id alone: each gives a group with spread."""
    r = chat(srv, "by turn", n=4)
    for c, v in zip(ids(r)["choices"], [1, 0, 1, 0], strict=True):
        feedback(srv, turn_id=c["turn_id"], reward=v)
    r = chat(srv, "by trajectory", n=4)
    for c, v in zip(ids(r)["choices"], [1, 0, 1, 0], strict=True):
        feedback(srv, trajectory_id=c["trajectory_id"], reward=v)
    r = chat(srv, "by choice", n=4)
    for i, v in enumerate([1, 0, 1, 0]):
        feedback(srv, completion_id=r.id, choice_index=i, reward=v)
    for v in (1, 0):  # the same prompt twice, each completion (both its choices) rated as a whole
        feedback(srv, completion_id=chat(srv, "by completion", n=2).id, reward=v)
    bad = srv.client.post("/v1/feedback", json={"completion_id": r.id, "choice_index": 9, "reward": 1}, headers={"Authorization": "Bearer user-key"})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "choice_index"

    batch = collect(srv)
    assert len(batch.samples) == 16 and len({s.group_id for s in batch.samples}) == 4  # one group per prompt, each choice its own trajectory
    adv = estimate(batch.samples, "grpo")
    # GRPO on [1, 0, 1, 0] (and [1, 1, 0, 0]): mean 1/2, unbiased std sqrt(1/3), so A = +-(1/2) / sqrt(1/3) = +-sqrt(3)/2
    for s, a in zip(batch.samples, adv, strict=True):
        value = s.trajectory_reward if s.trajectory_reward is not None else s.reward
        assert a == pytest.approx(math.sqrt(3) / 2 if value == 1 else -math.sqrt(3) / 2, abs=1e-5)
    m = trainer.step(batch.samples, adv, skipped=batch.counts.as_dict())
    assert m.optimizer_step and m.trained_samples == 16


def test_running_baseline_by_hand():
    """decay 0.5: a = max(1/(n+1), 1/2); scores 2, 0, 4 of one key."""
    adv, state, warm = running_baseline([2.0, 0.0, 4.0], ["k", "k", "k"], None, decay=0.5)
    # 2: no baseline (A 0) -> m 2, v 0;  0: s = 0 so A = 0 - 2 = -2 -> a 1/2, m 1, v 1/2 (0 + 1/2 * 4) = 1;
    # 4: A = (4 - 1) / 1 = 3 -> a 1/2, m 5/2, v 1/2 (1 + 1/2 * 9) = 11/4
    assert adv == pytest.approx([0.0, -2.0, 3.0]) and warm == [True, False, False]
    assert state == {"k": {"n": 3, "mean": pytest.approx(2.5), "var": pytest.approx(2.75)}}
    # keys never share a baseline, and the state carries over between calls
    adv, state2, warm = running_baseline([1.0, 5.0], ["other", "k"], state, decay=0.5, norm_by_std=False)
    assert adv == pytest.approx([0.0, 2.5]) and warm == [True, False] and state["k"]["n"] == 3  # input state untouched


def test_per_owner_baseline_by_hand():
    """Per owner with the pooled key as fallback (min_n 2, decay 0.5, no std scaling): owner A 1, 1; owner B 0, 0, 1.
    1 (A): no baseline anywhere (0, seeds A and the pool at 1); 1 (A): A has 1 < 2 rewards, the pool's m 1 -> 0;
    0 (B): B has none, the pool's m 1 -> -1, pool m 1/2; 0 (B): B has 1, the pool's m 1/2 -> -1/2, pool m 1/4;
    1 (B): B has 2 rewards at m 0 -> its own: +1 (the pool would say 3/4)."""
    keys = ["p|owner:A", "p|owner:A", "p|owner:B", "p|owner:B", "p|owner:B"]
    adv, state, warm = running_baseline([1.0, 1.0, 0.0, 0.0, 1.0], keys, None, decay=0.5, norm_by_std=False, fallback=["p"] * 5, min_n=2)
    assert adv == pytest.approx([0.0, 0.0, -1.0, -0.5, 1.0]) and warm == [True, False, False, False, False]
    assert state["p"]["n"] == 5 and state["p|owner:A"]["n"] == 2 and state["p|owner:B"]["n"] == 3
    assert state["p|owner:B"]["mean"] == pytest.approx(0.5)  # 0, 0 (a = 1/2, d 0), then 1: m = 0 + 1/2 * 1


def test_per_owner_baseline_neutralises_a_random_rater():
    """An honest owner right 10 % of the time and one rating at random (half thumbs-up), interleaved. Pooled, the random
    rater's thumbs-ups get about the advantage of the honest owner's right answers; per owner, about a third of it, and
    the random rater's advantages average about 0 (they carry no signal, so they should carry no weight)."""
    import random

    rng = random.Random(7)
    scores, owners = [], []
    for _ in range(2000):
        honest = rng.random() < 0.875
        scores.append(float(rng.random() < (0.1 if honest else 0.5)))
        owners.append("honest" if honest else "random")
    pooled_keys = ["chat|-|-"] * len(scores)
    pooled, _, _ = running_baseline(scores, pooled_keys, None, decay=0.98)
    per, _, _ = running_baseline(scores, [f"chat|-|-|owner:{o}" for o in owners], None, decay=0.98, fallback=pooled_keys, min_n=8)

    def mean(adv: list[float], owner: str, score: float) -> float:
        xs = [a for a, o, x in zip(adv[100:], owners[100:], scores[100:], strict=True) if o == owner and x == score]
        return sum(xs) / len(xs)

    # pooled: mean about 0.15, sd about 0.36 -> a thumbs-up is worth about +2.4 from either owner
    assert mean(pooled, "random", 1.0) == pytest.approx(mean(pooled, "honest", 1.0), rel=0.15)
    # per owner: the random rater's thumbs-up is (1 - 0.5) / 0.5 = +1, the honest right answer (1 - 0.1) / 0.3 = +3
    assert mean(per, "random", 1.0) == pytest.approx(1.0, abs=0.15) and mean(per, "honest", 1.0) > 2.5
    rnd = [a for a, o in zip(per[100:], owners[100:], strict=True) if o == "random"]
    assert abs(sum(rnd) / len(rnd)) < 0.15


def test_apply_to_singletons_keys_the_baseline_by_owner(srv):
    """The samples' owners key the baseline (per_owner): the state has the pooled key and one key per owner."""
    import dataclasses

    for prompt, v in (("first", 1.0), ("second", 0.0), ("third", 1.0)):
        r = chat(srv, prompt)
        feedback(srv, turn_id=ids(r)["turn_id"], reward=v)
    samples = sorted(collect(srv).samples, key=lambda s: s.created_at)
    samples = [dataclasses.replace(s, owner=o) for s, o in zip(samples, ["key-a", "key-b", "key-a"], strict=True)]
    est = estimate(samples, "grpo")
    adv, state, _ = apply_to_singletons(samples, est, None, decay=0.98, norm_by_std=True, per_owner=True, owner_min=1)
    # 1 (a): seeds; 0 (b): b has none -> the pool's m 1: -1; 1 (a): a's own baseline (m 1, no spread): 1 - 1 = 0
    assert list(adv) == pytest.approx([0.0, -1.0, 0.0])
    assert set(state) == {"chat|-|feedback", "chat|-|feedback|owner:key-a", "chat|-|feedback|owner:key-b"}
    pooled, pooled_state, _ = apply_to_singletons(samples, est, None, decay=0.98, norm_by_std=True)
    assert list(pooled) == pytest.approx([0.0, -1.0, 1.0]) and set(pooled_state) == {"chat|-|feedback"}


def test_one_off_prompts_learn_with_the_baseline(srv, trainer):
    """Three distinct prompts (singleton groups), rewarded 1, 0, 1 by turn_id: advantages 0 (seeds), -1, +1."""
    for prompt, v in (("first", 1.0), ("second", 0.0), ("third", 1.0)):  # as the example in docs/learning.md posts it
        r = client(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=4)
        client(srv).post("/feedback", body={"turn_id": r.model_extra["loopwise"]["turn_id"], "reward": v}, cast_to=object)
    batch = collect(srv)
    samples = sorted(batch.samples, key=lambda s: s.created_at)
    est = estimate(samples, "grpo")
    assert list(est) == [0.0, 0.0, 0.0]  # a group of one carries no relative signal
    adv, state, warmup = apply_to_singletons(samples, est, None, decay=0.98, norm_by_std=True)
    # 1: seeds m = 1; 0: s = 0 so A = 0 - 1 = -1, then m = 1/2, v = 1/2 (0 + 1/2 * 1) = 1/4; 1: A = (1 - 1/2) / (1/2) = +1
    assert list(adv) == pytest.approx([0.0, -1.0, 1.0])
    assert warmup == {samples[0].trajectory_id} and state["chat|-|feedback"]["n"] == 3
    assert adv.stats.n_zero_std_groups == 1  # only the seeding singleton still counts as a group without spread
    m = trainer.step(samples, adv)
    assert m.optimizer_step and m.trained_samples == 2
    why = unused_reasons({}, samples, adv, warmup=warmup)
    assert why["counts"] == {"baseline_warmup": 1} and why["trained"] == 2


def test_traffic_filters_by_kind_model_and_tag(srv):
    feedback(srv, turn_id=ids(chat(srv, "tagged", metadata={"tag": "support"}))["turn_id"], reward=1.0)
    feedback(srv, turn_id=ids(chat(srv, "untagged"))["turn_id"], reward=1.0)
    support = TrafficFilter(tags=["support"])
    pick = collect_samples(srv.store, family="f", cursor=Cursor(), cfg=SampleConfig(settle_s=0), current_version=0, traffic=support)
    assert [s.meta["tag"] for s in pick.samples] == ["support"] and pick.counts.other_traffic == 1
    assert pick.samples[0].meta["request_model"] == "tiny"
    none = collect_samples(srv.store, family="f", cursor=Cursor(), cfg=SampleConfig(settle_s=0), current_version=0, traffic=TrafficFilter(chat=False))
    assert none.samples == [] and none.counts.other_traffic == 2
    other_model = TrafficFilter(models=["someone-else"])
    assert collect_samples(srv.store, family="f", cursor=Cursor(), cfg=SampleConfig(settle_s=0), current_version=0, traffic=other_model).samples == []


def test_an_update_that_learns_nothing_says_why(srv, tiny_model_path):
    """Singleton chat traffic with [singletons] mode = 'drop': no step, and the status names one-off prompts."""
    for p in ("alpha", "beta", "gamma"):
        feedback(srv, turn_id=ids(chat(srv, p))["turn_id"], reward=1.0)
    chat(srv, "never rated")
    settings = LearnerSettings.model_validate(
        {
            "family": "chat-lora",
            "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "trainer": {"progress": False},
            "samples": {"settle_s": 0},
            "singletons": {"mode": "drop"},
        }
    )
    cfg = ServiceConfig(data_dir=srv.data, admin_url="http://127.0.0.1:9", admin_key="k", base_model=tiny_model_path, settings=settings, gate_n=0)
    svc = LearnerService(cfg)
    record = svc.update()
    assert record["metrics"]["optimizer_step"] is False
    assert record["unused"]["counts"] == {"singleton": 3, "no_reward": 1} and record["unused"]["top_key"] == "singleton"
    assert "one-off prompts" in record["gate"]["reason"] and "one-off prompts" in svc.status.detail
    assert svc.status.last_reasons["top_key"] == "singleton"


def two_turn(s: InProc, prompt: str, follow_up: str = "Are you sure? Answer with the number only.") -> tuple[Any, Any]:
    """A question, the reply as returned, then a follow-up: the second request continues the first's trajectory."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    first = client(s).chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": follow_up}]
    second = client(s).chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    return first, second


def test_two_turn_chats_rated_on_the_second_reply_train(srv, tiny_model_path):
    """The most ordinary shape of chat traffic: two-turn chats, a thumbs (source named by the client) on the second
    reply only. The learner's update trains both turns of each chat (the first shares the rating it led to) and raises
    nothing; a chat rated on its first reply only leaves the unrated second turn out (never judged)."""
    pairs = [two_turn(srv, f"What is {a}+{a}?") for a in range(4)]
    for (first, second), v in zip(pairs, [1.0, 0.0, 1.0, 0.0], strict=True):
        assert ids(second)["trajectory_id"] == ids(first)["trajectory_id"]  # stitched by its messages
        feedback(srv, turn_id=ids(second)["turn_id"], reward=v, source="user")
    early_first, _ = two_turn(srv, "rated on the first reply")
    feedback(srv, turn_id=ids(early_first)["turn_id"], reward=1.0, source="thumbs")

    batch = collect(srv)
    by_traj: dict[str, list[Any]] = {}
    for smp in batch.samples:
        by_traj.setdefault(smp.trajectory_id, []).append(smp)
    assert sorted(len(v) for v in by_traj.values()) == [1, 2, 2, 2, 2]
    assert batch.counts.after_last_reward == 1 and batch.counts.no_reward == 0

    settings = LearnerSettings.model_validate(
        {
            "family": "chat-lora",
            "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "trainer": {"progress": False},
            "samples": {"settle_s": 0},
        }
    )
    cfg = ServiceConfig(data_dir=srv.data, admin_url="http://127.0.0.1:9", admin_key="k", base_model=tiny_model_path, settings=settings, gate_n=0)
    record = LearnerService(cfg).update(publish=False)
    m = record["metrics"]
    # five one-off chats against the running baselines (one per reward source): the four rated "user" (1, 0, 1, 0, oldest
    # first) share one, whose first reward only seeds it; the chat rated "thumbs" seeds its own. So three chats train,
    # both turns of each: 6 of the 9 kept turns
    assert m["optimizer_step"] is True and m["samples"] == 9 and m["trained_samples"] == 6
    assert record["unused"]["counts"]["baseline_warmup"] == 3
    assert m["reward_mean"] == pytest.approx(3 / 5)


def test_baseline_advantages_are_bounded():
    """One 0 after a long run of 1s (a little spread early on): the running std is near 0, so the raw advantage would be
    about -1/s; the std floor (0.1) and the clip (3) bound it. Hand-computed: scores 0, then fifty 1s, then 0, decay 0.98."""
    scores = [0.0] + [1.0] * 50 + [0.0]
    keys = ["k"] * len(scores)
    raw, state, _ = running_baseline(scores, keys, None, decay=0.98, std_floor=1e-9, clip=1e9)
    n, m, v = 0, 0.0, 0.0
    for x in scores[:-1]:  # the recursion from the definition: a = max(1/(n+1), 1 - decay)
        a = max(1.0 / (n + 1), 0.02)
        d = x - m
        m, v, n = m + a * d, (1 - a) * (v + a * d * d), n + 1
    assert raw[-1] == pytest.approx(-m / math.sqrt(v)) and raw[-1] < -5  # unbounded: about -1/s
    floored, _, _ = running_baseline(scores, keys, None, decay=0.98, std_floor=0.1, clip=1e9)
    assert floored[-1] == pytest.approx(-m / max(math.sqrt(v), 0.1))
    bounded, _, _ = running_baseline(scores, keys, None, decay=0.98)  # the defaults: floor 0.1, clip 3
    assert bounded[-1] == -3.0 and all(abs(a) <= 3.0 for a in bounded)
    # garbage rewards of any size stay bounded too
    wild, _, _ = running_baseline([0.0, 100.0, -100.0, 50.0, 0.0], ["g"] * 5, None, decay=0.98)
    assert all(abs(a) <= 3.0 for a in wild) and wild[1] == 3.0
