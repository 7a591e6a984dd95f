"""The one migration runner for every database loopwise keeps, on SQLite and on PostgreSQL.

What it does:
- A ``Schema`` is one versioned set of tables (a namespace): its ``name`` and its ``migrations``, an ordered tuple
  of numbered steps ``(version, step)``. ``step(conn)`` takes the tables from the previous entry's version (0, an
  empty database, for the first) to ``version``; versions start at 1 or later and strictly increase, so a step may
  skip versions (PostgreSQL's interaction tables begin at 5). Each store keeps its own schema beside its queries:
  the interactions' (``learner/records/store.py``, ``learner/records/store_pg.py``: turns, rewards, the adapter
  registry, the A/B experiments), agent memory's (``memory/store.py``, ``memory/store_pg.py``) and the stored
  responses' (``runtime/api/response_store.py``, ``runtime/api/response_store_pg.py``).
- ``migrate_sqlite(conn, schema)``: one SQLite file holds one schema, its version in ``PRAGMA user_version``. Each
  step runs with its version bump in one ``BEGIN IMMEDIATE`` transaction (the file's write lock, taken before the
  version is read: two processes opening one file never migrate twice). Steps must use ``conn.execute`` only
  (``executescript`` would commit mid-step). ``conn`` is in autocommit mode (``isolation_level=None``).
- ``migrate_postgres(conn, schema)``: one database holds several schemas, each version the one row of the table the
  schema is named after (``loopwise_schema``, ``loopwise_memory_schema``, ``loopwise_responses_schema``). Each step
  runs with its version bump in one transaction that first takes ``pg_advisory_xact_lock`` (one key for every
  schema), then reads the version, so runtimes starting at once on one database migrate once; PostgreSQL's DDL is
  transactional. ``conn`` is in autocommit mode (psycopg's ``autocommit = True``).
- On both: a version past the schema's newest is refused (``SchemaTooNew``, nothing changed); a failing step rolls
  back with its transaction and leaves the previous version; ``target`` stops at an older version (tests build the
  databases earlier code left with it); a database at a version no step leads to is refused too.

What it does not: hold any table's definition, open connections, or import psycopg (its connections are only typed).
"""

from __future__ import annotations

import itertools
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import psycopg

__all__ = ["Schema", "SchemaTooNew", "migrate_postgres", "migrate_sqlite"]

_PG_LOCK = 0x6C6F6F70  # "loop": the advisory lock key serializing every schema's migrations across processes

C = TypeVar("C")
_NAME = re.compile(r"[a-z_][a-z0-9_]*")  # a plain SQL identifier: it is written into PostgreSQL statements as it is


class SchemaTooNew(RuntimeError):
    """The database was written by a newer loopwise (its schema version is past this code's)."""


@dataclass(frozen=True)
class Schema(Generic[C]):
    """One versioned set of tables and its numbered migrations (see the module docstring). ``C``: the connection type."""

    name: str  # on PostgreSQL the table that holds the version; the same name for the SQLite file's schema
    migrations: tuple[tuple[int, Callable[[C], None]], ...]

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"schema name {self.name!r} is not a plain SQL identifier")
        versions = [v for v, _ in self.migrations]
        if not versions or versions[0] < 1 or any(a >= b for a, b in itertools.pairwise(versions)):
            raise ValueError(f"the migrations of {self.name} must be numbered from 1 or later, strictly increasing: {versions}")

    @property
    def version(self) -> int:
        """The newest version: where the last migration leads."""
        return self.migrations[-1][0]

    def next_step(self, version: int, target: int) -> tuple[int, Callable[[C], None]] | None:
        """The migration that takes tables at ``version`` on towards ``target``; None when they are there."""
        known = {0, *(v for v, _ in self.migrations)}
        if version > self.version:
            raise SchemaTooNew(f"database schema version {version} of {self.name} is newer than this code's {self.version}")
        if target not in known:
            raise ValueError(f"{target} is not a version of {self.name} (they are {sorted(known)})")
        if version >= target:
            return None
        if version not in known:
            raise RuntimeError(f"database schema version {version} of {self.name} is not one this code migrates from ({sorted(known)})")
        return next(m for m in self.migrations if m[0] > version)


def migrate_sqlite(conn: sqlite3.Connection, schema: Schema[sqlite3.Connection], target: int | None = None) -> int:
    """Bring the file's ``schema`` to ``target`` (default: its newest version), one ``BEGIN IMMEDIATE`` transaction per
    migration; the final version."""
    target = schema.version if target is None else target
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])  # read under the write lock
            step = schema.next_step(version, target)
            if step is None:
                conn.execute("COMMIT")
                return version
            step[1](conn)
            conn.execute(f"PRAGMA user_version = {step[0]}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def migrate_postgres(conn: psycopg.Connection, schema: Schema[psycopg.Connection], target: int | None = None) -> int:
    """Bring ``schema``'s tables in ``conn``'s database to ``target`` (default: its newest version), one transaction per
    migration, each holding the advisory lock every opener takes first; the final version."""
    target = schema.version if target is None else target
    table = schema.name  # a plain identifier (Schema checks it)
    while True:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_LOCK,))
            conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (version INTEGER NOT NULL)")
            row = conn.execute(f"SELECT version FROM {table}").fetchone()
            version = 0 if row is None else int(row[0])
            step = schema.next_step(version, target)
            if step is None:
                return version
            step[1](conn)
            if row is None:
                conn.execute(f"INSERT INTO {table} (version) VALUES (%s)", (step[0],))
            else:
                conn.execute(f"UPDATE {table} SET version = %s", (step[0],))
