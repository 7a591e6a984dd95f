"""The memory store on both backends (``open_memory`` is parametrised over a real SQLite file and real PostgreSQL tables):
owners kept apart, versions and provenance, bounds, deletion, schema; and on PostgreSQL, two runtimes' stores on one
database: one document, the same owner rules, racing rewrites and a deletion from the other runtime."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from learner.records.migrations import SchemaTooNew
from memory.store import MemoryQueries, MemoryStore, MemoryTooLarge, Provenance, StaleMemory, scope_name, valid_scope

Open = Callable[..., MemoryQueries]


def prov(n: int) -> Provenance:
    return Provenance("memopilot", adapter=f"memopilot@{n}", trajectory_id=f"traj-{n}", turn_id=f"turn-{n}", meta={"task_key": "rps"})


@pytest.fixture(params=["sqlite", "postgresql"])
def open_memory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Open]:
    """``open_memory(**kw)`` opens (or reopens) the memory store of this test, on the parametrised backend."""
    opened: list[Any] = []

    def open_one(**kw: Any) -> MemoryQueries:
        if request.param == "sqlite":
            store: MemoryQueries = MemoryStore(tmp_path / "memory.db", **kw)
        else:
            from learner.records.store_pg import PostgresStore
            from memory.store_pg import PostgresMemoryStore

            db = PostgresStore(request.getfixturevalue("pg_url"), max_size=2)
            opened.append(db)
            store = PostgresMemoryStore(db, **kw)
        opened.append(store)
        return store

    yield open_one
    for x in reversed(opened):
        x.close()


def test_owners_never_see_each_other(open_memory: Open) -> None:
    s = open_memory()
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


def test_versions_carry_provenance_and_only_the_newest_are_kept(open_memory: Open) -> None:
    s = open_memory(keep_versions=3)
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
    reopened = open_memory()  # the versions and the schema persist
    assert reopened.current("key-a", "session:s1").text == "note 5" and reopened.schema_version == 1


def test_size_limit_and_scope_names(open_memory: Open) -> None:
    s = open_memory(max_chars=10)
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


def test_deletion_is_complete_and_a_stale_rewrite_cannot_bring_memory_back(open_memory: Open, tmp_path: Path) -> None:
    s = open_memory()
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
    for f in tmp_path.glob("memory.db*"):  # SQLite overwrites the freed pages; PostgreSQL's dead tuples are its operator's
        assert b"secret-marker" not in f.read_bytes(), f


def test_deleting_a_document_that_does_not_exist_costs_no_one_anything(open_memory: Open) -> None:
    """A 404 deletion changed state: on PostgreSQL it bumped its deletion bucket, shared with other owners' documents, so
    another key could make their pending rewrites stale by deleting names it never wrote; on SQLite each one added an entry
    to the store's deletion map for good (a key looping over fresh names grew the server's memory without bound)."""
    import hashlib

    def bucket(owner: str, scope: str) -> bytes:  # the first 16 bits of the document's hash (memory/store_pg.py)
        return hashlib.sha256(f"{owner}\x00{scope}".encode()).digest()[:2]

    s = open_memory()
    s.write("key-a", "user:alice", "note", prov(1))
    _, snap = s.read("key-a", "user:alice")  # a copilot rewrite under way
    target = bucket("key-a", "user:alice")
    same_bucket = next(f"user:x{i}" for i in range(10**6) if bucket("key-b", f"user:x{i}") == target)
    for scope in (same_bucket, *(f"user:y{i}" for i in range(20))):
        assert s.delete("key-b", scope) == 0
    assert s.delete("key-a", "user:bob") == 0
    assert s.write("key-a", "user:alice", "rewritten", prov(2), base=snap).version == 2
    if isinstance(s, MemoryStore):
        assert s._deleted == {}


def test_a_concurrent_rewrite_is_refused_and_a_newer_schema_too(open_memory: Open, tmp_path: Path) -> None:
    s = open_memory()
    _, snap = s.read("key-a", "agent:x")
    s.write("key-a", "agent:x", "first", prov(1), base=snap)
    with pytest.raises(StaleMemory):
        s.write("key-a", "agent:x", "second from the same base", prov(2), base=snap)
    s.close()
    if isinstance(s, MemoryStore):
        conn = sqlite3.connect(tmp_path / "memory.db")
        conn.execute("PRAGMA user_version = 99")
        conn.close()
    else:
        with s.db.transaction() as pg:  # type: ignore[attr-defined]
            pg.execute("UPDATE loopwise_memory_schema SET version = 99")
    with pytest.raises(SchemaTooNew):
        open_memory()


# -- PostgreSQL: two runtimes' memory stores on one database ----------------------------------------------


@pytest.fixture
def two_runtimes(pg_url: str) -> Iterator[tuple[MemoryQueries, MemoryQueries]]:
    from learner.records.store_pg import PostgresStore
    from memory.store_pg import PostgresMemoryStore

    dbs = [PostgresStore(pg_url, max_size=4) for _ in range(2)]
    yield PostgresMemoryStore(dbs[0]), PostgresMemoryStore(dbs[1])
    for db in dbs:
        db.close()


def test_two_runtimes_share_one_document_under_the_same_owner_rules(two_runtimes: tuple[MemoryQueries, MemoryQueries]) -> None:
    a, b = two_runtimes
    a.write("key-a", "user:alice", "A's note", prov(1))
    assert b.read("key-a", "user:alice")[0] == "A's note" and b.document("key-a", "user:alice")["version"] == 1  # type: ignore[index]
    assert b.read("key-b", "user:alice")[0] == "" and b.delete("key-b", "user:alice") == 0  # another key's: as if absent
    assert b.write("key-a", "user:alice", "B's rewrite", prov(2)).version == 2  # the next version, whichever runtime
    assert [d["version"] for d in a.documents("key-a")] == [2] and a.documents("key-b") == []
    _, snap = a.read("key-a", "user:alice")  # a rewrite on A read version 2 ...
    assert b.delete("key-a", "user:alice") == 2  # ... B deleted the document ...
    b.write("key-a", "user:alice", "fresh 1", prov(3))
    b.write("key-a", "user:alice", "fresh 2", prov(4))  # ... and two new versions brought it back to version 2
    with pytest.raises(StaleMemory):  # A's rewrite of the deleted memory is refused all the same
        a.write("key-a", "user:alice", "rewritten from deleted memory", prov(5), base=snap)
    assert a.read("key-a", "user:alice")[0] == "fresh 2"


def test_racing_rewrites_on_two_runtimes_take_one_version_each_or_are_refused(two_runtimes: tuple[MemoryQueries, MemoryQueries]) -> None:
    a, b = two_runtimes
    barrier = threading.Barrier(8)
    saved: list[int] = []
    stale: list[str] = []
    errors: list[BaseException] = []

    def rewrite(store: MemoryQueries, k: int, with_base: bool) -> None:
        try:
            _, snap = store.read("key-a", "agent:x")
            barrier.wait()
            saved.append(store.write("key-a", "agent:x", f"text {k}", prov(k), base=snap if with_base else None).version)
        except StaleMemory as exc:
            stale.append(str(exc))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rewrite, args=((a, b)[k % 2], k, k < 4)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    # the four unconditional writes each took a version of their own; of the four based on version 0, at most one won
    assert sorted(saved) == list(range(1, len(saved) + 1)) and 5 >= len(saved) >= 4 and len(saved) + len(stale) == 8
