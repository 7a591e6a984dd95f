"""Recording, stitching, feedback and the admin API, against ``serve.py``'s app on real ports (a process where one is killed), a real SQLite file."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sqlite3
import time

import httpx
import pytest

from tests.runtime._client import assert_error

MODEL = "tiny"
ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def rec_server(start_backend_server):
    """A recording server on each backend (embedded, and sglang against the fake)."""
    return start_backend_server("--admin-key", ADMIN)


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.base_url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30, **kw)


def chat(server, messages, *, session: str | None = None, **kw) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 1.0, "seed": 3, **kw}
    return httpx.post(server.url + "/chat/completions", json=body, headers=headers, timeout=60)


def trajectory(server, tid: str) -> dict:
    r = admin(server, "GET", f"/admin/trajectories/{tid}")
    assert r.status_code == 200, r.text
    return r.json()


def test_response_carries_ids_and_the_turn_has_the_exact_tokens(rec_server):
    r = chat(rec_server, [{"role": "user", "content": "hello there"}], logprobs=True, session="s-exact")
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["loopwise"]
    assert ids["turn_id"].startswith("turn-") and ids["trajectory_id"].startswith("traj-") and ids["adapter"] is None
    assert r.headers["x-loopwise-turn-id"] == ids["turn_id"]
    assert r.headers["x-loopwise-trajectory-id"] == ids["trajectory_id"]
    traj = trajectory(rec_server, ids["trajectory_id"])
    [turn] = traj["turns"]
    assert turn["turn_id"] == ids["turn_id"] and turn["index"] == 0 and turn["session_id"] == "s-exact"
    assert len(turn["context_ids"]) == body["usage"]["prompt_tokens"]
    assert len(turn["output_ids"]) == body["usage"]["completion_tokens"] == len(turn["logprobs"]) == len(turn["loss_mask"])
    assert turn["loss_mask"] == [1] * len(turn["output_ids"])
    # the recorded logprobs are the engine's, token for token (the response's list omits a final stop token)
    shown = [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]
    assert [round(x, 4) for x in turn["logprobs"][: len(shown)]] == [round(x, 4) for x in shown]
    assert turn["output_text"] == body["choices"][0]["message"]["content"]
    assert turn["messages"] == [{"role": "user", "content": "hello there"}]
    assert turn["sampling"]["seed"] == 3 and turn["finish_reason"] == body["choices"][0]["finish_reason"]


def test_output_ids_are_not_a_retokenization(rec_server, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    r = chat(rec_server, [{"role": "user", "content": "abc"}], max_tokens=24, seed=11)
    turn = trajectory(rec_server, r.json()["loopwise"]["trajectory_id"])["turns"][0]
    assert tok.decode(turn["output_ids"], skip_special_tokens=True) == turn["output_text"]
    # sampled byte-level tokens rarely re-tokenize to the same ids; the stored ids are the sampled ones
    assert turn["context_ids"] == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )


def test_n2_and_streamed_turns_are_recorded(rec_server):
    r = chat(rec_server, [{"role": "user", "content": "two please"}], n=2, session="s-n2")
    ids = r.json()["loopwise"]
    assert [c["index"] for c in ids["choices"]] == [0, 1]
    assert len({c["trajectory_id"] for c in ids["choices"]}) == 2  # siblings: one trajectory each
    for c in ids["choices"]:
        [turn] = trajectory(rec_server, c["trajectory_id"])["turns"]
        assert turn["turn_id"] == c["turn_id"] and turn["choice_index"] == c["index"]

    with httpx.stream(
        "POST",
        rec_server.url + "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "stream it"}], "max_tokens": 6, "stream": True, "seed": 1},
        timeout=60,
    ) as resp:
        head_turn = resp.headers["x-loopwise-turn-id"]
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    final = [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert final and final[-1]["loopwise"]["turn_id"] == head_turn
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    turn = trajectory(rec_server, final[-1]["loopwise"]["trajectory_id"])["turns"][0]
    assert turn["turn_id"] == head_turn and turn["output_text"] == text and len(turn["output_ids"]) == 6


def test_three_requests_stitch_into_one_trajectory_and_an_edit_branches(rec_server):
    sess = "s-stitch"
    msgs = [{"role": "user", "content": "first"}]
    first = chat(rec_server, msgs, session=sess).json()
    msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}, {"role": "user", "content": "second"}]
    second = chat(rec_server, msgs, session=sess).json()
    msgs += [{"role": "assistant", "content": second["choices"][0]["message"]["content"]}, {"role": "user", "content": "third"}]
    third = chat(rec_server, msgs, session=sess).json()
    tid = first["loopwise"]["trajectory_id"]
    assert second["loopwise"]["trajectory_id"] == tid == third["loopwise"]["trajectory_id"]
    turns = trajectory(rec_server, tid)["turns"]
    assert [t["index"] for t in turns] == [0, 1, 2]
    assert [t["turn_id"] for t in turns] == [first["loopwise"]["turn_id"], second["loopwise"]["turn_id"], third["loopwise"]["turn_id"]]
    assert turns[1]["parent_turn_id"] == turns[0]["turn_id"] and turns[2]["parent_turn_id"] == turns[1]["turn_id"]
    # edit the second user message: the request continues turn 0 again, which already has a successor
    edited = [*msgs[:2], {"role": "user", "content": "second, edited"}]
    branch = chat(rec_server, edited, session=sess).json()
    assert branch["loopwise"]["trajectory_id"] != tid
    bturn = trajectory(rec_server, branch["loopwise"]["trajectory_id"])["turns"][0]
    assert bturn["parent_turn_id"] == turns[0]["turn_id"]
    # the same conversation in another session does not stitch
    other = chat(rec_server, msgs[:3], session="s-other").json()
    assert other["loopwise"]["trajectory_id"] != tid


def test_feedback_turn_trajectory_completion_late_and_idempotent(rec_server):
    r = chat(rec_server, [{"role": "user", "content": "rate me"}], session="s-fb").json()
    turn_id, traj_id, comp_id = r["loopwise"]["turn_id"], r["loopwise"]["trajectory_id"], r["id"]
    url = rec_server.url + "/feedback"
    ok = httpx.post(url, json={"turn_id": turn_id, "reward": 1.0, "source": "thumbs:test"}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.json()["rewards"][0]["target"] == "turn" and ok.json()["duplicate"] is False
    time.sleep(0.3)  # a late reward
    assert httpx.post(url, json={"trajectory_id": traj_id, "reward": -0.5, "comment": "meh"}, timeout=30).status_code == 200
    assert httpx.post(url, json={"completion_id": comp_id, "reward": 0.25}, timeout=30).status_code == 200
    first = httpx.post(url, json={"turn_id": turn_id, "reward": 2.0, "idempotency_key": "k-1"}, timeout=30).json()
    again = httpx.post(url, json={"turn_id": turn_id, "reward": 2.0, "idempotency_key": "k-1"}, timeout=30).json()
    assert again["duplicate"] is True and again["rewards"][0]["reward_id"] == first["rewards"][0]["reward_id"]
    rewards = trajectory(rec_server, traj_id)["rewards"]
    assert sorted((rw["target"], rw["value"]) for rw in rewards) == [("trajectory", -0.5), ("turn", 0.25), ("turn", 1.0), ("turn", 2.0)]
    assert {rw["source"] for rw in rewards} == {"feedback", "thumbs:test"}


def test_feedback_errors(rec_server):
    url = rec_server.url + "/feedback"
    assert_error(httpx.post(url, json={"turn_id": "turn-nope", "reward": 1}, timeout=30), 404, code="not_found", param="turn_id")
    assert_error(httpx.post(url, json={"trajectory_id": "traj-nope", "reward": 1}, timeout=30), 404, code="not_found", param="trajectory_id")
    assert_error(httpx.post(url, json={"completion_id": "chatcmpl-nope", "reward": 1}, timeout=30), 404, code="not_found")
    nan = httpx.post(url, content=b'{"turn_id": "x", "reward": NaN}', headers={"content-type": "application/json"}, timeout=30)
    assert_error(nan, 400, param="reward")
    assert_error(httpx.post(url, json={"reward": 1}, timeout=30), 400)
    assert_error(httpx.post(url, json={"turn_id": "a", "trajectory_id": "b", "reward": 1}, timeout=30), 400)
    assert_error(httpx.post(url, json={"turn_id": "a", "reward": "high"}, timeout=30), 400, param="reward")


def test_concurrent_requests_record_exactly_the_expected_turns(rec_server):
    before = admin(rec_server, "GET", "/admin/stats").json()["turns"]

    def one(i: int) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"c{i}"}], "max_tokens": 6, "n": 2 if i % 3 == 0 else 1}
        if i % 2:
            body["stream"] = True
            with httpx.stream("POST", rec_server.url + "/chat/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200
                assert "data: [DONE]" in list(resp.iter_lines())
        else:
            assert httpx.post(rec_server.url + "/chat/completions", json=body, timeout=60).status_code == 200
        return body["n"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        expected = sum(pool.map(one, range(24)))
    # async durability: a response is sent once its turns are queued, and the writer commits them within
    # its 50 ms group-commit window (/admin/stats counts committed turns only), so wait for the last commit
    deadline = time.monotonic() + 10
    while (after := admin(rec_server, "GET", "/admin/stats").json())["turns"] - before < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after["turns"] - before == expected
    assert after["queued"] == 0


def test_admin_auth_listing_and_session_deletion(rec_server, start_server):
    assert_error(httpx.get(rec_server.base_url + "/admin/stats", timeout=10), 401, type="authentication_error", code="invalid_admin_key")
    wrong = httpx.get(rec_server.base_url + "/admin/stats", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert_error(wrong, 401, type="authentication_error", code="invalid_admin_key")
    r = chat(rec_server, [{"role": "user", "content": "MARKER-delete-me-7781"}], session="s-delete").json()
    httpx.post(rec_server.url + "/feedback", json={"turn_id": r["loopwise"]["turn_id"], "reward": 1}, timeout=30).raise_for_status()
    listed = admin(rec_server, "GET", "/admin/trajectories", params={"limit": 500, "rewarded": "true"}).json()["data"]
    assert r["loopwise"]["trajectory_id"] in {t["trajectory_id"] for t in listed}
    gone = admin(rec_server, "DELETE", "/admin/sessions/s-delete")
    assert gone.status_code == 200 and gone.json()["deleted_turns"] == 1
    assert_error(admin(rec_server, "GET", f"/admin/trajectories/{r['loopwise']['trajectory_id']}"), 404, code="not_found")
    assert admin(rec_server, "GET", "/admin/trajectories", params={"limit": 0}).status_code == 400


def test_no_record_and_no_admin_key(start_server):
    server = start_server("--no-record")
    r = chat(server, [{"role": "user", "content": "hi"}])
    assert r.status_code == 200 and "loopwise" not in r.json() and "x-loopwise-turn-id" not in r.headers
    assert_error(httpx.post(server.url + "/feedback", json={"turn_id": "t", "reward": 1}, timeout=10), 409, code="recording_disabled")
    assert_error(httpx.get(server.base_url + "/admin/stats", timeout=10), 403, type="permission_error", code="admin_disabled")
    # no turns are kept, but the Responses API stored this session's response: deleting the session deletes it (was a 409)
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    stored = httpx.post(server.url + "/responses", json=body, headers={"X-Session-Id": "s-nr"}, timeout=60)
    assert stored.status_code == 200, stored.text
    gone = httpx.delete(server.url + "/sessions/s-nr", timeout=10)
    assert gone.status_code == 200 and gone.json()["deleted_responses"] == 1 and gone.json()["deleted_turns"] == 0, gone.text
    assert httpx.get(server.url + f"/responses/{stored.json()['id']}", timeout=10).status_code == 404
    assert_error(httpx.delete(server.url + "/sessions/s-nr", timeout=10), 404, code="not_found")


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_kill_dash_nine_during_a_burst(start_server, tmp_path_factory, durability):
    """sync: every 200 has its turn after a kill -9. async: report how many were lost (bounded by the window)."""
    server = start_server("--durability", durability, "--max-batch-size", "16", process=True)  # kill -9 needs a process
    db = server.data_dir / "interactions.db"
    ok_turns: list[str] = []

    def one(i: int) -> str | None:
        try:
            r = chat(server, [{"role": "user", "content": f"burst {i}"}], max_tokens=4)
        except httpx.HTTPError:
            return None
        return r.json()["loopwise"]["turn_id"] if r.status_code == 200 else None

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(200)]
        while sum(f.done() for f in futures) < 40:
            time.sleep(0.02)
        os.kill(server.proc.pid, signal.SIGKILL)
        ok_turns = [t for f in futures if (t := f.result()) is not None]
    server.proc.wait()
    assert len(ok_turns) >= 40
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    stored = {row[0] for row in con.execute("SELECT turn_id FROM turns")}
    con.close()
    lost = [t for t in ok_turns if t not in stored]
    print(f"\n{durability}: {len(ok_turns)} responses returned 200 before kill -9; {len(lost)} of their turns missing")
    if durability == "sync":
        assert lost == []
