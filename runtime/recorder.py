"""Records every turn the server produced, without blocking the event loop, and stitches conversations.

**Recording.** ``await recorder.record(turns)`` puts the turns on a bounded queue; one writer thread
takes everything queued within ``commit_window_s`` (50 ms) and writes it in one transaction (group
commit). Durability modes: ``async`` returns at once (a crash can lose at most the last commit window);
``sync`` returns only after the turns are committed, so a response is never sent for an unrecorded
turn. When the queue is full, requests wait for room (backpressure, counted in
``loopwise_record_backpressure_total``); a turn is never dropped. A failed write is retried; after the
last try the turns are logged with their ids and counted in ``loopwise_record_failures_total``, and in
``sync`` mode the request fails with a 500.

**Stitching.** The session is the ``X-Session-Id`` header, else the request's ``user`` field, else the
shared ``anonymous`` session. Each turn stores ``prefix_key`` (a hash of the messages it answered) and
``continuation_key`` (the hash of those messages plus the reply it gave, as the client will send it
back). A new request is matched on its messages up to and including its last assistant message: if a
turn of the same session has that continuation key and no successor yet, the request becomes the next
turn of that trajectory; if the turn already has a successor (the client went back and branched, or
regenerated), or nothing matches (an edited earlier message), a new trajectory starts, linked by
``parent_turn_id`` where there is a parent. Of ``n`` choices, choice 0 continues the trajectory and
the others open sibling trajectories.

Not here: the storage engine (``learner/store.py``, reached through :class:`InteractionStore`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from learner.records import Reward, Trajectory, Turn, TurnRef, new_id
from runtime._futures import settle

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"


class InteractionStore(Protocol):
    """What the runtime needs from the interaction store (``learner.store.SqliteStore`` implements it)."""

    def append_turns(self, turns: Sequence[Turn]) -> None: ...
    def add_reward(self, reward: Reward) -> tuple[Reward, bool]: ...
    def turns_for_completion(self, completion_id: str) -> list[str]: ...
    def find_continuation(self, session_id: str, continuation_key: str) -> TurnRef | None: ...
    def turn_exists(self, turn_id: str) -> bool: ...
    def trajectory_exists(self, trajectory_id: str) -> bool: ...
    def set_trajectory_meta(self, trajectory_id: str, meta: dict[str, Any]) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def list_trajectories(self, limit: int = 50, since: float | None = None, rewarded: bool | None = None) -> list[dict[str, Any]]: ...
    def get_trajectory(self, trajectory_id: str) -> Trajectory | None: ...
    def delete_session(self, session_id: str) -> int: ...
    def prune(self, older_than: float) -> int: ...
    def close(self) -> None: ...


# ---- stitching (pure) ---------------------------------------------------------------------------


def canonical_message(m: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that identify it across requests (ids and formatting ignored)."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            fn = c["function"]
            args = fn["arguments"]
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    pass
            calls.append({"name": fn["name"], "arguments": args})
        out["tool_calls"] = calls
    return out


def messages_key(messages: Sequence[dict[str, Any]]) -> str:
    blob = json.dumps([canonical_message(m) for m in messages], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def lookup_key(messages: Sequence[dict[str, Any]]) -> str | None:
    """The continuation key a request would match: its messages up to its last assistant message."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    return None if last is None else messages_key(messages[: last + 1])


@dataclass(frozen=True)
class TurnSlot:
    """Ids assigned to one choice before generation, so responses can carry them."""

    turn_id: str
    trajectory_id: str
    session_id: str
    index: int
    parent_turn_id: str | None


# ---- the recorder ---------------------------------------------------------------------------------


@dataclass
class _Batch:
    turns: list[Turn]
    done: asyncio.Future[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    enqueued: float = field(default_factory=time.perf_counter)


class Recorder:
    def __init__(
        self,
        store: InteractionStore,
        *,
        durability: Literal["async", "sync"] = "async",
        queue_size: int = 1024,
        commit_window_s: float = 0.05,
        max_batch: int = 512,
        metrics: Any = None,
        index_size: int = 100_000,
    ) -> None:
        self.store = store
        self.durability = durability
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=queue_size)
        self._window = commit_window_s
        self._max_batch = max_batch
        self._metrics = metrics
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the recent-turn index below
        self._recent: OrderedDict[tuple[str, str], TurnRef] = OrderedDict()  # (session, continuation_key) → turn
        self._successors: set[str] = set()  # turn ids already continued (recent ones)
        self._pending: dict[str, int] = {}  # ids (turn, trajectory, completion) not yet committed → count
        self._index_size = index_size
        self._written = 0

    # ---- lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._writer, name="loopwise-recorder", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write everything queued, then stop the writer."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        self.store.close()

    # ---- stitching
    def assign(self, session_id: str, messages: Sequence[dict[str, Any]], n: int) -> list[TurnSlot]:
        """Turn and trajectory ids for the ``n`` choices of a request (see the module docstring)."""
        parent: TurnRef | None = None
        key = lookup_key(messages)
        if key is not None:
            with self._lock:
                parent = self._recent.get((session_id, key))
            if parent is None:
                parent = self.store.find_continuation(session_id, key)
        slots = []
        with self._lock:
            continues = parent is not None and not parent.has_successor and parent.turn_id not in self._successors
            for i in range(n):
                turn_id = new_id("turn")
                if i == 0 and continues and parent is not None:
                    slots.append(TurnSlot(turn_id, parent.trajectory_id, session_id, parent.index + 1, parent.turn_id))
                else:
                    slots.append(
                        TurnSlot(turn_id, new_id("traj"), session_id, 0 if parent is None else parent.index + 1, parent.turn_id if parent else None)
                    )
            if continues and parent is not None:
                self._successors.add(parent.turn_id)
        return slots

    def _remember(self, turns: Sequence[Turn]) -> None:
        with self._lock:
            for t in turns:
                if t.continuation_key:
                    self._recent[(t.session_id, t.continuation_key)] = TurnRef(
                        turn_id=t.turn_id, trajectory_id=t.trajectory_id, session_id=t.session_id, index=t.index, has_successor=False
                    )
                for k in (t.turn_id, t.trajectory_id, t.completion_id):
                    self._pending[k] = self._pending.get(k, 0) + 1
            while len(self._recent) > self._index_size:
                self._recent.popitem(last=False)
            if len(self._successors) > self._index_size:
                self._successors.clear()  # the store's has_successor answers for older turns

    def is_pending(self, some_id: str) -> bool:
        with self._lock:
            return some_id in self._pending

    def forget_session(self, session_id: str) -> None:
        with self._lock:
            for key in [k for k in self._recent if k[0] == session_id]:
                ref = self._recent.pop(key)
                self._successors.discard(ref.turn_id)

    # ---- recording
    async def record(self, turns: list[Turn]) -> None:
        """Queue ``turns`` for writing; in ``sync`` mode, return once they are committed."""
        self._remember(turns)
        loop = asyncio.get_running_loop()
        batch = _Batch(turns, loop.create_future() if self.durability == "sync" else None, loop)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            if self._metrics is not None:
                self._metrics.record_backpressure.inc()
            await asyncio.to_thread(self._queue.put, batch)  # wait for room; never drop
        if batch.done is not None:
            await batch.done

    async def flush(self) -> None:
        """Return once everything queued before this call is committed."""
        loop = asyncio.get_running_loop()
        marker = _Batch([], loop.create_future(), loop)
        await asyncio.to_thread(self._queue.put, marker)
        assert marker.done is not None
        await marker.done

    def queued(self) -> int:
        return self._queue.qsize()

    def _writer(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                break
            batches = [first]
            deadline = time.monotonic() + self._window
            n = len(first.turns)
            while n < self._max_batch:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    item = self._queue.get(timeout=timeout)
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batches.append(item)
                n += len(item.turns)
            self._commit(batches)
        # drain whatever is left after the stop marker
        rest = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                rest.append(item)
        if rest:
            self._commit(rest)

    def _commit(self, batches: list[_Batch]) -> None:
        turns = [t for b in batches for t in b.turns]
        error: BaseException | None = None
        for attempt in range(5):
            try:
                if turns:
                    self.store.append_turns(turns)
                error = None
                break
            except Exception as exc:  # retried below; never dropped silently
                error = exc
                log.warning("recording %d turns failed (attempt %d): %r", len(turns), attempt + 1, exc)
                time.sleep(0.05 * 2**attempt)
        if error is not None:
            log.error("could not record turns %s", [t.turn_id for t in turns], exc_info=error)
            if self._metrics is not None:
                self._metrics.record_failures.inc(len(turns))
        else:
            self._written += len(turns)
            if self._metrics is not None and turns:
                self._metrics.recorded_turns.inc(len(turns))
        with self._lock:
            for t in turns:
                for k in (t.turn_id, t.trajectory_id, t.completion_id):
                    left = self._pending.get(k, 0) - 1
                    if left > 0:
                        self._pending[k] = left
                    else:
                        self._pending.pop(k, None)
        for b in batches:
            if b.done is not None and b.loop is not None:
                b.loop.call_soon_threadsafe(settle, b.done, error)
