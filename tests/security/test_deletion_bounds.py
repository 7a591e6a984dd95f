"""One key's deletions and abandoned requests cannot make another key's deleted session come back.

The recorder keeps two bounded indexes for deletions (``runtime/recorder.py``): tombstones (a deleted session's
turns the writer has not checked yet are dropped) and the turn ids of requests still generating (dropped when they
arrive). Both were process-wide first-in-first-out lists of ``index_size`` (100,000): a key deleting sessions by the
thousand while the writer was stuck, or sending requests that never recorded (a client that hangs up, a request
refused after its ids were given out), pushed the oldest entries out, another key's included; that key's deleted
session was then written after its deletion. Now a tombstone is forgotten once no queued batch can need it (and
beyond the bound the heaviest deleter loses its own), and a request that ends without recording gives its ids back.

Real recorders on a real SQLite store (``index_size`` small, so the bound is reached), and a real server on a real
port for the abandoned requests.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from runtime.identity import owner_of_token
from tests.runtime._client import wait_for_metric
from tests.security.test_delete_in_flight import turn  # one Turn per (session, i), as the deletion tests make them

VICTIM, ATTACKER = "owner-victim", "owner-attacker"


def recorder(tmp_path: Any, index_size: int = 4) -> Any:
    from learner.records.store import SqliteStore
    from runtime.recorder import Recorder

    return Recorder(SqliteStore(tmp_path / "i.db"), commit_window_s=0.0, max_batch=1, index_size=index_size)


def test_another_keys_deletions_cannot_push_out_a_tombstone_still_needed(tmp_path: Any) -> None:
    rec = recorder(tmp_path)  # not started: what record() takes stays queued until the writer starts

    async def main() -> Any:
        await rec.record([turn(0, "mine", VICTIM)])
        tomb = rec.tombstone(VICTIM, "mine")  # its queued turn must never be written
        await rec.record([turn(0, "x", ATTACKER)])  # the attacker's own queued turns keep its tombstones needed too
        for i in range(20):  # five times the index's size
            rec.tombstone(ATTACKER, f"gone-{i}")
        rec.start()
        await rec.flush()
        return tomb

    tomb = asyncio.run(main())
    assert tomb.dropped == 1
    assert not rec.store.turn_exists("turn-mine-0")
    assert rec.store.turn_exists("turn-x-0")  # its session "x" was never deleted
    rec.close()


def test_a_tombstone_no_batch_needs_is_forgotten(tmp_path: Any) -> None:
    """Deletions with nothing queued leave nothing behind, so the bound is only reached while the writer is stuck; a
    session deleted, then used again, is written (the new use is kept)."""
    rec = recorder(tmp_path, index_size=2)
    rec.start()

    async def main() -> None:
        for i in range(10):
            rec.tombstone(VICTIM, f"s{i}")
        await rec.record([turn(1, "s3", VICTIM)])  # after its deletion: a new use of the name
        await rec.flush()

    asyncio.run(main())
    assert rec.store.turn_exists("turn-s3-1")
    rec.close()


def test_requests_that_never_record_do_not_push_out_another_keys_turns_in_flight(tmp_path: Any) -> None:
    rec = recorder(tmp_path)
    rec.start()
    [mine] = rec.assign("mine", [{"role": "user", "content": "hi"}], 1, VICTIM)  # generating
    for i in range(20):  # the attacker's requests are given ids, then fail or are abandoned
        slots = rec.assign(f"a{i}", [{"role": "user", "content": "x"}], 2, ATTACKER)
        rec.settle(s.turn_id for s in slots)
    tomb = rec.tombstone(VICTIM, "mine")  # deleted while it generates
    assert mine.turn_id in tomb.in_flight
    late = turn(0, "mine", VICTIM).model_copy(update={"turn_id": mine.turn_id, "trajectory_id": mine.trajectory_id})

    async def main() -> None:
        await rec.record([late])  # the generation ends after the deletion: dropped
        await rec.flush()

    asyncio.run(main())
    assert not rec.store.turn_exists(mine.turn_id)
    rec.close()


KEY = "bounds-key"


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server("--api-key", KEY, "--durability", "async")


def test_an_abandoned_request_gives_its_turn_ids_back(server: Any) -> None:
    """A client that hangs up mid-generation never records its turn: its ids were held in flight until 100,000 later
    requests pushed them out. Now the request's end gives them back: deleting its session finds nothing in flight."""
    rec = server.built.app.state.generation.recorder
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 1500, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}", "X-Session-Id": "hung-up"}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/chat/completions", json=body, headers=headers, timeout=0.5)
    # the server noticed the hang-up, cancelled the generation and answered 499 (after its cleanup)
    wait_for_metric(server, 'loopwise_requests_total{endpoint="/v1/chat/completions",status="499"}', 1, timeout=15)
    tomb = rec.tombstone(owner_of_token(KEY), "hung-up")  # (it takes what is in flight: asked once)
    assert not tomb.in_flight, f"an abandoned request's ids are still held: {tomb.in_flight}"
