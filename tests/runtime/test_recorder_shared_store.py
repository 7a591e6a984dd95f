"""Two recorders (two runtimes) on one PostgreSQL store: a session's turns stitch into one trajectory whichever
runtime records them, a branch is seen as a branch even by the runtime that did not record the successor, and one
turn is continued once: of two runtimes (or concurrent requests) continuing it, one extends the trajectory, the others
branch."""

from __future__ import annotations

import asyncio
import threading

from learner.records import Turn
from learner.records.store_pg import PostgresStore
from runtime.recorder import Recorder, TurnSlot, messages_key


def _turn(slot: TurnSlot, messages: list[dict], reply: str) -> Turn:
    return Turn(
        turn_id=slot.turn_id,
        trajectory_id=slot.trajectory_id,
        session_id=slot.session_id,
        index=slot.index,
        parent_turn_id=slot.parent_turn_id,
        completion_id="c-" + slot.turn_id,
        model="m",
        context_ids=[1, 2, 3],
        output_ids=[4, 5],
        logprobs=[-0.1, -0.2],
        loss_mask=[1, 1],
        finish_reason="stop",
        messages=messages,
        output_text=reply,
        continuation_key=messages_key([*messages, {"role": "assistant", "content": reply}]),
        owner=slot.owner,
    )


def test_sessions_stitch_across_two_recorders_on_one_postgres(pg_url: str) -> None:
    a = Recorder(PostgresStore(pg_url), durability="sync")
    b = Recorder(PostgresStore(pg_url), durability="sync")
    a.start()
    b.start()

    async def say(rec: Recorder, messages: list[dict], reply: str, owner: str = "key-1") -> Turn:
        slot = rec.assign("alice", messages, 1, owner)[0]
        turn = _turn(slot, messages, reply)
        await rec.record([turn])
        return turn

    async def main() -> None:
        convo: list[dict] = [{"role": "user", "content": "hi"}]
        t1 = await say(a, convo, "hello")  # runtime A
        convo += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]
        t2 = await say(b, list(convo), "4")  # runtime B continues A's turn
        assert (t2.trajectory_id, t2.index, t2.parent_turn_id) == (t1.trajectory_id, 1, t1.turn_id)
        convo += [{"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
        t3 = await say(a, list(convo), "6")  # back on A
        assert (t3.trajectory_id, t3.index, t3.parent_turn_id) == (t1.trajectory_id, 2, t2.turn_id)
        # the client goes back and regenerates turn 2 on A: A's own index knows turn 1 without a successor
        # (B recorded it), the store knows better: a branch, a new trajectory linked to turn 1
        branch = await say(a, [*convo[:3]], "four")
        assert branch.trajectory_id != t1.trajectory_id and branch.parent_turn_id == t1.turn_id and branch.index == 1
        # another owner's "alice" never continues key-1's trajectory
        other = await say(b, list(convo), "6", owner="key-2")
        assert other.trajectory_id not in (t1.trajectory_id, branch.trajectory_id) and other.parent_turn_id is None

    asyncio.run(main())
    a.close()
    b.close()
    store = PostgresStore(pg_url)
    trajs = {t["trajectory_id"]: t["turns"] for t in store.list_trajectories()}
    assert sorted(trajs.values()) == [1, 1, 3]
    store.close()


def test_one_turn_is_continued_once_across_two_runtimes(pg_url: str) -> None:
    """Two runtimes asked to continue the same turn before either recorded its answer: one extends the trajectory, the
    other opens a branch (a new trajectory whose first turn continues the same parent), as a regenerate would.
    Before: both saw the turn without a successor and both extended its trajectory (two turns at one index)."""
    a = Recorder(PostgresStore(pg_url), durability="sync")
    b = Recorder(PostgresStore(pg_url), durability="sync")
    a.start()
    b.start()
    convo: list[dict] = [{"role": "user", "content": "hi"}]

    async def main() -> None:
        first = _turn(a.assign("alice", convo, 1, "key-1")[0], convo, "hello")
        await a.record([first])
        nxt = [*convo, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]
        on_a = a.assign("alice", nxt, 1, "key-1")[0]  # both generate at once: neither has recorded yet
        on_b = b.assign("alice", nxt, 1, "key-1")[0]
        await asyncio.gather(a.record([_turn(on_a, nxt, "4")]), b.record([_turn(on_b, nxt, "four")]))
        assert on_a.trajectory_id == first.trajectory_id and on_a.index == 1 and on_a.parent_turn_id == first.turn_id
        assert on_b.trajectory_id != first.trajectory_id and on_b.index == 1 and on_b.parent_turn_id == first.turn_id

    asyncio.run(main())
    a.close()
    b.close()
    store = PostgresStore(pg_url)
    assert sorted(t["turns"] for t in store.list_trajectories()) == [1, 2]
    store.close()


def test_concurrent_continuations_on_two_runtimes_extend_one_trajectory_once(pg_url: str) -> None:
    """Eight requests (four per runtime, in threads released together) continue the same turn: exactly one extends its
    trajectory, the seven others branch from it."""
    recorders = [Recorder(PostgresStore(pg_url), durability="sync") for _ in range(2)]
    for rec in recorders:
        rec.start()
    convo: list[dict] = [{"role": "user", "content": "hi"}]
    first = _turn(recorders[0].assign("bob", convo, 1, "key-1")[0], convo, "hello")
    asyncio.run(recorders[0].record([first]))
    nxt = [*convo, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again?"}]
    barrier = threading.Barrier(8)
    slots: list[TurnSlot] = []
    errors: list[BaseException] = []

    def continue_on(rec: Recorder) -> None:
        try:
            barrier.wait()
            slots.append(rec.assign("bob", nxt, 1, "key-1")[0])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=continue_on, args=(recorders[k % 2],)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(slots) == 8
    assert sum(s.trajectory_id == first.trajectory_id for s in slots) == 1
    assert all(s.parent_turn_id == first.turn_id and s.index == 1 for s in slots)
    assert len({s.trajectory_id for s in slots}) == 8
    for rec in recorders:
        rec.close()
