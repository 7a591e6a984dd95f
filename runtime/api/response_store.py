"""Stored Responses (``store: true``): the response object and the items it was answered from, per owner.

A SQLite file (``<data-dir>/responses.db``, WAL) keyed by response id, its schema versioned (``PRAGMA user_version``:
``RESPONSES``, migrated when the file opens by ``learner/records/migrations.py``'s runner). Each row keeps the owner (the
API key's identity, ``runtime/identity.py``), the session the response was served in, the response
object as returned, and its context items (every input item the model saw, the ``previous_response_id``
chain's included, each with an id). ``previous_response_id`` reads the context and output back to
continue the conversation; ``GET``, ``DELETE`` and ``input_items`` read or remove one row. Another
owner's response is reported as not found, and is never replaced by a ``put`` of the same id. ``delete_session``
removes every response an owner's session holds (the deletion of a session, ``runtime/admin/store.py``), with
``secure_delete`` on and the WAL truncated after it, so no copy of the deleted rows stays in the file; ``forbid``
names the turns of requests that were still generating when their session was deleted, and their responses are
then not stored (``put`` drops a response whose ``loopwise.turn_id`` is one of them). Calls are blocking: callers
run them in a worker thread.

``ResponseBackend`` is what the routes need; ``runtime/api/response_store_pg.py`` keeps the same rows in the PostgreSQL
interaction store's database (``--store postgresql://``), where every runtime on it sees them.

Not here: building responses (``runtime/api/responses.py``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from learner.records.migrations import Schema, migrate_sqlite


def responses_table(real: str) -> tuple[str, ...]:
    """The ``responses`` table and its indexes on both backends (``real``: SQLite's REAL, PostgreSQL's DOUBLE PRECISION).
    ``IF NOT EXISTS``: an SQLite file written before its schema had a version (0) has them already."""
    return (
        f"""CREATE TABLE IF NOT EXISTS responses (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            session_id TEXT NOT NULL,
            created_at {real} NOT NULL,
            response TEXT NOT NULL,
            context TEXT NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS responses_owner ON responses (owner, created_at)",
        "CREATE INDEX IF NOT EXISTS responses_session ON responses (owner, session_id)",
    )


def _v1_responses(conn: sqlite3.Connection) -> None:
    for sql in responses_table("REAL"):
        conn.execute(sql)


# the file's migrations (learner/records/migrations.py runs them); the same name as the table's on PostgreSQL
RESPONSES: Schema[sqlite3.Connection] = Schema("loopwise_responses_schema", ((1, _v1_responses),))

# store or replace a response; a row of another owner under the same id is left as it is (both backends)
UPSERT = """INSERT INTO responses (id, owner, session_id, created_at, response, context) VALUES (?, ?, ?, ?, ?, ?)
            ON CONFLICT (id) DO UPDATE SET session_id = excluded.session_id, created_at = excluded.created_at,
                                           response = excluded.response, context = excluded.context
            WHERE responses.owner = excluded.owner"""
SELECT = "SELECT id, owner, session_id, response, context FROM responses WHERE id = ? AND owner = ?"


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str
    session_id: str
    response: dict[str, Any]
    context: list[dict[str, Any]]  # the input items the model saw, in order (the chain's included)

    def row(self) -> tuple[str, str, str, float, str, str]:
        """The values of ``UPSERT``: the response and its context as JSON, dated now."""
        return (self.id, self.owner, self.session_id, time.time(), json.dumps(self.response), json.dumps(self.context))

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> StoredResponse:
        """The response a row of ``SELECT`` holds."""
        return cls(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]))


class ResponseBackend(Protocol):
    """What the routes need from a response store (this module's SQLite file, or ``runtime/api/response_store_pg.py``)."""

    def forbid(self, turn_ids: Iterable[str]) -> None: ...
    def put(self, stored: StoredResponse) -> None: ...
    def get(self, response_id: str, owner: str) -> StoredResponse | None: ...
    def delete(self, response_id: str, owner: str) -> bool: ...
    def delete_session(self, owner: str, session_id: str) -> int: ...
    def close(self) -> None: ...


class ForbiddenTurns:
    """Turn ids whose responses are not stored (see ``forbid``); the oldest are forgotten beyond ``size``. Thread-safe:
    ``add`` waits for a response being written under ``admitting``, so a deletion's ``forbid`` followed by its
    ``delete_session`` either stops a response or deletes it, never misses one written between the two."""

    def __init__(self, size: int = 100_000) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def add(self, turn_ids: Iterable[str]) -> None:
        with self._lock:
            for turn_id in turn_ids:
                self._ids[turn_id] = None
            while len(self._ids) > self._size:
                self._ids.popitem(last=False)

    @contextmanager
    def admitting(self, stored: StoredResponse) -> Iterator[bool]:
        """Held while ``stored`` is written: False when it answers a forbidden turn (then forgotten: a turn is answered once)."""
        turn_id = (stored.response.get("loopwise") or {}).get("turn_id")
        with self._lock:
            forbidden = isinstance(turn_id, str) and turn_id in self._ids
            if forbidden and isinstance(turn_id, str):
                del self._ids[turn_id]
            yield not forbidden


class ResponseStore:
    """The file is created on the first stored response, not before."""

    def __init__(self, path: Path, *, forbidden_size: int = 100_000) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._forbidden = ForbiddenTurns(forbidden_size)

    def _conn(self, create: bool) -> sqlite3.Connection | None:
        if self._db is None and (create or self.path.exists()):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA secure_delete=ON")  # a deleted response's bytes are overwritten, not left in free pages
            try:
                migrate_sqlite(db, RESPONSES)
            except BaseException:
                db.close()
                raise
            self._db = db
        return self._db

    def forbid(self, turn_ids: Iterable[str]) -> None:
        """The responses of these turns (their session was deleted while they generated) will not be stored."""
        self._forbidden.add(turn_ids)

    def put(self, stored: StoredResponse) -> None:
        """Store (or replace) a response, unless its turn was forbidden."""
        row = stored.row()
        with self._forbidden.admitting(stored) as admitted, self._lock:
            if admitted:
                db = self._conn(create=True)
                assert db is not None
                db.execute(UPSERT, row)

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            db = self._conn(create=False)
            if db is None:
                return None
            row = db.execute(SELECT, (response_id, owner)).fetchone()
        return None if row is None else StoredResponse.from_row(row)

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            db = self._conn(create=False)
            if db is None:
                return False
            cur = db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cur.rowcount > 0

    def delete_session(self, owner: str, session_id: str) -> int:
        """Delete every response of ``owner``'s session ``session_id`` (another owner's session of that name is
        untouched) and truncate the WAL; how many were deleted."""
        with self._lock:
            db = self._conn(create=False)
            if db is None:
                return 0
            n = db.execute("DELETE FROM responses WHERE owner = ? AND session_id = ?", (owner, session_id)).rowcount
            if n:
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return n

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
