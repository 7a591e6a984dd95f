"""Agent memory on PostgreSQL (``--store postgresql://``): the memory store's tables in the interaction store's database.

What it does: ``PostgresMemoryStore(db)`` keeps the same versioned documents as ``memory/store.py``'s SQLite file
(``memory_versions``, the same columns) with the same rules, across every runtime on the database: every query
selects by (owner, scope), so a key never reads, rewrites or deletes another key's memory; the newest
``keep_versions`` versions are kept; an over-long text is refused; a rewrite based on a snapshot (``write(...,
base=)``) is refused with ``StaleMemory`` when the document changed or was deleted since, whichever runtime did it.
The reads are :class:`memory.store.MemoryQueries`'.

How the rules hold across processes: a write and a deletion of one document take a transaction-scoped advisory
lock on it (two runtimes' rewrites cannot both take the next version, and a deletion cannot miss a rewrite committing
beside it). A deletion also bumps a counter in ``memory_deletions``, one row per bucket of document names (the first
16 bits of a hash of owner and scope: no name is kept after its document is gone); a snapshot carries its bucket's
count, read in the same statement as the version, and a write with ``base`` is refused when the count moved on (a
deletion of the document, or now and then of another in its bucket, since the snapshot: the rewrite is dropped, the
memory stays as it was).

``db`` is the interaction store (``learner.records.store_pg.PostgresStore``), used for its pooled transactions and its
migrations (``learner/records/migrations.py``'s runner; the tables' version in ``loopwise_memory_schema``, a newer one
refused with ``SchemaTooNew``); ``close`` leaves its pool open.

What it does not: erase securely: PostgreSQL keeps a deleted version's bytes in dead tuples until vacuum and in its WAL
and backups, as for turns (the database's retention policy); it stores text with U+0000 replaced, as the interaction
store does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import psycopg

from learner.records.migrations import Schema
from learner.records.store_pg import PostgresStore
from memory.settings import KEEP_VERSIONS, MAX_MEMORY_CHARS
from memory.store import MemoryQueries, MemoryVersion, Provenance, Snapshot, memory_versions_table

_LOCK_CLASS = 0x6C6D656D  # "lmem": the first key of a document's advisory lock (the second: a hash of its name)


def _v1_memory(conn: psycopg.Connection) -> None:
    conn.execute(memory_versions_table("DOUBLE PRECISION"))
    conn.execute("CREATE TABLE memory_deletions (bucket INTEGER PRIMARY KEY, deletions BIGINT NOT NULL)")


MEMORY: Schema[psycopg.Connection] = Schema("loopwise_memory_schema", ((1, _v1_memory),))


def _keys(owner: str, scope: str) -> tuple[int, int]:
    """The document's deletion bucket (16 bits) and the second key of its advisory lock (a signed 32-bit int)."""
    h = hashlib.sha256(f"{owner}\x00{scope}".encode()).digest()
    return int.from_bytes(h[:2], "big"), int.from_bytes(h[2:6], "big", signed=True)


class PostgresMemoryStore(MemoryQueries):
    """Versioned memory documents on PostgreSQL, shared by every runtime on the database; see the module docstring."""

    placeholder = "%s"

    def __init__(self, db: PostgresStore, *, max_chars: int = MAX_MEMORY_CHARS, keep_versions: int = KEEP_VERSIONS) -> None:
        self._limits(max_chars, keep_versions)
        self.db = db
        self.schema_version = db.migrate(MEMORY)

    def close(self) -> None:
        """Nothing to close: the connections are the interaction store's."""

    def _reading(self) -> AbstractContextManager[psycopg.Connection]:
        return self.db.transaction()

    @contextmanager
    def _locked(self, owner: str, scope: str) -> Iterator[tuple[psycopg.Connection, int]]:
        """A write transaction holding the document's lock; the document's deletion bucket."""
        bucket, key = _keys(owner, scope)
        with self.db.transaction(write=True) as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_LOCK_CLASS, key))
            yield conn, bucket

    def read(self, owner: str, scope: str) -> tuple[str, Snapshot]:
        """The current text ('' when there is none) and the snapshot to pass to :meth:`write` (one statement: one state)."""
        self._check(owner, scope)
        bucket, _ = _keys(owner, scope)
        newest = self._q(self.NEWEST)
        with self.db.transaction() as conn:
            row = conn.execute(
                f"SELECT (SELECT text {newest}), (SELECT version {newest}), (SELECT deletions FROM memory_deletions WHERE bucket = %s)",
                (owner, scope, owner, scope, bucket),
            ).fetchone()
        assert row is not None
        return (row[0] or ""), Snapshot(row[1] or 0, row[2] or 0)

    def write(self, owner: str, scope: str, text: str, provenance: Provenance, *, base: Snapshot | None = None) -> MemoryVersion:
        """Store ``text`` as the document's next version (see :meth:`MemoryQueries.write`)."""
        self._check(owner, scope)
        self._check_text(text)
        with self._locked(owner, scope) as (conn, bucket):
            row = conn.execute(
                self._q(f"SELECT ({self.LATEST}), (SELECT deletions FROM memory_deletions WHERE bucket = ?)"), (owner, scope, bucket)
            ).fetchone()
            assert row is not None
            latest, deletions = row[0] or 0, row[1] or 0
            self._check_base(scope, base, latest, deletions)
            return self._insert(conn, owner, scope, latest + 1, text, provenance)

    def delete(self, owner: str, scope: str) -> int:
        """Delete every version of the owner's document; returns how many versions were removed."""
        self._check(owner, scope)
        with self._locked(owner, scope) as (conn, bucket):
            n = conn.execute("DELETE FROM memory_versions WHERE owner = %s AND scope = %s", (owner, scope)).rowcount
            if n:  # nothing deleted, nothing a snapshot could bring back: the bucket's count (shared by others) stays
                conn.execute(
                    """INSERT INTO memory_deletions (bucket, deletions) VALUES (%s, 1)
                       ON CONFLICT (bucket) DO UPDATE SET deletions = memory_deletions.deletions + 1""",
                    (bucket,),
                )
        return int(n)
