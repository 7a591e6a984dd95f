"""The memory store: versioned memory documents per (owner, scope), in ``<data-dir>/memory.db``.

**Owners and scopes.** Every document belongs to an *owner* and is named by a *scope*:

- the owner is the caller's identity as the runtime derives it (``runtime/identity.py``): ``key-<hash>``
  for a Bearer key (the first 24 hex digits of its SHA-256; the key itself is never stored), or
  ``public`` for requests without one. One API key is one tenant (an application);
- the scope says whose memory it is inside that tenant: ``user:<id>`` (the request's ``user`` field),
  ``session:<id>`` (the ``X-Session-Id`` header or the user), ``agent:<name>`` (one memory for all of
  the tenant's calls to that agent). ``<id>`` is 1–200 printable characters without ``/`` or spaces.

Every read and write takes the owner, and every query selects by (owner, scope): knowing or guessing
a scope name never reaches another owner's document. Only :meth:`MemoryStore.documents` with
``owner=None`` lists across owners (the admin API).

**Versions.** Each rewrite is a new row (version 1, 2, …) with its provenance: the method, the copilot
adapter version (``None`` = base model, or no model call), the player's trajectory and last turn, the
copilot's own trajectory and turn, free ``meta`` (task key, outcome) and ``created_at``. The newest
``keep_versions`` versions are kept. Text longer than ``max_chars`` is refused (:class:`MemoryTooLarge`):
methods bound their output, so an over-long text is a bug to surface, not to trim silently.

**Deletion** (:meth:`MemoryStore.delete`) removes every version of the document; ``secure_delete``
overwrites the freed pages and the WAL is truncated, so no copy stays on disk. A rewrite that read the
memory before a deletion cannot bring it back: :meth:`write` with ``base`` (a :class:`Snapshot` taken
when reading) is refused with :class:`StaleMemory` if the document changed or was deleted since.

**File.** A sibling of the interaction store (``interactions.db``), not its tables: the two have their
own schema versions (``PRAGMA user_version``; this module's ``MEMORY`` migrations, applied on open by
``learner/records/migrations.py``'s runner, each in one ``BEGIN IMMEDIATE`` transaction; a file of a newer
loopwise is refused with ``SchemaTooNew``) and memory deletion never touches the interaction store.
One connection guarded by a lock (memory operations are small and rare next to turn recording); call it
from worker threads in async code. The reads are :class:`MemoryQueries`', shared with the same store on
PostgreSQL (``memory/store_pg.py``: ``--store postgresql://``, every runtime on the database sees the same
documents), which keeps these rules across processes.

Not here: who may read what over HTTP (``runtime/admin/memory.py``), writing memory (``memory/copilot.py``).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from learner.records.migrations import Schema, migrate_sqlite
from memory.settings import KEEP_VERSIONS, MAX_MEMORY_CHARS

log = logging.getLogger(__name__)

DEFAULT_DB_NAME = "memory.db"
SCOPE_KINDS = ("user", "session", "agent")
SCOPE_PATTERN = re.compile(r"^(user|session|agent):[^\s/\x00-\x1f\x7f]{1,200}$")
OWNER_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def db_path(data_dir: Path) -> Path:
    return Path(data_dir) / DEFAULT_DB_NAME


def valid_scope(scope: str) -> bool:
    return bool(SCOPE_PATTERN.match(scope))


def scope_name(kind: str, ident: str) -> str:
    """``kind:ident`` after checking both; ValueError otherwise."""
    scope = f"{kind}:{ident}"
    if kind not in SCOPE_KINDS or not valid_scope(scope):
        raise ValueError(f"invalid memory scope {scope!r}: kind is one of {', '.join(SCOPE_KINDS)}, the id 1-200 printable characters without '/'")
    return scope


class MemoryTooLarge(ValueError):
    """The memory text is longer than the store accepts."""


class StaleMemory(RuntimeError):
    """The document changed or was deleted after the rewrite read it; the rewrite is dropped."""


@dataclass(frozen=True)
class Provenance:
    """Where a memory version came from."""

    method: str
    adapter: str | None = None  # the copilot adapter version (family@N); None = base model or no model call
    trajectory_id: str | None = None  # the player's trajectory of the interaction
    turn_id: str | None = None  # the player's last turn in it
    copilot_trajectory_id: str | None = None
    copilot_turn_id: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. task_key, outcome


@dataclass(frozen=True)
class MemoryVersion:
    owner: str
    scope: str
    version: int
    text: str
    created_at: float
    provenance: Provenance

    def metadata(self) -> dict[str, Any]:
        """The version without its text (what the API lists for older versions)."""
        return {"version": self.version, "created_at": self.created_at, "chars": len(self.text), **asdict(self.provenance)}


@dataclass(frozen=True)
class Snapshot:
    """What a reader saw: the version (0 = none) and the deletion epoch at that moment."""

    version: int
    epoch: int


def memory_versions_table(real: str) -> str:
    """The ``memory_versions`` table of both backends (``created_at`` a ``real``: SQLite's REAL, PostgreSQL's DOUBLE PRECISION)."""
    return f"""CREATE TABLE memory_versions (
            owner TEXT NOT NULL,
            scope TEXT NOT NULL,
            version INTEGER NOT NULL,
            text TEXT NOT NULL,
            created_at {real} NOT NULL,
            method TEXT NOT NULL,
            adapter TEXT,
            trajectory_id TEXT,
            turn_id TEXT,
            copilot_trajectory_id TEXT,
            copilot_turn_id TEXT,
            meta TEXT NOT NULL,
            PRIMARY KEY (owner, scope, version)
        )"""


def _v1_initial(conn: sqlite3.Connection) -> None:
    conn.execute(memory_versions_table("REAL"))


# the file's migrations (learner/records/migrations.py runs them); the same name as the tables' on PostgreSQL
MEMORY: Schema[sqlite3.Connection] = Schema("loopwise_memory_schema", ((1, _v1_initial),))


_COLUMNS = "owner, scope, version, text, created_at, method, adapter, trajectory_id, turn_id, copilot_trajectory_id, copilot_turn_id, meta"


def _from_row(r: tuple[Any, ...]) -> MemoryVersion:
    prov = Provenance(
        method=r[5], adapter=r[6], trajectory_id=r[7], turn_id=r[8], copilot_trajectory_id=r[9], copilot_turn_id=r[10], meta=json.loads(r[11])
    )
    return MemoryVersion(owner=r[0], scope=r[1], version=r[2], text=r[3], created_at=r[4], provenance=prov)


class MemoryQueries:
    """The memory store's reads, said once for both backends (this module's SQLite file, ``memory/store_pg.py``'s
    PostgreSQL tables); each backend adds its connections, ``read`` (with its deletion epoch), ``write`` and ``delete``.
    Call it from worker threads in async code: every method blocks."""

    max_chars: int
    keep_versions: int
    schema_version: int
    placeholder = "?"  # what the queries below are written with; psycopg's is %s
    # the rows of the owner's document from its newest version on (``SELECT <columns> NEWEST``: the newest alone)
    NEWEST = "FROM memory_versions WHERE owner = ? AND scope = ? ORDER BY version DESC LIMIT 1"
    # the document's newest version number (NULL when it has none): what a write numbers its version after
    LATEST = "SELECT max(version) FROM memory_versions WHERE owner = ? AND scope = ?"

    def _limits(self, max_chars: int, keep_versions: int) -> None:
        if max_chars < 1 or keep_versions < 1:
            raise ValueError("max_chars and keep_versions must be at least 1")
        self.max_chars = max_chars
        self.keep_versions = keep_versions

    def _reading(self) -> AbstractContextManager[Any]:
        """A connection to run reads on (each statement sees what was committed before it)."""
        raise NotImplementedError

    def _q(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    @staticmethod
    def _check(owner: str, scope: str) -> None:
        if not OWNER_PATTERN.match(owner):
            raise ValueError(f"invalid memory owner {owner!r}")
        if not valid_scope(scope):
            raise ValueError(f"invalid memory scope {scope!r}")

    def _check_text(self, text: str) -> None:
        if len(text) > self.max_chars:
            raise MemoryTooLarge(f"memory text of {len(text)} characters is over the store's limit of {self.max_chars}")

    @staticmethod
    def _check_base(scope: str, base: Snapshot | None, latest: int, deleted: int) -> None:
        """Refuse a write based on ``base`` (:class:`StaleMemory`) when the document is no longer at its version or was
        deleted after it was taken (``deleted``: the deletion epoch now, as the backend counts it)."""
        if base is not None and (latest != base.version or deleted > base.epoch):
            raise StaleMemory(f"memory {scope} changed or was deleted since it was read (version {base.version} → {latest})")

    # -- reads -------------------------------------------------------------------------------------

    def current(self, owner: str, scope: str) -> MemoryVersion | None:
        """The newest version of the owner's document, or None."""
        self._check(owner, scope)
        with self._reading() as conn:
            row = conn.execute(self._q(f"SELECT {_COLUMNS} {self.NEWEST}"), (owner, scope)).fetchone()
        return _from_row(row) if row else None

    def read(self, owner: str, scope: str) -> tuple[str, Snapshot]:
        """The current text ('' when there is none) and the snapshot to pass to :meth:`write`."""
        raise NotImplementedError

    def versions(self, owner: str, scope: str) -> list[MemoryVersion]:
        """All kept versions of the owner's document, newest first."""
        self._check(owner, scope)
        with self._reading() as conn:
            rows = conn.execute(
                self._q(f"SELECT {_COLUMNS} FROM memory_versions WHERE owner = ? AND scope = ? ORDER BY version DESC"), (owner, scope)
            ).fetchall()
        return [_from_row(r) for r in rows]

    def document(self, owner: str, scope: str) -> dict[str, Any] | None:
        """The API view of one document: the current text and every kept version's metadata; None if absent."""
        versions = self.versions(owner, scope)
        if not versions:
            return None
        cur = versions[0]
        return {
            "object": "memory",
            "owner": owner,
            "scope": scope,
            "text": cur.text,
            "version": cur.version,
            "updated_at": cur.created_at,
            "versions": [v.metadata() for v in versions],
        }

    def documents(self, owner: str | None) -> list[dict[str, Any]]:
        """Summaries (owner, scope, version, chars, updated_at) of one owner's documents, or everyone's with ``owner=None``."""
        where, args = ("WHERE owner = ?", (owner,)) if owner is not None else ("", ())
        with self._reading() as conn:
            rows = conn.execute(
                self._q(f"""SELECT m.owner, m.scope, m.version, length(m.text), m.created_at FROM memory_versions m
                    JOIN (SELECT owner, scope, max(version) AS v FROM memory_versions {where} GROUP BY owner, scope) last
                      ON m.owner = last.owner AND m.scope = last.scope AND m.version = last.v
                    ORDER BY m.owner, m.scope"""),
                args,
            ).fetchall()
        return [{"owner": r[0], "scope": r[1], "version": r[2], "chars": r[3], "updated_at": r[4]} for r in rows]

    # -- writes ------------------------------------------------------------------------------------

    def write(self, owner: str, scope: str, text: str, provenance: Provenance, *, base: Snapshot | None = None) -> MemoryVersion:
        """Store ``text`` as the document's next version; older versions beyond ``keep_versions`` are dropped.

        With ``base``, refuses (:class:`StaleMemory`) when the document is no longer at ``base.version``
        or was deleted after the snapshot was taken.
        """
        raise NotImplementedError

    def delete(self, owner: str, scope: str) -> int:
        """Delete every version of the owner's document; returns how many versions were removed."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _insert(self, conn: Any, owner: str, scope: str, version: int, text: str, provenance: Provenance) -> MemoryVersion:
        """Insert ``version`` and drop the versions beyond ``keep_versions`` (inside the caller's write transaction)."""
        now, p = time.time(), provenance
        conn.execute(
            self._q(f"INSERT INTO memory_versions ({_COLUMNS}) VALUES ({', '.join('?' * 12)})"),
            (owner, scope, version, text, now, p.method, p.adapter, p.trajectory_id, p.turn_id, p.copilot_trajectory_id, p.copilot_turn_id,
             json.dumps(p.meta, ensure_ascii=False)),
        )  # fmt: skip
        prune = "DELETE FROM memory_versions WHERE owner = ? AND scope = ? AND version <= ?"
        conn.execute(self._q(prune), (owner, scope, version - self.keep_versions))
        return MemoryVersion(owner, scope, version, text, now, provenance)


class MemoryStore(MemoryQueries):
    """Versioned memory documents in one SQLite file; see the module docstring."""

    def __init__(self, path: Path, *, max_chars: int = MAX_MEMORY_CHARS, keep_versions: int = KEEP_VERSIONS) -> None:
        self._limits(max_chars, keep_versions)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._epochs = itertools.count(1)
        self._epoch = 0
        self._deleted: dict[tuple[str, str], int] = {}  # (owner, scope) -> epoch of its last deletion, this process
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
        try:
            self._conn.execute("PRAGMA busy_timeout = 5000")
            self._conn.execute("PRAGMA secure_delete = ON")
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RuntimeError(f"could not put {self.path} in WAL mode (journal_mode={mode})")
            self.schema_version = migrate_sqlite(self._conn, MEMORY)
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    def read(self, owner: str, scope: str) -> tuple[str, Snapshot]:
        """The current text ('' when there is none) and the snapshot to pass to :meth:`write`."""
        self._check(owner, scope)
        with self._lock:
            row = self._conn.execute(f"SELECT text, version {self.NEWEST}", (owner, scope)).fetchone()
            snap = Snapshot(row[1] if row else 0, self._epoch)
        return (row[0] if row else ""), snap

    def write(self, owner: str, scope: str, text: str, provenance: Provenance, *, base: Snapshot | None = None) -> MemoryVersion:
        """Store ``text`` as the document's next version (see :meth:`MemoryQueries.write`)."""
        self._check(owner, scope)
        self._check_text(text)
        with self._lock, self._write() as conn:
            latest = conn.execute(self.LATEST, (owner, scope)).fetchone()[0] or 0
            self._check_base(scope, base, latest, self._deleted.get((owner, scope), 0))
            return self._insert(conn, owner, scope, latest + 1, text, provenance)

    def delete(self, owner: str, scope: str) -> int:
        """Delete every version of the owner's document (securely); returns how many versions were removed."""
        self._check(owner, scope)
        with self._lock:
            with self._write() as conn:
                n = conn.execute("DELETE FROM memory_versions WHERE owner = ? AND scope = ?", (owner, scope)).rowcount
                if n:  # nothing deleted, nothing a snapshot could bring back: no epoch (a 404 costs others nothing)
                    self._epoch = next(self._epochs)
                    self._deleted[(owner, scope)] = self._epoch
            if n:
                self._checkpoint_truncate()
        return n

    def _checkpoint_truncate(self) -> None:
        for _ in range(3):
            busy, _log, _done = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                return
            time.sleep(0.05)
        log.warning("wal_checkpoint(TRUNCATE) after a memory deletion stayed busy; the WAL of %s still holds old pages", self.path)
