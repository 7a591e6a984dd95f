"""Records every turn the server produced, without blocking the event loop, and stitches conversations.

**Recording.** ``await recorder.record(turns)`` puts the turns on a bounded queue; one writer thread
takes everything queued within ``commit_window_s`` (50 ms) and writes it in one transaction (group
commit). Durability modes: ``async`` returns at once (a crash can lose at most the last commit window);
``sync`` returns only after the turns are durable, so a response is never sent for an unrecorded turn.
When the queue is full, requests wait for room (backpressure, counted in
``loopwise_record_backpressure_total``), polling on the event loop: no thread of the default pool is
held by a waiting request. Store calls of the HTTP routes run on the recorder's own small reader pool
(:meth:`Recorder.call`), so a locked database never starves unrelated endpoints of threads.

**A turn is never dropped.** A failed write is retried briefly; if the store still refuses it (a full
disk, a database locked for long), the turns are appended to a local journal (``<db>.journal``, JSON
lines, fsync'd) and count as durable; ``healthy`` turns false (the app's ``/ready`` answers 503) and
the writer replays the journal into the store every ``retry_s`` until it works again, then deletes it.
A journal left by an earlier process is replayed at :meth:`Recorder.start` (re-inserting a stored turn
is a no-op, so a replay interrupted half-way is safe); a torn last line (a crash mid-append) is skipped.
Only if the journal cannot be written either does the writer keep the turns and retry both without end,
and requests wait (backpressure) rather than lose them. :meth:`Recorder.close` drains the queue the same
way before it returns. Turns counted in ``loopwise_record_failures_total`` went to the journal.

**Stitching.** The session is the ``X-Session-Id`` header, else the request's ``user`` field, else the
shared ``anonymous`` session. Each turn stores ``prefix_key`` (a hash of the messages it answered) and
``continuation_key`` (the hash of those messages plus the reply it gave, as the client will send it
back). A new request is matched on its messages up to and including its last assistant message: if a
turn of the same session has that continuation key and no successor yet, the request becomes the next
turn of that trajectory; if the turn already has a successor (the client went back and branched, or
regenerated), or nothing matches (an edited earlier message), a new trajectory starts, linked by
``parent_turn_id`` where there is a parent. Of ``n`` choices, choice 0 continues the trajectory and
the others open sibling trajectories. On a store that other runtimes write too (``store.shared``:
PostgreSQL), the lookup always asks the store, so a session's next turn may land on any runtime: with
``sync`` durability its previous turn is committed before the client saw it; with ``async`` a client
faster than the 50 ms commit window can start a new trajectory instead. One turn is continued once: before
generating, a runtime on a shared store claims the turn it continues (``claim_continuation``, a primary key in the
store), so of two runtimes (or requests) continuing the same turn at the same instant exactly one extends its
trajectory and the other opens a branch, as a regenerate does (a new trajectory whose first turn has that
``parent_turn_id``); the answer is never refused. A claim whose request then fails leaves the turn continued for
good (later continuations of it branch), as in one process.

**Deletion reaches the queue.** Deleting a session (``runtime/admin/store.py``) first calls
:meth:`Recorder.tombstone`: from then on the writer drops every turn of that owner's session that was handed to
:meth:`Recorder.record` before the tombstone (queued, or still waiting for room in a full queue), and ``record``
drops the turns of slots :meth:`Recorder.assign` gave out before it (requests still generating). The route then
flushes (the writer is past anything it took before the tombstone), :meth:`Recorder.purge_journal` removes the
session's journaled turns (else a later replay would bring them back), and only then the store deletes its rows.
Flushing alone is not enough: a flush orders only what is already queued, while a request waiting for room or
still generating queues its turns after the flush marker, and journaled turns count as written. Turns recorded
after the tombstone are a new use of the session name and are kept. Tombstones live in this process only: on a
shared store, another runtime's queue is not reached. A tombstone is forgotten once the writer has checked every batch
taken before it; a request that ends without recording gives its ids back (:meth:`Recorder.settle`), so neither index
holds more than what is still on its way, and one key's deletions or abandoned requests never push out another's.

Not here: the storage engine (``learner/records/store.py``, reached through :class:`InteractionStore`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from learner.records import PUBLIC_OWNER, Reward, Trajectory, Turn, TurnRef, new_id
from runtime._futures import settle
from runtime.json_text import loads_json_text

log = logging.getLogger(__name__)
T = TypeVar("T")

ANONYMOUS = "anonymous"


class InteractionStore(Protocol):
    """What the runtime needs from the interaction store (``learner.records.store.SqliteStore`` and ``learner.records.store_pg.PostgresStore``)."""

    def append_turns(self, turns: Sequence[Turn]) -> None: ...
    def add_reward(self, reward: Reward, max_per_target: int | None = None) -> tuple[Reward, bool]: ...
    def turns_for_completion(self, completion_id: str, owner: str | None = None, choice_index: int | None = None) -> list[str]: ...
    def find_continuation(self, session_id: str, continuation_key: str, owner: str = ...) -> TurnRef | None: ...
    def claim_continuation(self, turn_id: str) -> bool: ...
    def turn_exists(self, turn_id: str, owner: str | None = None) -> bool: ...
    def trajectory_exists(self, trajectory_id: str, owner: str | None = None) -> bool: ...
    def set_trajectory_meta(self, trajectory_id: str, meta: dict[str, Any]) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def list_trajectories(
        self, limit: int = 50, since: float | None = None, rewarded: bool | None = None, owner: str | None = None
    ) -> list[dict[str, Any]]: ...
    def get_turn(self, turn_id: str) -> Turn | None: ...
    def get_trajectory(self, trajectory_id: str) -> Trajectory | None: ...
    def delete_session(self, owner: str, session_id: str) -> int: ...
    def delete_trajectories(self, trajectory_ids: Sequence[str]) -> int: ...
    def session_owners(self, session_id: str) -> list[str]: ...
    def record_owner(self, target: str, target_id: str) -> str | None: ...
    def trajectories_with_meta(self, owner: str, key: str, value: str) -> list[str]: ...
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
                    args = loads_json_text(args) if args.strip() else {}
                except json.JSONDecodeError:  # a JSONLimitExceeded too: the text stands for itself
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
    owner: str = PUBLIC_OWNER


# ---- the recorder ---------------------------------------------------------------------------------


@dataclass
class _Batch:
    turns: list[Turn]
    done: asyncio.Future[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    enqueued: float = field(default_factory=time.perf_counter)
    seq: int = 0  # the order in which ``record`` took it (a tombstone drops its session's turns taken before it)


@dataclass
class Tombstone:
    """A deleted session: its turns that ``record`` took up to ``seq`` are never written (``dropped`` counts them), nor
    those of the requests that were still generating (``in_flight``: their turn ids)."""

    seq: int
    in_flight: frozenset[str] = frozenset()
    recent: frozenset[str] = frozenset()  # the session's turn ids recorded lately (in the stitching index)
    dropped: int = 0


class _InFlight:
    """Turn ids given out by ``assign`` and not yet recorded, by (owner, session); the oldest are forgotten beyond
    ``size`` (a request that failed before recording never comes back for its ids)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._order: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._by_session: dict[tuple[str, str], set[str]] = {}

    def add(self, turn_id: str, key: tuple[str, str]) -> None:
        self._order[turn_id] = key
        self._by_session.setdefault(key, set()).add(turn_id)
        while len(self._order) > self._size:
            self.pop(next(iter(self._order)))

    def pop(self, turn_id: str) -> None:
        key = self._order.pop(turn_id, None)
        if key is not None:
            ids = self._by_session[key]
            ids.discard(turn_id)
            if not ids:
                del self._by_session[key]

    def take_session(self, key: tuple[str, str]) -> set[str]:
        """The session's ids in flight, forgotten here."""
        ids = self._by_session.pop(key, set())
        for turn_id in ids:
            del self._order[turn_id]
        return ids


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
        journal: Path | None = None,
        retry_s: float = 2.0,
    ) -> None:
        self.store = store
        path = getattr(store, "path", None)
        self.journal_path: Path | None = journal or (Path(path).with_suffix(".journal") if path is not None else None)
        self.retry_s = retry_s
        self.healthy = True  # false while the store refuses writes (turns go to the journal meanwhile)
        self._journaled = False  # the journal holds turns not yet in the store
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="loopwise-store")
        self.durability = durability
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=queue_size)
        self._window = commit_window_s
        self._max_batch = max_batch
        self._metrics = metrics
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the recent-turn index below
        self._recent: OrderedDict[tuple[str, str, str], TurnRef] = OrderedDict()  # (owner, session, continuation_key) → turn
        self._successors: OrderedDict[str, None] = OrderedDict()  # turn ids continued lately (oldest first out)
        self._pending: dict[str, int] = {}  # ids (turn, trajectory, completion) not yet committed → count
        self._index_size = index_size
        self._written = 0
        self._seq = 0  # batches taken by record() so far
        self._tombstones: OrderedDict[tuple[str, str], Tombstone] = OrderedDict()  # (owner, session) → its latest deletion
        self._unfiltered: set[int] = set()  # seqs of batches record() took that the writer has not checked against tombstones
        self._inflight = _InFlight(index_size)  # slots assigned, turns not yet recorded
        self._doomed: OrderedDict[str, None] = OrderedDict()  # turn ids of deleted sessions' requests still generating
        self._journal_lock = threading.Lock()  # the writer's spill and replay, and purge_journal

    # ---- lifecycle
    def start(self) -> None:
        """Replay a journal left by an earlier process, then start the writer."""
        if self.journal_path is not None and self.journal_path.exists():
            self._journaled = True
            self._replay()
        self._thread = threading.Thread(target=self._writer, name="loopwise-recorder", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write everything queued (to the store, else to the journal), then stop the writer and close the store."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=120)
            if self._thread.is_alive():  # neither the store nor the journal takes writes: say what is still held
                log.error("the recorder is still retrying turns it could neither store nor journal; closing without them")
            self._thread = None
        self._readers.shutdown(wait=True)
        self.store.close()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (a store read or a small write) on the recorder's reader pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._readers, fn, *args)

    # ---- stitching
    def assign(self, session_id: str, messages: Sequence[dict[str, Any]], n: int, owner: str = PUBLIC_OWNER) -> list[TurnSlot]:
        """Turn and trajectory ids for the ``n`` choices of ``owner``'s request (see the module docstring)."""
        parent: TurnRef | None = None
        key = lookup_key(messages)
        if key is not None:
            with self._lock:
                parent = self._recent.get((owner, session_id, key))
            if parent is None or getattr(self.store, "shared", False):
                # a shared store (PostgreSQL) is written by other runtimes too: its answer wins over this process's
                # index (the session's last turn, or a successor, may have landed on another runtime)
                parent = self.store.find_continuation(session_id, key, owner) or parent
        with self._lock:
            continues = parent is not None and not parent.has_successor and parent.turn_id not in self._successors
            if continues and parent is not None and key is not None:
                self._successors[parent.turn_id] = None
                while len(self._successors) > self._index_size:
                    self._successors.popitem(last=False)
                # the index itself says so too: once the claim above is forgotten, a regenerate of this turn must still
                # branch (it continued the trajectory a second time, at the same index, which no estimator can take)
                ref = self._recent.get((owner, session_id, key))
                if ref is not None and ref.turn_id == parent.turn_id:
                    self._recent[(owner, session_id, key)] = ref.model_copy(update={"has_successor": True})
        if continues and parent is not None and getattr(self.store, "shared", False):
            # other runtimes may be continuing the same turn right now: the store's uniqueness rule lets one of them win,
            # the others branch (the successor is stored only after generating, too late to settle it)
            continues = self.store.claim_continuation(parent.turn_id)
        slots = []
        with self._lock:
            for i in range(n):
                turn_id = new_id("turn")
                if i == 0 and continues and parent is not None:
                    slots.append(TurnSlot(turn_id, parent.trajectory_id, session_id, parent.index + 1, parent.turn_id, owner))
                else:
                    index = 0 if parent is None else parent.index + 1
                    slots.append(TurnSlot(turn_id, new_id("traj"), session_id, index, parent.turn_id if parent else None, owner))
            for slot in slots:
                self._inflight.add(slot.turn_id, (owner, session_id))
        return slots

    def _admit(self, turns: Sequence[Turn]) -> tuple[list[Turn], int]:
        """The turns to queue (less those of requests whose session was deleted while they generated) and their
        batch's sequence number; remembered for stitching and ``is_pending`` (atomically with respect to a tombstone)."""
        with self._lock:
            kept = []
            for t in turns:
                self._inflight.pop(t.turn_id)
                if t.turn_id in self._doomed:
                    del self._doomed[t.turn_id]
                else:
                    kept.append(t)
            self._seq += 1
            if kept:
                self._unfiltered.add(self._seq)
            self._remember_locked(kept)
            return kept, self._seq

    def _remember_locked(self, turns: Sequence[Turn]) -> None:
        """Index ``turns`` for stitching and count them pending (``self._lock`` held)."""
        for t in turns:
            if t.continuation_key:
                self._recent[(t.owner, t.session_id, t.continuation_key)] = TurnRef(
                    turn_id=t.turn_id, trajectory_id=t.trajectory_id, session_id=t.session_id, index=t.index, has_successor=False
                )
            for k in (t.turn_id, t.trajectory_id, t.completion_id):
                self._pending[k] = self._pending.get(k, 0) + 1
        while len(self._recent) > self._index_size:
            self._recent.popitem(last=False)

    def settle(self, turn_ids: Iterable[str]) -> None:
        """The request that ``assign`` gave ``turn_ids`` to has ended: those it did not record never will be (it failed,
        or its client left). Forgotten here, so that the in-flight index holds only requests still running and one
        key's failed or abandoned requests never push another key's out of it. Idempotent; recorded ids are a no-op."""
        with self._lock:
            for turn_id in turn_ids:
                self._inflight.pop(turn_id)
                self._doomed.pop(turn_id, None)

    def is_pending(self, some_id: str) -> bool:
        with self._lock:
            return some_id in self._pending

    def forget_session(self, owner: str, session_id: str) -> None:
        with self._lock:
            self._forget_locked(owner, session_id)

    def _forget_locked(self, owner: str, session_id: str) -> set[str]:
        """Drop the session from the stitching index; the turn ids it held."""
        forgotten: set[str] = set()
        for key in [k for k in self._recent if k[0] == owner and k[1] == session_id]:
            ref = self._recent.pop(key)
            self._successors.pop(ref.turn_id, None)
            forgotten.add(ref.turn_id)
        return forgotten

    # ---- deletion
    def tombstone(self, owner: str, session_id: str) -> Tombstone:
        """``owner``'s session ``session_id`` is being deleted: none of its turns recorded or assigned so far will be
        written (see the module docstring). Call it before flushing and deleting the session's rows from the store."""
        key = (owner, session_id)
        with self._lock:
            recent = frozenset(self._forget_locked(owner, session_id))
            in_flight = frozenset(self._inflight.take_session(key))
            tomb = self._tombstones[key] = Tombstone(self._seq, in_flight, recent)  # covers an earlier deletion's batches too
            self._tombstones.move_to_end(key)
            self._prune_tombstones_locked()
            for turn_id in in_flight:
                self._doomed[turn_id] = None
            while len(self._doomed) > self._index_size:
                self._doomed.popitem(last=False)
        return tomb

    def _prune_tombstones_locked(self) -> None:
        """Forget the tombstones no batch can need any more; beyond ``index_size``, the oldest of the owner holding the
        most (``self._lock`` held).

        A tombstone matters only while a batch taken at or before its ``seq`` has not been checked by the writer;
        tombstones are kept in ``seq`` order, so the prefix older than every unchecked batch goes. More than
        ``index_size`` left (deletions by the thousand while the writer is stuck): the owner deleting the most loses its
        own oldest, never another owner's."""
        oldest_needed = min(self._unfiltered, default=self._seq + 1)
        while self._tombstones and next(iter(self._tombstones.values())).seq < oldest_needed:
            self._tombstones.popitem(last=False)
        while len(self._tombstones) > self._index_size:
            heaviest, _ = Counter(owner for owner, _ in self._tombstones).most_common(1)[0]
            del self._tombstones[next(k for k in self._tombstones if k[0] == heaviest)]

    def _undeleted(self, batches: Sequence[_Batch]) -> list[Turn]:
        """The turns of ``batches`` less those of sessions deleted after ``record`` took them (counted as dropped)."""
        kept = []
        with self._lock:
            for b in batches:
                self._unfiltered.discard(b.seq)
                for t in b.turns:
                    tomb = self._tombstones.get((t.owner, t.session_id))
                    if tomb is not None and b.seq <= tomb.seq:
                        tomb.dropped += 1
                    else:
                        kept.append(t)
        return kept

    def purge_journal(self, owner: str, session_id: str) -> int:
        """Remove ``owner``'s session ``session_id`` from the journal (blocking; call it after the deletion's flush);
        how many turns it held there. Unreadable lines stay (the replay skips them)."""
        path = self.journal_path
        with self._journal_lock:
            if path is None or not path.exists():
                return 0
            lines = path.read_text(encoding="utf-8").splitlines()
            keep = [line for line in lines if not _of_session(line, owner, session_id)]
            if len(keep) == len(lines):
                return 0
            if keep:
                _rewrite(path, keep)
            else:
                path.unlink()
            return len(lines) - len(keep)

    # ---- recording
    async def record(self, turns: list[Turn]) -> None:
        """Queue ``turns`` for writing; in ``sync`` mode, return once they are committed."""
        turns, seq = self._admit(turns)
        if not turns:
            return
        loop = asyncio.get_running_loop()
        batch = _Batch(turns, loop.create_future() if self.durability == "sync" else None, loop, seq=seq)
        try:
            await self._put(batch)
        except BaseException:  # cancelled while waiting for room: never queued, so no tombstone waits for it
            with self._lock:
                self._unfiltered.discard(seq)
            raise
        if batch.done is not None:
            await batch.done

    async def _put(self, batch: _Batch) -> None:
        """Queue ``batch``, waiting for room on the event loop (never in a thread of the default pool); never drop."""
        delay = 0.002
        counted = False
        while True:
            try:
                self._queue.put_nowait(batch)
                return
            except queue.Full:
                if not counted and self._metrics is not None and batch.turns:
                    self._metrics.record_backpressure.inc()
                counted = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)

    async def flush(self) -> None:
        """Return once everything queued before this call is durable (in the store, or in the journal)."""
        loop = asyncio.get_running_loop()
        marker = _Batch([], loop.create_future(), loop)
        await self._put(marker)
        assert marker.done is not None
        await marker.done

    def queued(self) -> int:
        return self._queue.qsize()

    def _writer(self) -> None:
        stop = False
        while not stop:
            try:
                first = self._queue.get(timeout=self.retry_s if self._journaled else None)
            except queue.Empty:
                self._replay()  # the journal holds turns: try the store again
                continue
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

    def _store_write(self, turns: list[Turn]) -> BaseException | None:
        """Write to the store, retrying briefly; the last error, or None once written."""
        error: BaseException | None = None
        for attempt in range(3):
            try:
                self.store.append_turns(turns)
                return None
            except Exception as exc:  # retried, then journaled: never dropped
                error = exc
                log.warning("recording %d turns failed (attempt %d): %r", len(turns), attempt + 1, exc)
                time.sleep(0.05 * 4**attempt)
        return error

    def _commit(self, batches: list[_Batch]) -> None:
        taken = [t for b in batches for t in b.turns]
        turns = self._undeleted(batches)
        if turns:
            error = self._store_write(turns)
            delay = 0.5
            while error is not None:
                try:
                    self._spill(turns)
                    break
                except OSError as exc:  # the journal cannot be written either: keep the turns and retry both
                    log.error("cannot journal %d turns either (%r); retrying in %.1f s", len(turns), exc, delay)
                    time.sleep(delay)
                    delay = min(delay * 2, 30.0)
                    error = self._store_write(turns)
            if error is None:
                self._written += len(turns)
                if self._metrics is not None:
                    self._metrics.recorded_turns.inc(len(turns))
                if self._journaled:
                    self._replay()
        with self._lock:
            for t in taken:
                for k in (t.turn_id, t.trajectory_id, t.completion_id):
                    left = self._pending.get(k, 0) - 1
                    if left > 0:
                        self._pending[k] = left
                    else:
                        self._pending.pop(k, None)
        for b in batches:
            if b.done is not None and b.loop is not None:
                b.loop.call_soon_threadsafe(settle, b.done, None)

    def _spill(self, turns: list[Turn]) -> None:
        """Append ``turns`` to the journal and fsync it: durable until the store takes them."""
        if self.journal_path is None:
            raise OSError("no journal path (the store has no path and none was given)")
        with self._journal_lock, open(self.journal_path, "a", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write("".join(t.model_dump_json() + "\n" for t in turns))
            f.flush()
            os.fsync(f.fileno())
        self._journaled, self.healthy = True, False
        log.error("the store refused %d turns: journaled in %s until it takes writes again", len(turns), self.journal_path)
        if self._metrics is not None:
            self._metrics.record_failures.inc(len(turns))

    def _replay(self) -> None:
        """Move the journal's turns into the store (idempotent); delete it once they are all in."""
        with self._journal_lock:  # a deletion's purge_journal sees the journal before or after, never half-replayed
            self._replay_locked()

    def _replay_locked(self) -> None:
        path = self.journal_path
        if path is None or not path.exists():
            self._journaled, self.healthy = False, True
            return
        turns: list[Turn] = []
        lines = path.read_text(encoding="utf-8").splitlines()
        for k, line in enumerate(lines):
            try:
                turns.append(Turn.model_validate_json(line))
            except ValueError:
                log.warning("journal %s line %d of %d is unreadable (torn by a crash?); skipped", path, k + 1, len(lines))
        try:
            for k in range(0, len(turns), self._max_batch):
                self.store.append_turns(turns[k : k + self._max_batch])
        except Exception as exc:  # still refusing: the journal stays, the next retry comes
            log.warning("replaying %d journaled turns failed: %r", len(turns), exc)
            self.healthy = False
            return
        path.unlink()
        self._journaled, self.healthy = False, True
        log.info("replayed %d journaled turns into the store", len(turns))


def _of_session(line: str, owner: str, session_id: str) -> bool:
    """Whether a journal line is a turn of ``owner``'s session ``session_id`` (an unreadable line is not)."""
    try:
        t = Turn.model_validate_json(line)
    except ValueError:
        return False
    return t.owner == owner and t.session_id == session_id


def _rewrite(path: Path, lines: list[str]) -> None:
    """Replace the file at ``path`` by ``lines`` atomically: a crash leaves the old journal or the new one, fsync'd."""
    tmp = path.with_name(path.name + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
