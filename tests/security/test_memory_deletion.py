"""Deleting a memory leaves no copy of it: the recorded runs whose prompts held it go too (the memory's text was
still in ``interactions.db`` after ``DELETE /v1/memory/...`` although the docs (now ``docs/agents.md``) promised no copy is left)."""

from __future__ import annotations

import time
from pathlib import Path

from memory.copilot import MEMORY_HEADER
from tests.security._app import ADMIN, KEY1, KEY2, auth, served

APPEND = {"name": "mem-append", "stop_policy": "answer", "constrain_format": False, "max_tokens_per_turn": 4, "max_turns": 1,
          "memory": {"method": "append-all", "scope": "user", "max_chars": 600}}  # fmt: skip


def _chat(app, key: str, text: str) -> dict:
    body = {"model": "mem-append", "user": "alice", "messages": [{"role": "user", "content": text}]}
    r = app.post("/v1/chat/completions", json=body, headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()["loopwise"]


def _wait_version(app, key: str, version: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = app.get("/v1/memory/user:alice", headers=auth(key))
        if r.status_code == 200 and r.json()["version"] >= version:
            return
        time.sleep(0.05)
    raise AssertionError("the memory was not written")


def _on_disk(data: Path) -> bytes:
    return b"".join(p.read_bytes() for p in data.glob("interactions.db*"))


def test_deleting_a_memory_deletes_the_recorded_prompts_that_held_it(tmp_path, tiny_model_path):
    from agents.host import Host
    from memory.store import MemoryStore
    from tools.builtins import default_registry

    memory = MemoryStore(tmp_path / "memory.db")
    host = Host([APPEND], default_registry(python=False, cuda=False), memory=memory)
    with served(tmp_path, tiny_model_path, agents=host, memory=memory) as app:
        first = _chat(app, KEY1, "my code word is zebra")
        _wait_version(app, KEY1, 1)
        second = _chat(app, KEY1, "what was my code word?")  # its prompt holds the memory
        other = _chat(app, KEY2, "hello")  # key 2's alice: its own, empty memory
        traj = app.get(f"/admin/trajectories/{second['trajectory_id']}", headers=auth(ADMIN)).json()
        assert MEMORY_HEADER in traj["turns"][0]["messages"][0]["content"]
        _wait_version(app, KEY1, 2)
        r = app.delete("/v1/memory/user:alice", headers=auth(KEY1))
        assert r.status_code == 200, r.text
        assert app.get(f"/admin/trajectories/{second['trajectory_id']}", headers=auth(ADMIN)).status_code == 404
        assert app.get(f"/admin/trajectories/{first['trajectory_id']}", headers=auth(ADMIN)).status_code == 200  # held no memory
        assert app.get(f"/admin/trajectories/{other['trajectory_id']}", headers=auth(ADMIN)).status_code == 200
    assert MEMORY_HEADER.encode() not in _on_disk(tmp_path)
