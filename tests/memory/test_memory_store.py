"""The memory store on a real SQLite file: owners kept apart, versions and provenance, bounds, deletion, schema."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from memory.store import MemoryStore, MemoryTooLarge, Provenance, SchemaTooNew, StaleMemory, scope_name, valid_scope


def prov(n: int) -> Provenance:
    return Provenance("memopilot", adapter=f"memopilot@{n}", trajectory_id=f"traj-{n}", turn_id=f"turn-{n}", meta={"task_key": "rps"})


def test_owners_never_see_each_other(tmp_path: Path) -> None:
    s = MemoryStore(tmp_path / "memory.db")
    s.write("key-a", "user:alice", "A's note on alice", prov(1))
    assert s.read("key-b", "user:alice")[0] == ""
    assert s.current("key-b", "user:alice") is None and s.document("key-b", "user:alice") is None
    assert s.documents("key-b") == []
    assert s.delete("key-b", "user:alice") == 0
    assert s.read("key-a", "user:alice")[0] == "A's note on alice"
    s.write("key-b", "user:alice", "B's own alice", prov(2))
    assert s.current("key-a", "user:alice").text == "A's note on alice"
    assert [(d["owner"], d["scope"]) for d in s.documents(None)] == [("key-a", "user:alice"), ("key-b", "user:alice")]
    with pytest.raises(ValueError, match="owner"):
        s.read("key a' OR 1=1 --", "user:alice")


def test_versions_carry_provenance_and_only_the_newest_are_kept(tmp_path: Path) -> None:
    s = MemoryStore(tmp_path / "memory.db", keep_versions=3)
    for n in range(1, 6):
        saved = s.write("key-a", "session:s1", f"note {n}", prov(n))
        assert saved.version == n
    versions = s.versions("key-a", "session:s1")
    assert [v.version for v in versions] == [5, 4, 3]
    assert versions[0].provenance == prov(5) and versions[0].created_at >= versions[2].created_at
    doc = s.document("key-a", "session:s1")
    assert doc is not None and doc["text"] == "note 5" and doc["version"] == 5
    assert doc["versions"][0] == {"version": 5, "created_at": versions[0].created_at, "chars": 6, **prov(5).__dict__}
    assert s.documents("key-a") == [{"owner": "key-a", "scope": "session:s1", "version": 5, "chars": 6, "updated_at": versions[0].created_at}]
    s.close()
    reopened = MemoryStore(tmp_path / "memory.db")  # the versions and the schema persist
    assert reopened.current("key-a", "session:s1").text == "note 5" and reopened.schema_version == 1


def test_size_limit_and_scope_names(tmp_path: Path) -> None:
    s = MemoryStore(tmp_path / "memory.db", max_chars=10)
    with pytest.raises(MemoryTooLarge):
        s.write("key-a", "agent:rps", "x" * 11, prov(1))
    assert s.write("key-a", "agent:rps", "x" * 10, prov(1)).version == 1
    for bad in ("user:", "users:alice", "user:a/b", "user:a b", "alice", "user:" + "x" * 201):
        assert not valid_scope(bad)
        with pytest.raises(ValueError, match="scope"):
            s.read("key-a", bad)
    assert scope_name("user", "alice@example.com") == "user:alice@example.com"
    with pytest.raises(ValueError):
        scope_name("team", "x")


def test_deletion_is_complete_and_a_stale_rewrite_cannot_bring_memory_back(tmp_path: Path) -> None:
    s = MemoryStore(tmp_path / "memory.db")
    s.write("key-a", "user:alice", "secret-marker-1", prov(1))
    s.write("key-a", "user:alice", "secret-marker-2", prov(2))
    _, before = s.read("key-a", "user:alice")  # a rewrite read version 2 …
    assert s.delete("key-a", "user:alice") == 2  # … then the user deleted everything
    assert s.versions("key-a", "user:alice") == [] and s.delete("key-a", "user:alice") == 0
    with pytest.raises(StaleMemory):
        s.write("key-a", "user:alice", "rewritten from deleted memory", prov(3), base=before)
    _, empty = s.read("key-a", "user:alice")
    with pytest.raises(StaleMemory):  # a deletion between the run's read and the rewrite also counts when the doc was empty
        s.write("key-a", "user:alice", "x", prov(3), base=type(empty)(0, before.epoch))
    assert s.write("key-a", "user:alice", "fresh", prov(4), base=empty).version == 1  # read after the deletion: fine
    s.close()
    for f in tmp_path.glob("memory.db*"):
        assert b"secret-marker" not in f.read_bytes(), f


def test_a_concurrent_rewrite_is_refused_and_a_newer_schema_too(tmp_path: Path) -> None:
    s = MemoryStore(tmp_path / "memory.db")
    _, snap = s.read("key-a", "agent:x")
    s.write("key-a", "agent:x", "first", prov(1), base=snap)
    with pytest.raises(StaleMemory):
        s.write("key-a", "agent:x", "second from the same base", prov(2), base=snap)
    s.close()
    conn = sqlite3.connect(tmp_path / "memory.db")
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(SchemaTooNew):
        MemoryStore(tmp_path / "memory.db")
