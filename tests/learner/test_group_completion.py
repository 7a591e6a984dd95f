"""Group completion: siblings from a one-off chat turn's exact recorded context, scored by a reward hook or an LLM judge,
and skipped when the scorer ranks the original against its user's label.

In process: the app (scripted engine at the engine edge, tiny tokenizer, real recorder and SQLite store) and the
learner's ``GroupCompleter`` talking to it over HTTP with the admin key. The expected scores are the ones the
hook and the judge returned, exactly; the expected advantage signs follow from the scores' group mean.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from learner.advantages import TurnSample, compute_advantages
from learner.baseline import GROUP_ESTIMATORS, trajectory_score
from learner.config import SampleConfig, SingletonConfig
from learner.group_completion import (
    GroupCompleter,
    Label,
    ScorerError,
    contradicts,
    judge_messages,
    judge_order,
    judge_schema,
    merge_completed,
    parse_judge,
    user_label,
)
from learner.samples import Cursor, collect_samples, stored_trajectory_id
from learner.update import estimate
from tests.runtime._inproc import InProc, scripted_app

ADMIN = "gc-admin"
JUDGE = {"candidate_1": 2, "candidate_2": 9, "candidate_3": 5, "candidate_4": 1}  # scores 0..10: rewards 0.2, 0.9, 0.5, 0.1


def length_reward(messages: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """The user's reward function (a ``module:function`` hook): 1 / (1 + the reply's length)."""
    assert messages[-1]["content"] == "say something"
    return [1.0 / (1 + len(c)) for c in completions]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def srv(tokenizer, tmp_path):
    replies = iter(["hi", "hello there", "hey", "good day to you", "yo", "greetings", "hm"])

    def reply(req: Any) -> str:
        if "<candidate" in tokenizer.decode(req.input_ids):
            return json.dumps(JUDGE)
        return next(replies)

    app, engine, store = scripted_app(tokenizer, reply, tmp_path, admin_key=ADMIN)
    s = InProc(app)
    s.engine, s.store = engine, store
    yield s
    s.close()


def one_off(srv: InProc, reward: float = 1.0, target: str = "turn_id") -> str:
    """A one-off chat turn with the user's ``reward`` on its turn (``target="trajectory_id"``: on its trajectory)."""
    r = srv.client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "say something"}], "max_tokens": 5})
    ids = r.json()["loopwise"]
    assert srv.client.post("/v1/feedback", json={target: ids[target], "reward": reward}).status_code == 200
    turn: str = ids["turn_id"]
    return turn


def complete(srv: InProc, cfg: SingletonConfig) -> Any:
    batch = collect_samples(srv.store, family="chat-lora", cursor=Cursor(), cfg=SampleConfig(settle_s=0), current_version=0)
    [original] = GroupCompleter.candidates(batch.samples)

    async def run() -> Any:
        client = srv.aclient()
        client.headers["Authorization"] = f"Bearer {ADMIN}"
        async with client:
            completer = GroupCompleter(client, srv.store, cfg=cfg, family="chat-lora", samples_cfg=SampleConfig(settle_s=0))
            return completer, await completer.complete([original], model="tiny", seed=3)

    completer, report = asyncio.run(run())
    return original, completer, report


def test_a_reward_hook_scores_the_group_with_exactly_its_numbers(srv):
    turn = one_off(srv)
    cfg = SingletonConfig(mode="complete", scorer="hook", hook="tests.learner.test_group_completion:length_reward", group_size=4)
    original, completer, report = complete(srv, cfg)
    assert report.failed == 0 and report.siblings == 3 and completer.source == "learner:hook:tests.learner.test_group_completion:length_reward"
    texts = {s.trajectory_id: srv.store.get_trajectory(s.trajectory_id).turns[0].output_text for s in report.samples}
    assert sorted(texts.values()) == sorted(["hi", "hello there", "hey", "good day to you"])
    for s in report.samples:  # each member (the original too) carries exactly the hook's number for its text, under the hook's source
        assert s.trajectory_reward == 1.0 / (1 + len(texts[s.trajectory_id])) and s.trajectory_reward_source == completer.source
        assert s.reward is None  # the user's feedback on the original is not mixed into the hook's group
        assert s.group_id == original.group_id
    # the siblings were sampled from the original's exact context ids, with its recorded sampling
    stored = srv.store.get_turn(turn)
    sib_calls = srv.engine.calls[1:4]
    assert all(list(c.input_ids) == stored.context_ids for c in sib_calls)
    assert all(c.sampling.max_new_tokens == 5 for c in sib_calls)
    # recorded as the admin's re-rollouts: the live stream never takes them
    sibs = [srv.store.get_trajectory(t) for t in texts if t != original.trajectory_id]
    assert all(t.owner == "admin" and t.meta["rerollout"] and t.meta["branch_of"] == original.trajectory_id for t in sibs)
    live = collect_samples(srv.store, family="chat-lora", cursor=Cursor(), cfg=SampleConfig(settle_s=0), current_version=0)
    assert [s.trajectory_id for s in live.samples] == [original.trajectory_id] and live.counts.rerollout == 3
    # the original (1/3) is above the group's mean, as its thumbs-up says; all four answers came from the base model
    assert report.contradicted == 0 and report.as_dict()["version_mix"] == {"original base, siblings base": 1}
    # the hook's score on the user's own turn is training data, not A/B evidence: the base arm's evidence is the user's 1.0
    assert any(r.source == completer.source for r in srv.store.get_trajectory(original.trajectory_id).rewards)
    assert srv.store.arm_observations(None, 0.0, trusted_only=False)["rewards"] == [1.0]


def test_an_llm_judge_scores_the_whole_group_in_one_call_shuffled(srv):
    one_off(srv, reward=0.5)  # at label_threshold: no label, so no score can contradict it
    turns_before = srv.store.stats()["turns"]
    cfg = SingletonConfig(mode="complete", scorer="judge", judge_model="tiny", group_size=4)
    original, completer, report = complete(srv, cfg)
    assert completer.source == "learner:judge:tiny" and report.failed == 0 and report.contradicted == 0
    judge_calls = [c for c in srv.engine.calls if "<candidate" in srv.engine.tok.decode(c.input_ids)]
    assert len(judge_calls) == 1  # one call for the whole group
    prompt = srv.engine.tok.decode(judge_calls[0].input_ids)
    shown = dict(re.findall(r'<candidate id="(\d)">\n(.*?)\n</candidate>', prompt))
    assert sorted(shown) == ["1", "2", "3", "4"] and "say something" in prompt
    # each member carries the score the judge gave the candidate that showed its text, whatever position it had
    for s in report.samples:
        text = srv.store.get_trajectory(s.trajectory_id).turns[0].output_text
        [pos] = [i for i, t in shown.items() if t == text]
        assert s.trajectory_reward == JUDGE[f"candidate_{pos}"] / 10 and s.trajectory_reward_source == "learner:judge:tiny"
    assert sorted(s.trajectory_reward for s in report.samples) == [0.1, 0.2, 0.5, 0.9]
    # the order shown is judge_order's for this update's seed (complete: seed 3, first group) and this turn
    order = judge_order(4, f"3000:{original.turn_id}")
    texts = [srv.store.get_trajectory(t).turns[0].output_text for t in [original.trajectory_id, *report_siblings(report, original)]]
    assert [shown[str(k + 1)] for k in range(4)] == [texts[j] for j in order]
    assert srv.store.stats()["turns"] == turns_before + 3  # the three siblings; the judge's call is not recorded


def report_siblings(report: Any, original: Any) -> list[str]:
    """The siblings' trajectory ids in the order the runtime returned them (the group's member order)."""
    return [s.trajectory_id for s in report.samples if s.trajectory_id != original.trajectory_id]


def test_the_judge_order_is_a_seeded_uniform_shuffle():
    """Position bias lands nowhere in particular: over many groups the original (member 0) is shown at every position
    about equally often, and one key always gives the same order."""
    orders = [judge_order(4, f"{seed}:turn-x") for seed in range(400)]
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    assert [judge_order(4, f"{seed}:turn-x") for seed in range(400)] == orders
    at = [o.index(0) for o in orders]
    assert all(60 <= at.count(k) <= 140 for k in range(4)), [at.count(k) for k in range(4)]  # 100 expected, sd 8.7


def top_by_position(messages: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """A hook with a known spread: the original scores highest (n-1), its siblings n-2, ..., 0."""
    return [float(len(completions) - 1 - i) for i in range(len(completions))]


def all_equal(messages: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """A hook that cannot tell the answers apart."""
    return [0.7] * len(completions)


HOOKS = "tests.learner.test_group_completion:"


@pytest.mark.parametrize(
    ("reward", "target", "hook", "outcome"),
    [
        (1.0, "turn_id", "rank_by_position", "skipped"),  # thumbs-up scored lowest (0 of 0, 1, 2, 3; mean 1.5): skipped
        (1.0, "trajectory_id", "rank_by_position", "skipped"),  # the thumbs on the trajectory is the same label
        (1.0, "turn_id", "top_by_position", "up"),  # thumbs-up scored highest: trained up
        (1.0, "turn_id", "all_equal", "zero"),  # thumbs-up exactly at the mean: no contradiction, advantage 0
        (0.0, "turn_id", "rank_by_position", "down"),  # thumbs-down scored lowest: trained down, as the user said
        (-1.0, "trajectory_id", "top_by_position", "skipped"),  # a -1 thumbs-down scored highest: skipped
        (0.5, "turn_id", "rank_by_position", "down"),  # at label_threshold: no label, the scorer decides alone
    ],
)
def test_a_thumbs_up_original_is_never_trained_down_by_group_completion(srv, reward, target, hook, outcome):
    one_off(srv, reward=reward, target=target)
    cfg = SingletonConfig(mode="complete", scorer="hook", hook=HOOKS + hook, group_size=4)
    original, completer, report = complete(srv, cfg)
    assert report.failed == 0
    stored = srv.store.get_trajectory(original.trajectory_id)
    if outcome == "skipped":
        assert (report.contradicted, report.completed, report.samples, report.siblings) == (1, [], [], 0)
        [why] = report.as_dict()["contradictions"]
        assert why.startswith(original.turn_id) and ("thumbs-up" if reward > 0.5 else "thumbs-down") in why
        assert not any(r.source.startswith("learner:") for r in stored.rewards)  # a skipped group's scores are not recorded
        return
    assert report.contradicted == 0 and report.completed == [original.trajectory_id] and report.siblings == 3
    assert {s.trajectory_reward_source for s in report.samples} == {completer.source}  # the scorer's numbers alone
    [adv] = [a for s, a in zip(report.samples, estimate(report.samples, "grpo"), strict=True) if s.trajectory_id == original.trajectory_id]
    assert {"up": adv > 0, "zero": adv == 0, "down": adv < 0}[outcome], adv


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    scores=st.lists(st.floats(min_value=-100, max_value=100, allow_nan=False, allow_infinity=False), min_size=2, max_size=16),
    sign=st.sampled_from([1, -1]),
)
def test_no_group_estimator_trains_an_original_against_a_label_the_scorer_did_not_contradict(scores, sign):
    """The veto's line (the group's mean) is every group estimator's sign, so a group it lets through never trains the
    original (member 0) against its label; float rounding of a member exactly at the mean is far below 1e-6."""
    label = Label(sign, float(sign), "feedback")
    if contradicts(label, scores):
        assert sign * (scores[0] - sum(scores) / len(scores)) < 1e-9
        return
    group = [TurnSample(f"t{i}", "g", 0, None, s, n_tokens=1, anchor="ctx", state="ctx") for i, s in enumerate(scores)]
    for name in GROUP_ESTIMATORS:
        adv = compute_advantages(name, group)[0]
        assert sign * adv >= -1e-6, (name, scores, adv)


def test_the_user_label_is_the_newest_trusted_non_evaluator_reward_on_the_answer():
    from learner.records import Reward, Trajectory, Turn

    turn = Turn(
        turn_id="tu1", trajectory_id="tr1", session_id="s", index=0, completion_id="c", model="tiny",
        context_ids=[1], output_ids=[2], logprobs=[-0.1], loss_mask=[1], finish_reason="stop",
    )  # fmt: skip
    patterns = ["verifier:*", "feedback", "stars"]

    def label(*rewards: tuple[str, str, float, str, float], threshold: float = 0.5) -> Label | None:
        rs = [Reward(target=t, target_id=i, value=v, source=src, created_at=at) for t, i, v, src, at in rewards]  # type: ignore[arg-type]
        return user_label(Trajectory(trajectory_id="tr1", session_id="s", turns=[turn], rewards=rs), patterns=patterns, threshold=threshold)

    assert label() is None
    assert label(("trajectory", "tr1", 1.0, "verifier:math", 1.0)) is None  # an evaluator's reward is no user label
    assert label(("turn", "tu1", 1.0, "untrusted", 1.0)) is None  # a source the learner does not train on
    assert label(("turn", "tu9", 1.0, "feedback", 1.0)) is None  # on another turn
    assert label(("turn", "tu1", 0.5, "feedback", 1.0)) is None  # at the threshold: no label
    assert label(("turn", "tu1", 1.0, "feedback", 1.0)) == Label(1, 1.0, "feedback")
    assert label(("turn", "tu1", -1.0, "feedback", 1.0)) == Label(-1, -1.0, "feedback")
    assert label(("turn", "tu1", 1.0, "feedback", 1.0), ("trajectory", "tr1", 0.0, "feedback", 2.0)) == Label(-1, 0.0, "feedback")  # newest
    assert label(("turn", "tu1", 0.0, "feedback", 1.0), ("turn", "tu1", 5.0, "stars", 2.0)) == Label(-1, 0.0, "feedback")  # best-ranked
    assert label(("turn", "tu1", 2.0, "stars", 1.0), threshold=3.0) == Label(-1, 2.0, "stars")  # 1-5 stars with threshold 3


def test_admin_replay_endpoints_are_the_admins(srv):
    turn = one_off(srv)
    for path, body in (
        (f"/admin/turns/{turn}/siblings", {"n": 2}),
        ("/admin/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
    ):
        assert srv.client.post(path, json=body, headers={"Authorization": "Bearer user-key"}).status_code == 401
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert srv.client.post("/admin/turns/turn-nope/siblings", json={"n": 2}, headers=admin).status_code == 404
    bad = srv.client.post(f"/admin/turns/{turn}/siblings", json={"n": 99}, headers=admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"


def test_the_siblings_body_is_validated_field_by_field(srv):
    """``SiblingsRequest``: JSON's own types within the limits, else a 400 ``invalid_value`` naming the field, before the turn
    is looked up; other keys are ignored."""
    turn = one_off(srv)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    bad_bodies = [
        ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": True}, "n"), ({"n": "2"}, "n"), ({"n": 2.0}, "n"), ({"n": None}, "n"),
        ({"record": None}, "record"), ({"record": 1}, "record"), ({"model": 3}, "model"),
        ({"seed": -1}, "seed"), ({"seed": 2**62}, "seed"), ({"seed": True}, "seed"),
        ({"temperature": 2.5}, "temperature"), ({"temperature": -0.1}, "temperature"), ({"temperature": True}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 4097}, "max_tokens"), ({"max_tokens": 3.0}, "max_tokens"),
    ]  # fmt: skip
    for body, param in bad_bodies:
        r = srv.client.post(f"/admin/turns/{turn}/siblings", json=body, headers=admin)
        error = r.json()["error"]
        assert (r.status_code, error["param"], error["code"], error["type"]) == (400, param, "invalid_value", "invalid_request_error"), body
        assert param in error["message"]
    assert srv.client.post("/admin/turns/turn-nope/siblings", json={"n": 0}, headers=admin).json()["error"]["param"] == "n"
    r = srv.client.post(f"/admin/turns/{turn}/siblings", content=b"[1]", headers={**admin, "Content-Type": "application/json"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json")
    turns = srv.store.stats()["turns"]
    body = {"n": 2, "model": "", "seed": 7, "record": False, "temperature": 0, "max_tokens": 3, "unknown": "ignored"}
    ok = srv.client.post(f"/admin/turns/{turn}/siblings", json=body, headers=admin)
    assert ok.status_code == 200 and [set(d) for d in ok.json()["data"]] == [{"text", "output_ids", "logprobs"}] * 2
    assert srv.store.stats()["turns"] == turns  # record false: nothing recorded
    sampled = [c.sampling for c in srv.engine.calls[-2:]]
    assert [(sp.temperature, sp.max_new_tokens, sp.seed) for sp in sampled] == [(0.0, 3, 7), (0.0, 3, 8)]  # choice i: seed + i


def test_judge_prompt_and_parsing():
    msgs = judge_messages([{"role": "user", "content": "2+2?"}], ["4", "5"], "Correct answers win.")
    assert "Correct answers win." in msgs[0]["content"] and '<candidate id="2">\n5\n</candidate>' in msgs[1]["content"]
    assert parse_judge('{"candidate_2": 17, "candidate_1": 5}', 2) == [0.5, 1.0]  # score / 10, clipped to [0, 1]
    with pytest.raises(ScorerError, match=r"no candidate \[2\]"):
        parse_judge('{"candidate_1": 5}', 2)
    schema = judge_schema(3)
    assert schema["required"] == ["candidate_1", "candidate_2", "candidate_3"] and schema["properties"]["candidate_1"]["enum"] == list(range(11))
    with pytest.raises(ScorerError):
        parse_judge("I think the first one", 2)


def test_a_hook_over_http_and_a_wrong_hook():
    """An http hook (a real local server) is POSTed messages and completions; one that returns the wrong count fails."""
    seen: list[dict[str, Any]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            scores = [float(len(c)) for c in body["completions"]][:2]  # at most two scores: wrong for a group of three
            out = json.dumps({"scores": scores}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *_: Any) -> None: ...

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        cfg = SingletonConfig(mode="complete", scorer="hook", hook=url, group_size=2)
        completer = GroupCompleter(None, None, cfg=cfg, family="f", samples_cfg=SampleConfig())  # type: ignore[arg-type]
        assert asyncio.run(completer.score([{"role": "user", "content": "q"}], ["ab", "abcd"])) == [2.0, 4.0]
        assert seen == [{"messages": [{"role": "user", "content": "q"}], "completions": ["ab", "abcd"]}]
        assert completer.source == f"learner:hook:127.0.0.1:{server.server_address[1]}_score"
        with pytest.raises(ScorerError, match="need a list of 3 numbers"):
            asyncio.run(completer.score([{"role": "user", "content": "q"}], ["a", "b", "c"]))
    finally:
        server.shutdown()


def rank_by_position(messages: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """A hook with a known spread: member i scores i (the original 0, its siblings 1, 2, ...)."""
    return [float(i) for i in range(len(completions))]


SEEN_BY_HOOK: list[list[dict[str, Any]]] = []


def top_and_remember(messages: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """``top_by_position`` that also keeps the conversation it was shown."""
    SEEN_BY_HOOK.append(messages)
    return top_by_position(messages, completions)


def conversation(srv: InProc, turns: int) -> list[dict[str, Any]]:
    """A chat of ``turns`` user turns, each request resending the whole conversation (stitched into one trajectory);
    the ``loopwise`` ids of each reply, in order."""
    messages: list[dict[str, Any]] = []
    ids = []
    for k in range(turns):
        messages.append({"role": "user", "content": "say something" if k == 0 else f"and now follow-up {k}"})
        r = srv.client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 5}).json()
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        ids.append(r["loopwise"])
    assert len({i["trajectory_id"] for i in ids}) == 1  # stitched by its messages
    return ids


@pytest.mark.parametrize(
    ("turns", "rated"),
    [(2, 1), (2, 0), (3, 1), (3, 2), (3, "trajectory"), (1, "trajectory")],
    ids=["2-turns-rated-last", "2-turns-rated-first", "3-turns-rated-middle", "3-turns-rated-last", "3-turns-rated-whole", "1-turn-rated-whole"],
)
def test_a_multi_turn_chat_is_completed_at_its_last_rated_turn(srv, turns, rated):
    """The usual chat (a question, the reply, a follow-up, the reply, a thumbs on the last one) is completed at the rated
    reply: siblings from that turn's exact context, scored with the conversation up to it; the turns after it are not
    trained, the turns before it keep the user's rating as a group of their own (the running baseline's input)."""
    ids = conversation(srv, turns)
    target = {"trajectory_id": ids[0]["trajectory_id"]} if rated == "trajectory" else {"turn_id": ids[rated]["turn_id"]}
    assert srv.client.post("/v1/feedback", json={**target, "reward": 1.0}).status_code == 200
    k = turns - 1 if rated == "trajectory" else rated  # the last rated turn
    seen = importlib.import_module(HOOKS[:-1]).SEEN_BY_HOOK  # the hook's module as the learner imports it
    seen.clear()
    cfg = SingletonConfig(mode="complete", scorer="hook", hook=HOOKS + "top_and_remember", group_size=4)
    live = collect_samples(srv.store, family="chat-lora", cursor=Cursor(), cfg=SampleConfig(settle_s=0), current_version=0).samples
    assert sorted(s.turn_index for s in live) == list(range(k + 1))  # turns after the rated one are left out
    original, completer, report = complete(srv, cfg)
    assert (original.turn_id, original.turn_index) == (ids[k]["turn_id"], k)
    assert report.failed == report.contradicted == 0 and report.siblings == 3
    stored = srv.store.get_turn(ids[k]["turn_id"])
    sib_calls = [c for c in srv.engine.calls if c.sampling.max_new_tokens == 5][turns:]  # after the user's own turns
    assert len(sib_calls) == 3 and all(list(c.input_ids) == stored.context_ids for c in sib_calls)
    [shown] = seen  # the scorer saw the conversation up to the completed reply
    assert [m["role"] for m in shown] == ["user", "assistant"] * k + ["user"] and shown[-1]["content"] == stored.messages[-1]["content"]
    # the group: the original's completed turn and three one-turn siblings, the hook's 3, 2, 1, 0, under its source only
    assert sorted((s.turn_index if s.trajectory_id == original.trajectory_id else -1) for s in report.samples) == [-1, -1, -1, k]
    assert sorted(trajectory_score([s]) for s in report.samples) == [0.0, 1.0, 2.0, 3.0]
    assert {s.trajectory_reward_source or s.reward_source for s in report.samples} == {completer.source}
    adv = dict(zip([s.turn_id for s in report.samples], estimate(report.samples, "grpo"), strict=True))
    assert adv[original.turn_id] == pytest.approx(1.5 / statistics.stdev([3, 2, 1, 0]))  # GRPO: (3 - mean) / std
    if turns > 1:  # a multi-turn original is scored on its turn, never on the whole conversation
        scored = [r for r in srv.store.get_trajectory(original.trajectory_id).rewards if r.source == completer.source]
        assert [(r.target, r.target_id, r.value) for r in scored] == [("turn", original.turn_id, 3.0)]
    merged = merge_completed(live, report)
    before = [s for s in merged if stored_trajectory_id(s.trajectory_id) == original.trajectory_id and s.turn_id != original.turn_id]
    assert sorted(s.turn_index for s in before) == list(range(k))  # the earlier turns stay, out of the group, a trajectory of their own
    assert all((s.trajectory_id, s.group_id) == (f"{original.trajectory_id}#before", f"{original.group_id}#before") for s in before)
    assert not {s.trajectory_id for s in before} & {s.trajectory_id for s in report.samples}
    if before:  # their score is the user's rating, as the whole conversation's was, under the user's source
        assert trajectory_score(before) == trajectory_score([s for s in live if s.trajectory_id == original.trajectory_id]) == 1.0
        assert {s.trajectory_reward_source for s in before} == {"feedback"}
    assert len(merged) == len(report.samples) + k


def test_a_part_of_a_trajectory_is_quarantined_as_the_stored_trajectory():
    """A bad sample of a conversation's earlier turns (trained as ``<id>#before``) quarantines the stored conversation."""
    from learner.trainer import SampleError

    assert SampleError("bad ids", ["traj-a#before", "traj-a", "traj-b"]).trajectory_ids == ["traj-a", "traj-b"]
    assert stored_trajectory_id("traj-c") == "traj-c"
