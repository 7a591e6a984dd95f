"""Agent memory end to end: a real ``serve.py`` (tiny model) with two API keys, an admin key and memory agents.

What is checked: a key never sees another key's memory, even under the same scope name (404 like an
unknown scope); the admin sees everyone's; 401 without a key; the memory reaches the next request's
system prompt (in the recorded turn); each rewrite is a version with its provenance; deletion removes
every version and leaves no copy in the database file; a copilot that fails (its prompt does not fit
the context window) leaves the answer and the old memory alone and is logged; the memopilot rewrite is
recorded as the copilot's own trajectory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from memory.methods import parse_memory
from memory.store import MemoryStore, Provenance
from runtime.identity import owner_of_token
from tests.runtime._client import assert_error

KEY_A, KEY_B, ADMIN = "key-of-tenant-a", "key-of-tenant-b", "memory-admin"
OWNER_A = owner_of_token(KEY_A)
APPEND = {"name": "mem-append", "stop_policy": "answer", "constrain_format": False, "max_tokens_per_turn": 8, "max_turns": 1,
          "memory": {"method": "append-all", "scope": "user", "max_chars": 600}}  # fmt: skip
PILOT = {"name": "mem-pilot", "stop_policy": "answer", "constrain_format": False, "max_tokens_per_turn": 8, "max_turns": 1,
         "memory": {"method": "memopilot", "scope": "user", "max_tokens": 16}}  # fmt: skip
LONG = " ".join(["pebble"] * 50)  # the player's prompt fits 512 tokens, the copilot's (instructions + this log) does not


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("memory-server")


@pytest.fixture(scope="module")
def server(start_server, data_dir):
    args = ["--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN, "--max-model-len", "512", "--no-builtin-agents"]
    # a process: the tests read its JSON log lines (the copilot's failures)
    return start_server(*args, "--agent", json.dumps(APPEND), "--agent", json.dumps(PILOT), data_dir=data_dir, process=True)


def call(server, method: str, path: str, key: str | None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.base_url + path, headers=headers, timeout=60, **kw)


def chat(server, key: str, agent: str, user: str, text: str) -> dict:
    r = call(server, "POST", "/v1/chat/completions", key, json={"model": agent, "user": user, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return r.json()


def wait_for_version(server, key: str, scope: str, version: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = call(server, "GET", f"/v1/memory/{scope}", key)
        if r.status_code == 200 and r.json()["version"] >= version:
            return r.json()
        time.sleep(0.1)
    memory_log = [line for line in server.log().splitlines() if '"memory ' in line]
    raise AssertionError(f"memory {scope} did not reach version {version}: {r.status_code} {r.text}\n" + "\n".join(memory_log[-5:]))


def recorded_first_turn(server, trajectory_id: str) -> dict:
    r = call(server, "GET", f"/admin/trajectories/{trajectory_id}", ADMIN)
    assert r.status_code == 200, r.text
    return r.json()["turns"][0]


def test_memory_is_private_per_key_reaches_the_next_prompt_and_deletes_completely(server, data_dir):
    first = chat(server, KEY_A, "mem-append", "alice", "my code word is zebra-42")
    doc = wait_for_version(server, KEY_A, "user:alice", 1)
    assert doc["owner"] == OWNER_A and "User: my code word is zebra-42" in doc["text"]
    v1 = doc["versions"][0]
    assert v1["method"] == "append-all" and v1["trajectory_id"] == first["loopwise"]["trajectory_id"] and v1["copilot_trajectory_id"] is None

    # another key: the same scope name is a 404 exactly like a scope nobody has; its list is empty
    hidden = assert_error(call(server, "GET", "/v1/memory/user:alice", KEY_B), 404, code="memory_not_found", param="scope")
    unknown = assert_error(call(server, "GET", "/v1/memory/user:nobody", KEY_B), 404, code="memory_not_found", param="scope")
    assert hidden["message"].replace("alice", "X") == unknown["message"].replace("nobody", "X")
    assert call(server, "GET", "/v1/memory", KEY_B).json()["data"] == []
    assert [d["scope"] for d in call(server, "GET", "/v1/memory", KEY_A).json()["data"]] == ["user:alice"]
    assert_error(call(server, "GET", f"/v1/memory/user:alice?owner={OWNER_A}", KEY_B), 403, type="permission_error", param="owner")
    assert_error(call(server, "DELETE", "/v1/memory/user:alice", KEY_B), 404, code="memory_not_found")
    assert_error(call(server, "GET", "/v1/memory/user:alice", None), 401, type="authentication_error")
    assert_error(call(server, "GET", "/v1/memory/bogus:alice", KEY_A), 400, param="scope")
    assert_error(call(server, "GET", "/admin/memory", KEY_A), 401, type="authentication_error")

    # the admin sees everyone's
    listed = call(server, "GET", "/admin/memory", ADMIN).json()["data"]
    assert {"owner": OWNER_A, "scope": "user:alice"}.items() <= next(d for d in listed if d["scope"] == "user:alice").items()
    assert call(server, "GET", f"/admin/memory/{OWNER_A}/user:alice", ADMIN).json()["text"] == doc["text"]
    # ... only through /admin: the admin key is not an API key
    assert_error(call(server, "GET", "/v1/memory/user:alice", ADMIN), 401, type="authentication_error")

    # the next request of the same user gets the memory in its system prompt (the recorded context)
    second = chat(server, KEY_A, "mem-append", "alice", "what was my code word?")
    turn = recorded_first_turn(server, second["loopwise"]["trajectory_id"])
    assert turn["messages"][0]["role"] == "system" and "zebra-42" in turn["messages"][0]["content"]
    doc2 = wait_for_version(server, KEY_A, "user:alice", 2)
    assert [v["version"] for v in doc2["versions"]] == [2, 1]
    assert doc2["versions"][0]["trajectory_id"] == second["loopwise"]["trajectory_id"]
    assert "what was my code word?" in doc2["text"] and doc2["text"].index("zebra-42") < doc2["text"].index("what was my code word?")
    # the same user name under the other key starts from nothing
    other = chat(server, KEY_B, "mem-append", "alice", "hello")
    assert "zebra-42" not in recorded_first_turn(server, other["loopwise"]["trajectory_id"])["messages"][0]["content"]
    wait_for_version(server, KEY_B, "user:alice", 1)
    assert {d["owner"] for d in call(server, "GET", "/admin/memory", ADMIN).json()["data"] if d["scope"] == "user:alice"} == {
        OWNER_A,
        owner_of_token(KEY_B),
    }

    # deletion: every version, then 404, and no copy left in the database files
    gone = call(server, "DELETE", "/v1/memory/user:alice", KEY_A)
    assert gone.status_code == 200 and gone.json()["deleted_versions"] == 2
    assert_error(call(server, "GET", "/v1/memory/user:alice", KEY_A), 404, code="memory_not_found")
    assert_error(call(server, "DELETE", "/v1/memory/user:alice", KEY_A), 404, code="memory_not_found")
    assert call(server, "GET", "/v1/memory", KEY_A).json()["data"] == []
    for f in data_dir.glob("memory.db*"):
        assert b"zebra-42" not in f.read_bytes(), f
    assert wait_for_version(server, KEY_B, "user:alice", 1)["owner"] == owner_of_token(KEY_B)  # B's own alice is untouched


def test_a_failing_copilot_keeps_the_old_memory_and_the_answer_comes(server, data_dir):
    MemoryStore(data_dir / "memory.db").write(OWNER_A, "user:carol", "old lesson", Provenance("memopilot"))
    answer = chat(server, KEY_A, "mem-pilot", "carol", LONG)
    assert answer["choices"][0]["message"]["content"] is not None
    turn = recorded_first_turn(server, answer["loopwise"]["trajectory_id"])
    assert "old lesson" in turn["messages"][0]["content"]
    deadline = time.monotonic() + 30
    while "memory rewrite failed" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    failed = [json.loads(line) for line in server.log().splitlines() if "memory rewrite failed" in line]
    assert failed and failed[0]["scope"] == "user:carol" and "leaves no room" in failed[0]["exception"]
    doc = call(server, "GET", "/v1/memory/user:carol", KEY_A).json()
    assert doc["version"] == 1 and doc["text"] == "old lesson"


def test_the_memopilot_rewrite_is_the_copilots_own_recorded_turn(server):
    answer = chat(server, KEY_A, "mem-pilot", "dave", "hi")
    player = answer["loopwise"]["trajectory_id"]
    deadline = time.monotonic() + 30
    rows: list[dict] = []
    while not rows and time.monotonic() < deadline:
        listed = call(server, "GET", "/admin/trajectories?limit=50", ADMIN).json()["data"]
        rows = [t for t in listed if t["meta"].get("player_trajectory_id") == player]
        time.sleep(0.1)
    assert len(rows) == 1, "no copilot trajectory recorded for the player's run"
    meta = rows[0]["meta"]
    assert meta["agent"] == "memopilot" and meta["memory_scope"] == "user:dave" and meta["memory_method"] == "memopilot"
    traj = call(server, "GET", f"/admin/trajectories/{rows[0]['trajectory_id']}", ADMIN).json()
    assert traj["session_id"] == "dave" and len(traj["turns"]) == 1
    turn = traj["turns"][0]
    assert turn["model"] == "memopilot" and "<interaction_log>" in turn["messages"][1]["content"] and "hi" in turn["messages"][1]["content"]
    # the stored memory is exactly what the method parses out of the copilot's output (the tiny model's text is random)
    parsed = parse_memory(turn["output_text"])
    if parsed:
        prov = wait_for_version(server, KEY_A, "user:dave", 1)["versions"][0]
        assert prov["copilot_trajectory_id"] == traj["trajectory_id"] and prov["copilot_turn_id"] == turn["turn_id"]
        assert prov["method"] == "memopilot" and prov["adapter"] is None and prov["trajectory_id"] == player
    else:  # nothing parsed: the old (empty) memory is kept, no version is written
        time.sleep(0.5)
        assert_error(call(server, "GET", "/v1/memory/user:dave", KEY_A), 404, code="memory_not_found")
