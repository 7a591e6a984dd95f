"""The recorder in process, on a real SQLite store: group commit, sync durability, backpressure,
retries, and the stitching keys."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from learner.records import Turn
from learner.records.store import SqliteStore
from runtime.recorder import Recorder, lookup_key, messages_key


class _Counters:
    def __init__(self) -> None:
        r = CollectorRegistry()
        self.recorded_turns = Counter("rt", "", registry=r)
        self.record_backpressure = Counter("bp", "", registry=r)
        self.record_failures = Counter("rf", "", registry=r)


class SlowOrFlakyStore(SqliteStore):
    """The real store, with a delay or failures injected in front of each write."""

    def __init__(self, path: Path, delay: float = 0.0, fail_times: int = 0) -> None:
        super().__init__(path)
        self.delay, self.fail_times, self.calls = delay, fail_times, 0
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()

    def append_turns(self, turns):  # type: ignore[override]
        with self._lock:
            self.calls += 1
            if self.calls <= self.fail_times:
                raise OSError("disk hiccup")
        time.sleep(self.delay)
        self.batch_sizes.append(len(turns))
        super().append_turns(turns)


def make_turn(i: int, session: str = "s") -> Turn:
    return Turn(
        turn_id=f"turn-{i}",
        trajectory_id=f"traj-{i}",
        session_id=session,
        index=0,
        completion_id=f"c-{i}",
        model="m",
        context_ids=[1, 2, 3],
        output_ids=[4, 5],
        logprobs=[-0.1, -0.2],
        loss_mask=[1, 1],
        finish_reason="stop",
    )


def test_group_commit_batches_concurrent_records(tmp_path):
    store = SlowOrFlakyStore(tmp_path / "a.db")
    rec = Recorder(store, commit_window_s=0.05)
    rec.start()

    async def main() -> None:
        await asyncio.gather(*(rec.record([make_turn(i)]) for i in range(50)))
        await rec.flush()

    asyncio.run(main())
    rec.close()
    reopened = SqliteStore(tmp_path / "a.db")
    assert reopened.stats()["turns"] == 50
    assert max(store.batch_sizes) > 1  # written in groups, not one transaction per turn


def test_sync_mode_returns_only_after_commit(tmp_path):
    store = SlowOrFlakyStore(tmp_path / "b.db", delay=0.2)
    rec = Recorder(store, durability="sync")
    rec.start()

    async def main() -> float:
        t0 = time.perf_counter()
        await rec.record([make_turn(1)])
        assert store.turn_exists("turn-1")  # committed before record() returned
        return time.perf_counter() - t0

    assert asyncio.run(main()) >= 0.2
    rec.close()


def test_full_queue_makes_requests_wait_and_counts_it(tmp_path):
    store = SlowOrFlakyStore(tmp_path / "c.db", delay=0.05)
    counters = _Counters()
    rec = Recorder(store, queue_size=1, commit_window_s=0.0, max_batch=1, metrics=counters)
    rec.start()

    async def main() -> None:
        await asyncio.gather(*(rec.record([make_turn(i)]) for i in range(12)))
        await rec.flush()

    asyncio.run(main())
    rec.close()
    assert counters.record_backpressure._value.get() > 0
    assert SqliteStore(tmp_path / "c.db").stats()["turns"] == 12  # none dropped
    assert counters.recorded_turns._value.get() == 12


def test_failed_writes_are_retried(tmp_path):
    store = SlowOrFlakyStore(tmp_path / "d.db", fail_times=2)
    rec = Recorder(store, durability="sync")
    rec.start()
    asyncio.run(rec.record([make_turn(7)]))
    rec.close()
    assert SqliteStore(tmp_path / "d.db").turn_exists("turn-7")


def test_a_write_that_keeps_failing_is_journaled_and_counted(tmp_path):
    store = SlowOrFlakyStore(tmp_path / "e.db", fail_times=100)
    counters = _Counters()
    rec = Recorder(store, durability="sync", metrics=counters, retry_s=60)
    rec.start()
    asyncio.run(rec.record([make_turn(8)]))  # durable in the journal: the request is answered (tests/runtime/test_recorder_durability.py)
    rec.close()
    assert counters.record_failures._value.get() == 1
    assert "turn-8" in (tmp_path / "e.journal").read_text()


def test_stitching_keys_ignore_ids_and_argument_formatting():
    a = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "function": {"name": "w", "arguments": '{"a": 1, "b": 2}'}}]},
    ]
    b = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_9", "function": {"name": "w", "arguments": '{"b":2,"a":1}'}}]},
    ]
    assert messages_key(a) == messages_key(b)
    assert messages_key(a) != messages_key([*a[:1], {"role": "assistant", "content": "", "tool_calls": []}])
    follow = [*b, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}, {"role": "user", "content": "thanks"}]
    assert lookup_key(follow) == messages_key(a)
    assert lookup_key([{"role": "user", "content": "hi"}]) is None


def test_assign_continues_once_then_branches(tmp_path):
    rec = Recorder(SqliteStore(tmp_path / "f.db"))
    rec.start()
    msgs = [{"role": "user", "content": "hi"}]
    [slot] = rec.assign("s", msgs, 1)
    reply = {"role": "assistant", "content": "hello"}
    turn = make_turn(0).model_copy(
        update={"turn_id": slot.turn_id, "trajectory_id": slot.trajectory_id, "continuation_key": messages_key([*msgs, reply])}
    )
    asyncio.run(rec.record([turn]))
    nxt = [*msgs, reply, {"role": "user", "content": "more"}]
    first, second = rec.assign("s", nxt, 2)
    assert first.trajectory_id == slot.trajectory_id and first.index == 1 and first.parent_turn_id == slot.turn_id
    assert second.trajectory_id != slot.trajectory_id and second.parent_turn_id == slot.turn_id
    [again] = rec.assign("s", nxt, 1)  # turn 0 already has a successor: a regenerate branches
    assert again.trajectory_id != slot.trajectory_id and again.parent_turn_id == slot.turn_id
    [other_session] = rec.assign("t", nxt, 1)
    assert other_session.parent_turn_id is None
    rec.close()


def test_a_regenerate_branches_after_the_continuation_claims_were_forgotten(tmp_path):
    """The claims of continued turns were cleared wholesale every ``index_size`` continuations while the stitching index
    still said those turns had no successor: a regenerate right after a clear continued its trajectory a second time
    at the same index (turn 1 twice), which the learner's estimators refuse (the whole batch was quarantined)."""
    rec = Recorder(SqliteStore(tmp_path / "f.db"), index_size=4)
    rec.start()

    def turn_of(slot, msgs, reply):
        update = {"turn_id": slot.turn_id, "trajectory_id": slot.trajectory_id, "index": slot.index, "session_id": slot.session_id}
        return make_turn(0).model_copy(update={**update, "continuation_key": messages_key([*msgs, reply])})

    def two_turns(session: str) -> tuple[list, object]:
        """A conversation's first turn, recorded, then its continuation (assigned and recorded): (its messages, the 2nd slot)."""
        msgs = [{"role": "user", "content": f"hi {session}"}]
        [first] = rec.assign(session, msgs, 1)
        reply = {"role": "assistant", "content": f"hello {session}"}
        asyncio.run(rec.record([turn_of(first, msgs, reply)]))
        nxt = [*msgs, reply, {"role": "user", "content": "more"}]
        [second] = rec.assign(session, nxt, 1)
        assert second.trajectory_id == first.trajectory_id and second.index == 1
        asyncio.run(rec.record([turn_of(second, nxt, {"role": "assistant", "content": "ok"})]))
        return nxt, second

    for i in range(3):
        two_turns(f"other-{i}")
    nxt, second = two_turns("mine")
    two_turns("later")  # the fifth continuation: past index_size
    [again] = rec.assign("mine", nxt, 1)  # a regenerate of the second turn
    assert again.trajectory_id != second.trajectory_id, "continued the trajectory twice at index 1"
    assert again.parent_turn_id == second.parent_turn_id and again.index == 1
    rec.close()
