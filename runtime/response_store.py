"""Stored Responses (``store: true``): the response object and the items it was answered from, per owner.

A SQLite file (``<data-dir>/responses.db``, WAL) keyed by response id. Each row keeps the owner (the
API key's identity, ``runtime/identity.py``), the session the response was served in, the response
object as returned, and its context items (every input item the model saw, the ``previous_response_id``
chain's included, each with an id). ``previous_response_id`` reads the context and output back to
continue the conversation; ``GET``, ``DELETE`` and ``input_items`` read or remove one row. Another
owner's response is reported as not found. ``delete_session`` removes every response an owner's session
holds (the deletion of a session, ``runtime/store_routes.py``), with ``secure_delete`` on and the WAL
truncated after it, so no copy of the deleted rows stays in the file; ``forbid`` names the turns of requests that
were still generating when their session was deleted, and their responses are then not stored (``put`` drops a
response whose ``loopwise.turn_id`` is one of them). Calls are blocking: callers run them in a worker thread.

Not here: building responses (``runtime/serving_responses.py``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    context TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_owner ON responses (owner, created_at);
CREATE INDEX IF NOT EXISTS responses_session ON responses (owner, session_id);
"""


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str
    session_id: str
    response: dict[str, Any]
    context: list[dict[str, Any]]  # the input items the model saw, in order (the chain's included)


class ResponseStore:
    """The file is created on the first stored response, not before."""

    def __init__(self, path: Path, *, forbidden_size: int = 100_000) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._forbidden: OrderedDict[str, None] = OrderedDict()  # turn ids whose responses are not stored (the oldest forgotten)
        self._forbidden_size = forbidden_size

    def _conn(self, create: bool) -> sqlite3.Connection | None:
        if self._db is None and (create or self.path.exists()):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA secure_delete=ON")  # a deleted response's bytes are overwritten, not left in free pages
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    def forbid(self, turn_ids: Iterable[str]) -> None:
        """The responses of these turns (their session was deleted while they generated) will not be stored."""
        with self._lock:
            for turn_id in turn_ids:
                self._forbidden[turn_id] = None
            while len(self._forbidden) > self._forbidden_size:
                self._forbidden.popitem(last=False)

    def put(self, stored: StoredResponse) -> None:
        """Store (or replace) a response, unless its turn was forbidden."""
        turn_id = (stored.response.get("loopwise") or {}).get("turn_id")
        row = (stored.id, stored.owner, stored.session_id, time.time(), json.dumps(stored.response), json.dumps(stored.context))
        with self._lock:
            if isinstance(turn_id, str) and turn_id in self._forbidden:
                del self._forbidden[turn_id]
                return
            db = self._conn(create=True)
            assert db is not None
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            db = self._conn(create=False)
            if db is None:
                return None
            sql = "SELECT id, owner, session_id, response, context FROM responses WHERE id = ? AND owner = ?"
            row = db.execute(sql, (response_id, owner)).fetchone()
        if row is None:
            return None
        return StoredResponse(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]))

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
