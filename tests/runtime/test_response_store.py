"""The stored responses on both backends (``responses`` is parametrised over the SQLite file and the PostgreSQL table):
round trips, owners kept apart (a key never reads, replaces or deletes another key's response), session deletion,
forbidden turns; and on PostgreSQL, two runtimes' stores on one database see the same responses."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.api.response_store import ResponseBackend, ResponseStore, StoredResponse


def stored(rid: str, owner: str = "key-a", session: str = "s1", turn: str | None = None, text: str = "hi") -> StoredResponse:
    body: dict[str, Any] = {"id": rid, "object": "response", "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}
    if turn is not None:
        body["loopwise"] = {"turn_id": turn}
    return StoredResponse(rid, owner, session, body, [{"id": "msg-1", "type": "message", "role": "user", "content": "q ✓"}])


@pytest.fixture(params=["sqlite", "postgresql"])
def responses(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResponseBackend]:
    if request.param == "sqlite":
        store: ResponseBackend = ResponseStore(tmp_path / "responses.db")
        yield store
        store.close()
        return
    from learner.records.store_pg import PostgresStore
    from runtime.api.response_store_pg import PostgresResponseStore

    db = PostgresStore(request.getfixturevalue("pg_url"), max_size=4)
    yield PostgresResponseStore(db)
    db.close()


def test_round_trip_and_replace(responses: ResponseBackend) -> None:
    assert responses.get("resp-1", "key-a") is None and not responses.delete("resp-1", "key-a") and responses.delete_session("key-a", "s1") == 0
    first = stored("resp-1")
    responses.put(first)
    assert responses.get("resp-1", "key-a") == first
    again = stored("resp-1", text="replaced")
    responses.put(again)
    assert responses.get("resp-1", "key-a") == again


def test_a_key_never_reads_replaces_or_deletes_another_keys_response(responses: ResponseBackend) -> None:
    mine = stored("resp-1", owner="key-a")
    responses.put(mine)
    assert responses.get("resp-1", "key-b") is None  # not found, as an unknown id
    assert not responses.delete("resp-1", "key-b")
    responses.put(stored("resp-1", owner="key-b", text="hijack"))  # the same id under another key changes nothing
    assert responses.get("resp-1", "key-a") == mine and responses.get("resp-1", "key-b") is None
    assert responses.delete_session("key-b", "s1") == 0 and responses.get("resp-1", "key-a") == mine
    assert responses.delete("resp-1", "key-a") and responses.get("resp-1", "key-a") is None


def test_delete_session_takes_only_that_owners_session(responses: ResponseBackend) -> None:
    for rid, owner, session in (("r1", "key-a", "s1"), ("r2", "key-a", "s1"), ("r3", "key-a", "s2"), ("r4", "key-b", "s1")):
        responses.put(stored(rid, owner=owner, session=session))
    assert responses.delete_session("key-a", "s1") == 2
    assert responses.get("r1", "key-a") is None and responses.get("r2", "key-a") is None
    assert responses.get("r3", "key-a") is not None and responses.get("r4", "key-b") is not None


def test_a_forbidden_turns_response_is_not_stored(responses: ResponseBackend) -> None:
    responses.forbid(["turn-doomed"])
    responses.put(stored("r1", turn="turn-doomed"))
    responses.put(stored("r2", turn="turn-kept"))
    assert responses.get("r1", "key-a") is None and responses.get("r2", "key-a") is not None


def test_forbid_waits_for_a_response_being_written(responses: ResponseBackend) -> None:
    """A deletion's ``forbid`` then ``delete_session`` never misses a response written between the two: the write either
    sees the turn forbidden or finishes first, and the session deletion then removes it."""
    for k in range(20):
        writer = threading.Thread(target=responses.put, args=(stored(f"r{k}", turn=f"turn-{k}"),))
        writer.start()
        responses.forbid([f"turn-{k}"])
        responses.delete_session("key-a", "s1")
        writer.join()
        assert responses.get(f"r{k}", "key-a") is None


def test_two_runtimes_on_one_postgres_share_responses(pg_url: str) -> None:
    from learner.records.store_pg import PostgresStore
    from runtime.api.response_store_pg import PostgresResponseStore

    dbs = [PostgresStore(pg_url, max_size=2) for _ in range(2)]
    try:
        a, b = PostgresResponseStore(dbs[0]), PostgresResponseStore(dbs[1])  # the second open finds the table migrated
        assert a.schema_version == b.schema_version == 1
        a.put(stored("resp-1", owner="key-a"))
        got = b.get("resp-1", "key-a")
        assert got is not None and got.context[0]["content"] == "q ✓"  # continued by id on the other runtime
        assert b.get("resp-1", "key-b") is None and not b.delete("resp-1", "key-b")
        assert b.delete_session("key-a", "s1") == 1 and a.get("resp-1", "key-a") is None
    finally:
        for db in dbs:
            db.close()
