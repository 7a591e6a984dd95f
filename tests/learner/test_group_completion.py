"""Group completion: siblings from a one-off chat turn's exact recorded context, scored by a reward hook or an LLM judge.

In process: the app (scripted engine at the engine edge, tiny tokenizer, real recorder and SQLite store) and the
learner's ``GroupCompleter`` talking to it over HTTP with the admin key. The expected scores are the ones the
hook and the judge returned, exactly.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from learner.config import SampleConfig, SingletonConfig
from learner.group_completion import GroupCompleter, ScorerError, judge_messages, judge_schema, parse_judge
from learner.samples import Cursor, collect_samples
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


def one_off(srv: InProc) -> str:
    r = srv.client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "say something"}], "max_tokens": 5})
    turn = r.json()["loopwise"]["turn_id"]
    assert srv.client.post("/v1/feedback", json={"turn_id": turn, "reward": 1.0}).status_code == 200
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
    assert report.failed == 0 and report.siblings == 3 and completer.source == "hook:tests.learner.test_group_completion:length_reward"
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


def test_an_llm_judge_scores_the_whole_group_in_one_call(srv):
    one_off(srv)
    turns_before = srv.store.stats()["turns"]
    cfg = SingletonConfig(mode="complete", scorer="judge", judge_model="tiny", group_size=4)
    original, completer, report = complete(srv, cfg)
    assert completer.source == "judge:tiny" and report.failed == 0
    by_traj = {s.trajectory_id: s.trajectory_reward for s in report.samples}
    # candidate i of the judge's prompt is member i of the group: the original first, then the siblings in order
    assert by_traj[original.trajectory_id] == 0.2 and sorted(by_traj.values()) == [0.1, 0.2, 0.5, 0.9]
    judge_calls = [c for c in srv.engine.calls if "<candidate" in srv.engine.tok.decode(c.input_ids)]
    assert len(judge_calls) == 1  # one call for the whole group
    prompt = srv.engine.tok.decode(judge_calls[0].input_ids)
    assert all(f'<candidate id="{i}">' in prompt for i in range(1, 5)) and "say something" in prompt
    assert srv.store.stats()["turns"] == turns_before + 3  # the three siblings; the judge's call is not recorded


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
        assert completer.source == f"hook:127.0.0.1:{server.server_address[1]}_score"
        with pytest.raises(ScorerError, match="need a list of 3 numbers"):
            asyncio.run(completer.score([{"role": "user", "content": "q"}], ["a", "b", "c"]))
    finally:
        server.shutdown()


def rank_by_position(messages: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """A hook with a known spread: member i scores i (the original 0, its siblings 1, 2, ...)."""
    return [float(i) for i in range(len(completions))]
