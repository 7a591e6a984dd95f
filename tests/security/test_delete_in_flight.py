"""Deleting a session deletes it everywhere, its turns still on their way to the store included (issue 42, item 8).

A real server (``serve.build`` behind uvicorn on a free port: the ``start_server`` fixture) with two API keys and an
admin key, on SQLite and on PostgreSQL; the store is queried directly afterwards. The recorder is held
deterministically at one point of a turn's way to the store while ``DELETE /v1/sessions/{key}`` arrives:

- in the queue: the writer thread is held inside ``append_turns`` (it took the batch before the deletion), so
  the session's turns recorded meanwhile wait in the queue;
- before the queue: the request is still generating (its ``record`` call is held) when the deletion arrives;
- in the journal: the store refused the turns, the recorder journaled them to replay later.

Each time, the deleting key's session must be gone for good once everything drained, while the same session name of
the other key, and the deleting key's other session, are all written. Plus two narrower checks: a turn waiting for
room in a full queue (backpressure) is dropped as well, and on PostgreSQL a reward stored while the session is being
deleted is not left behind on a deleted turn.

Before: the deletion flushed the queue and deleted what the store held, so a request still generating, or one waiting
for room, queued its turn after the flush and wrote it after the deletion; journaled turns were replayed into the
store after it; queued turns were written and then deleted (they reached the disk); a reward racing the deletion on
PostgreSQL stayed behind; stored ``/v1/responses`` of the session were not deleted at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from learner.records import Reward, Turn
from runtime.identity import owner_of_token

KEY1, KEY2, ADMIN = "delete-key-one", "delete-key-two", "delete-admin-key"
OWNER1, OWNER2 = owner_of_token(KEY1), owner_of_token(KEY2)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, start_server: Any) -> Any:
    store: list[str] = []
    if request.param == "postgresql":
        store = ["--store", request.getfixturevalue("pg_cluster").create_schema(f"delete_in_flight_{time.monotonic_ns() % 10**9}")]
    return start_server("--api-key", KEY1, "--api-key", KEY2, "--admin-key", ADMIN, "--durability", "async", *store)


def recorder_of(server: Any) -> Any:
    return server.built.app.state.generation.recorder


def chat(server: Any, key: str, text: str, session: str) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": session}
    r = httpx.post(server.url + "/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["loopwise"]


def delete(server: Any, key: str, session: str) -> httpx.Response:
    return httpx.delete(f"{server.url}/sessions/{session}", headers={"Authorization": f"Bearer {key}"}, timeout=60)


def drain(server: Any) -> None:
    """Everything recorded so far is written (the admin listing flushes the recorder's queue first)."""
    r = httpx.get(server.base_url + "/admin/trajectories", params={"limit": 1}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    r.raise_for_status()


def rows_of(store: Any, owner: str, session: str) -> dict[str, int]:
    """How many rows of ``owner``'s session the store holds, table by table."""
    counts: dict[str, int] = {}
    with store._read() as conn:
        for table in ("sessions", "trajectories", "turns"):
            sql = store._q(f"SELECT COUNT(*) FROM {table} WHERE owner = ? AND session_id = ?")
            counts[table] = int(conn.execute(sql, (owner, session)).fetchone()[0])
    return counts


def stored(store: Any, turn_ids: list[str]) -> list[bool]:
    return [store.turn_exists(t) for t in turn_ids]


def wait_for(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


class HeldWriter:
    """The store's ``append_turns`` with a gate: the recorder's writer thread waits at it, so what is recorded
    meanwhile stays queued; ``written`` is every turn the store was handed."""

    def __init__(self, store: Any) -> None:
        self.store, self.real = store, store.append_turns
        self.gate, self.entered = threading.Event(), threading.Event()
        self.written: list[Turn] = []
        store.append_turns = self

    def __call__(self, turns: Any) -> None:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        self.written.extend(turns)
        self.real(turns)

    def release(self) -> None:
        """The writer goes on (every later write still counted in ``written``)."""
        self.gate.set()

    def restore(self) -> None:
        self.gate.set()
        vars(self.store).pop("append_turns", None)  # the class's method again


# ---- the three ways to the store ------------------------------------------------------------------------------------


def test_queued_turns_of_a_deleted_session_are_never_written(server: Any) -> None:
    rec = recorder_of(server)
    held = HeldWriter(rec.store)
    try:
        chat(server, KEY2, "warm-up", "q-warm-up")  # the writer takes this batch and waits at the gate
        assert held.entered.wait(30)
        doomed = [chat(server, KEY1, f"queued {i}", "q-doomed")["turn_id"] for i in range(3)]
        theirs = [chat(server, KEY2, f"queued {i}", "q-doomed")["turn_id"] for i in range(2)]  # same name, other key
        mine = [chat(server, KEY1, "queued elsewhere", "q-kept")["turn_id"]]  # same key, other session
        queued = rec.queued()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            deleting = pool.submit(delete, server, KEY1, "q-doomed")
            wait_for(lambda: rec.queued() > queued)  # the deletion's flush marker is queued: it is waiting for the writer
            held.release()
            r = deleting.result(timeout=60)
        drain(server)
    finally:
        held.restore()
    assert r.status_code == 200, r.text
    assert r.json()["deleted_turns"] == 3
    assert not {t.turn_id for t in held.written} & set(doomed)  # dropped from the queue: never on disk at all
    assert stored(rec.store, doomed) == [False] * 3
    assert rows_of(rec.store, OWNER1, "q-doomed") == {"sessions": 0, "trajectories": 0, "turns": 0}
    assert stored(rec.store, theirs + mine) == [True] * 3
    assert rows_of(rec.store, OWNER2, "q-doomed")["turns"] == 2


@contextmanager
def generating(rec: Any) -> Iterator[tuple[threading.Event, threading.Semaphore]]:
    """Requests whose messages say HOLD are held just before they record their turns (still generating, as far as
    the deletion can tell) until the gate opens; ``arrived`` counts them."""
    real, gate, arrived = rec.record, threading.Event(), threading.Semaphore(0)

    async def held_record(turns: list[Turn]) -> None:
        if any("HOLD" in str(t.messages) for t in turns):
            arrived.release()
            await asyncio.to_thread(gate.wait, 60)
        await real(turns)

    rec.record = held_record
    try:
        yield gate, arrived
    finally:
        gate.set()
        del rec.record


def test_a_turn_still_generating_when_its_session_is_deleted_is_not_recorded(server: Any) -> None:
    rec = recorder_of(server)
    first = chat(server, KEY1, "before", "g-doomed")["turn_id"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool, generating(rec) as (gate, arrived):
        mine = pool.submit(chat, server, KEY1, "HOLD mine", "g-doomed")
        theirs = pool.submit(chat, server, KEY2, "HOLD theirs", "g-doomed")
        assert arrived.acquire(timeout=30) and arrived.acquire(timeout=30)
        r = delete(server, KEY1, "g-doomed")
        gate.set()
        late, other = mine.result(60)["turn_id"], theirs.result(60)["turn_id"]
    assert r.status_code == 200 and r.json()["deleted_turns"] == 1, r.text
    drain(server)
    assert stored(rec.store, [first, late, other]) == [False, False, True]
    assert rows_of(rec.store, OWNER1, "g-doomed") == {"sessions": 0, "trajectories": 0, "turns": 0}
    # the session name is free again: a request after the deletion is recorded as usual
    again = chat(server, KEY1, "after", "g-doomed")["turn_id"]
    drain(server)
    assert stored(rec.store, [again]) == [True]


def test_journaled_turns_of_a_deleted_session_are_not_replayed(server: Any) -> None:
    rec = recorder_of(server)
    broken = threading.Event()
    real = rec.store.append_turns

    def refusing(turns: Any) -> None:
        if broken.is_set():
            raise OSError(28, "No space left on device")
        real(turns)

    rec.store.append_turns = refusing
    try:
        broken.set()
        doomed = [chat(server, KEY1, f"journaled {i}", "j-doomed")["turn_id"] for i in range(2)]
        theirs = [chat(server, KEY2, "journaled", "j-doomed")["turn_id"]]
        drain(server)  # answered once durable: in the journal, the store refuses them
        assert not rec.healthy and rec.journal_path.exists()
        r = delete(server, KEY1, "j-doomed")  # the store takes deletions, only its appends fail
        broken.clear()
        wait_for(lambda: rec.healthy and not rec.journal_path.exists())  # the writer replayed the journal
    finally:
        del rec.store.append_turns
    assert r.status_code == 200 and r.json()["deleted_turns"] == 2, r.text
    assert stored(rec.store, doomed + theirs) == [False, False, True]
    assert rows_of(rec.store, OWNER1, "j-doomed") == {"sessions": 0, "trajectories": 0, "turns": 0}


def test_stored_responses_of_a_deleted_session_are_deleted_too(server: Any) -> None:
    """Needs ``runtime/app.py`` to hand its ``ResponseStore`` to the store routes (``runtime/admin/store.py``; see the report of issue 42/8)."""

    def respond(key: str, text: str) -> str:
        headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "r-doomed"}
        body = {"model": "tiny", "input": text, "max_output_tokens": 3}
        r = httpx.post(server.url + "/responses", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def get(key: str, response_id: str) -> int:
        return httpx.get(f"{server.url}/responses/{response_id}", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    mine, theirs = respond(KEY1, "hello"), respond(KEY2, "hello")
    with concurrent.futures.ThreadPoolExecutor(1) as pool, generating(recorder_of(server)) as (gate, arrived):
        late = pool.submit(respond, KEY1, "HOLD on")  # still generating when the deletion comes
        assert arrived.acquire(timeout=30)
        r = delete(server, KEY1, "r-doomed")
        gate.set()
        late_id = late.result(60)
    assert r.status_code == 200 and r.json()["deleted_responses"] == 1, r.text
    assert [get(KEY1, mine), get(KEY1, late_id), get(KEY2, theirs)] == [404, 404, 200]
    assert delete(server, KEY2, "r-doomed").json()["deleted_responses"] == 1  # the other key deletes its own
    assert get(KEY2, theirs) == 404


# ---- narrower: backpressure, and a reward racing the deletion ----------------------------------------------------


def turn(i: int, session: str, owner: str = OWNER1) -> Turn:
    return Turn(
        turn_id=f"turn-{session}-{i}",
        trajectory_id=f"traj-{session}-{i}",
        session_id=session,
        index=0,
        completion_id=f"c-{session}-{i}",
        model="m",
        context_ids=[1, 2],
        output_ids=[3],
        logprobs=[-0.5],
        loss_mask=[1],
        finish_reason="stop",
        owner=owner,
    )


def test_a_turn_waiting_for_room_in_a_full_queue_is_dropped_by_the_deletion(tmp_path: Any) -> None:
    from learner.records.store import SqliteStore
    from runtime.recorder import Recorder

    rec = Recorder(SqliteStore(tmp_path / "i.db"), queue_size=1, commit_window_s=0.0, max_batch=1)
    held = HeldWriter(rec.store)
    rec.start()

    async def main() -> int:
        await rec.record([turn(0, "other")])  # the writer takes it and waits at the gate
        await asyncio.to_thread(held.entered.wait, 30)
        await rec.record([turn(1, "other")])  # fills the queue
        waiting = asyncio.create_task(rec.record([turn(2, "doomed")]))  # waits for room
        await asyncio.sleep(0.05)
        assert not waiting.done()
        tomb = rec.tombstone(OWNER1, "doomed")
        held.release()
        await waiting
        await rec.flush()
        return tomb.dropped

    try:
        dropped = asyncio.run(main())
    finally:
        held.restore()
    assert dropped == 1
    assert [t.turn_id for t in held.written] == ["turn-other-0", "turn-other-1"]
    assert stored(rec.store, ["turn-other-0", "turn-other-1", "turn-doomed-2"]) == [True, True, False]
    rec.close()


class _PausingConn:
    """A connection that stops after ``add_reward`` checked its target, until ``go`` is set (the reward not committed yet)."""

    def __init__(self, conn: Any, checked: threading.Event, go: threading.Event) -> None:
        self.conn, self.checked, self.go = conn, checked, go

    def execute(self, sql: Any, *args: Any, **kw: Any) -> Any:
        cur = self.conn.execute(sql, *args, **kw)
        if "SELECT owner FROM turns" in str(sql):
            self.checked.set()
            assert self.go.wait(30)
        return cur


def test_postgres_a_reward_racing_the_deletion_is_not_left_behind(pg_url: str) -> None:
    from learner.records.store_pg import PostgresStore

    store = PostgresStore(pg_url)
    store.append_turns([turn(0, "doomed")])
    checked, go = threading.Event(), threading.Event()
    real_write = store._write

    @contextmanager
    def write() -> Iterator[Any]:
        with real_write() as conn:
            yield _PausingConn(conn, checked, go) if threading.current_thread().name == "rewarder" else conn

    store._write = write  # type: ignore[method-assign]
    reward = Reward(target="turn", target_id="turn-doomed-0", value=1.0, source="user", owner=OWNER1)
    rewarder = threading.Thread(target=store.add_reward, args=(reward,), name="rewarder")
    rewarder.start()
    assert checked.wait(30)  # the reward saw its turn; not committed yet
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        deleting = pool.submit(store.delete_session, OWNER1, "doomed")
        time.sleep(0.5)  # before: the deletion finished here, and the reward was then stored on a deleted turn
        go.set()
        rewarder.join(30)
        assert deleting.result(30) == 1
    assert store.stats() == {"sessions": 0, "trajectories": 0, "turns": 0, "rewards": 0}
    store.close()
