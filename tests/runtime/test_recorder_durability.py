"""An answered turn is never dropped: when the store cannot take it, the recorder writes it to a local journal
(fsync'd) that is replayed into the store as soon as it works again and at the next start; meanwhile the server
says it is not ready. Waiting for room in the queue never holds a thread of the default pool.

Before: after five failed commits (about 27 s of a locked or full database) the turns were dropped, waiting
writers blocked the default thread pool, and shutdown gave up after 30 s with turns still queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from pathlib import Path

from learner.records import Turn
from learner.records.store import SqliteStore
from runtime.recorder import Recorder


class BrokenStore(SqliteStore):
    """The real store; while ``broken`` is set every write fails as a full or locked database would."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.broken = threading.Event()
        self.delay = 0.0

    def append_turns(self, turns):  # type: ignore[override]
        if self.broken.is_set():
            raise OSError(28, "No space left on device")
        time.sleep(self.delay)
        super().append_turns(turns)


def turn(i: int) -> Turn:
    return Turn(
        turn_id=f"turn-{i}",
        trajectory_id=f"traj-{i}",
        session_id="s",
        index=0,
        completion_id=f"c-{i}",
        model="m",
        context_ids=[1, 2, 3],
        output_ids=[4, 5],
        logprobs=[-0.1, -0.2],
        loss_mask=[1, 1],
        finish_reason="stop",
    )


def wait_until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_turns_go_to_the_journal_while_the_store_fails_and_come_back(tmp_path):
    store = BrokenStore(tmp_path / "i.db")
    store.broken.set()
    rec = Recorder(store, durability="sync", retry_s=0.2)
    rec.start()
    asyncio.run(rec.record([turn(1), turn(2)]))  # answered: durable in the journal, not lost
    assert not rec.healthy and rec.journal_path is not None and rec.journal_path.exists()
    assert not store.turn_exists("turn-1")
    store.broken.clear()  # the disk has room again
    wait_until(lambda: rec.healthy)
    assert store.turn_exists("turn-1") and store.turn_exists("turn-2")
    assert not rec.journal_path.exists()
    rec.close()


def test_the_journal_is_replayed_at_the_next_start(tmp_path):
    store = BrokenStore(tmp_path / "j.db")
    store.broken.set()
    rec = Recorder(store, durability="async", retry_s=60)
    rec.start()

    async def main() -> None:
        await asyncio.gather(*(rec.record([turn(i)]) for i in range(20)))

    asyncio.run(main())
    rec.close()  # the store never recovered: everything still queued goes to the journal, nothing is dropped
    journal = tmp_path / "j.journal"
    assert journal.exists() and len(journal.read_text().splitlines()) == 20
    fresh = Recorder(SqliteStore(tmp_path / "j.db"))
    fresh.start()
    assert fresh.store.stats()["turns"] == 20 and not journal.exists() and fresh.healthy
    fresh.close()


def test_a_torn_last_journal_line_is_skipped(tmp_path):
    journal = tmp_path / "k.journal"
    journal.write_text(turn(1).model_dump_json() + "\n" + turn(2).model_dump_json()[:40])
    rec = Recorder(SqliteStore(tmp_path / "k.db"))
    rec.start()
    assert rec.store.turn_exists("turn-1") and rec.store.stats()["turns"] == 1
    rec.close()


def test_waiting_for_room_holds_no_default_pool_thread(tmp_path):
    store = BrokenStore(tmp_path / "l.db")
    store.delay = 0.05
    rec = Recorder(store, queue_size=1, commit_window_s=0.0, max_batch=1)
    rec.start()
    submitted = []

    class Counting(concurrent.futures.ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            submitted.append(fn)
            return super().submit(fn, *args, **kwargs)

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(Counting(max_workers=1))
        await asyncio.gather(*(rec.record([turn(i)]) for i in range(10)))
        await rec.flush()

    asyncio.run(main())
    rec.close()
    assert submitted == [] and SqliteStore(tmp_path / "l.db").stats()["turns"] == 10


def test_not_ready_while_the_store_cannot_be_written(tmp_path, tiny_model_path):
    from fastapi.testclient import TestClient

    from runtime.app import create_app
    from runtime.engines.embedded import EmbeddedEngine
    from runtime.settings import EngineSettings, RecorderSettings, ServerSettings

    store = BrokenStore(tmp_path / "interactions.db")
    rec = Recorder(store, durability="sync", retry_s=0.2)
    engine = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32")
    app = create_app(ServerSettings(data_dir=tmp_path), EngineSettings(), engine, "tiny", recorder=rec, recorder_settings=RecorderSettings())
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 200
        store.broken.set()
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200  # answered: its turn is in the journal
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "recorder_unavailable"
        store.broken.clear()
        wait_until(lambda: client.get("/ready").status_code == 200)
        assert store.turn_exists(r.json()["loopwise"]["turn_id"])
