"""The interaction store on PostgreSQL (``--store postgresql://...``): the SQLite store's interface, shared by many processes.

What it does:
- ``PostgresStore(url)`` opens a psycopg 3 connection pool (``psycopg_pool.ConnectionPool``, ``max_size``
  connections, opened at once: a wrong URL or a down server fails here with the server's message, the
  password never printed) and migrates the schema. Every method borrows one pooled connection for one
  transaction, so the recorder's writer thread, the reader pool and a learner in another process run
  side by side; several runtime processes may append to one database at once.
- Same tables, columns, semantics and public methods as ``learner.records.store.SqliteStore`` (sessions keyed by
  owner + name, append-only turns whose re-insert is a no-op, rewards only on the owner's own records,
  idempotency keys unique per owner, the adapter registry's shared state): the queries are
  ``learner/records/store_sql.py``'s (``StoreQueries`` with the ``POSTGRESQL`` dialect); this module adds the pool, its
  transactions, the pipelined batch append and the migrations. Token arrays are
  the same packed little-endian bytes in ``BYTEA`` columns (``bench/store_ingest.py --postgres`` measures
  them against native ``int4[]``/``real[]``/``smallint[]`` arrays); insertion order is a ``BIGSERIAL`` ``seq``
  (SQLite's rowid). A batch of turns is one transaction, sent in pipeline mode (one round trip).
- Durability: every commit is ``synchronous_commit = on`` (the server's WAL is flushed before the commit
  returns), so a committed batch survives the crash of any loopwise process and of the database server;
  ``--durability sync`` (the recorder answers after the commit) therefore loses no answered turn when a
  runtime is killed. Power-loss durability is the server's ``fsync`` setting, not this code's.
- Migrations: ``INTERACTIONS`` numbers them; opening the store runs ``learner/records/migrations.py``'s runner
  (``migrate_postgres``: under a transaction-scoped advisory lock it re-reads the version, the one row of
  ``loopwise_schema``, and applies what is missing, each migration in one transaction with its version bump), so
  concurrent openers never migrate twice and a failing migration leaves the previous version. An empty database
  gets the version-5 layout in one step (PostgreSQL support began at version 5), then the later migrations, the
  same as SQLite's. Through ``PostgresStore.migrate`` the same runner keeps the other schemas in this database,
  each with its own version table: the stored responses' (``runtime/api/response_store_pg.py``) and agent memory's
  (``memory/store_pg.py``), as each has its own SQLite file.
- Fails fast: before the pool opens, one plain connection is tried with ``connect_timeout_s`` (3 s) under a
  hard deadline, so an unreachable server, a wrong port or a refused login is a ``ConnectionError`` within
  seconds, naming the host and the URL without its password, instead of the pool's wait.

What it doesn't do: SQLite's page-level secure deletion. Deleted rows are gone from every table at once, but
their bytes stay in dead tuples until (auto)vacuum reuses the space, and in the server's WAL and backups:
secure erasure on PostgreSQL is the database operator's retention policy.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.abc import Buffer
from psycopg.types.string import StrDumperUnknown
from psycopg_pool import ConnectionPool, PoolTimeout

from learner.records import Turn
from learner.records.experiments_store import experiments_table
from learner.records.migrations import Schema, migrate_postgres
from learner.records.store_rows import turn_row
from learner.records.store_sql import INSERT_SESSION, INSERT_TRAJECTORY, INSERT_TURN, POSTGRESQL, StoreQueries, first_seen, is_postgres_url

log = logging.getLogger(__name__)

__all__ = ["INTERACTIONS", "PostgresStore", "probe", "redact_url"]


def redact_url(url: str) -> str:
    """``url`` without its password (for logs and errors)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


# ---------------------------------------------------------------------------------------------------
# schema: INTERACTIONS' migration N takes the tables from the previous one's version to N; an empty database jumps to 5


def _initial_v5(conn: psycopg.Connection) -> None:
    for sql in (
        """CREATE TABLE sessions (owner TEXT NOT NULL, session_id TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
                                  PRIMARY KEY (owner, session_id))""",
        """CREATE TABLE trajectories (
            seq BIGSERIAL NOT NULL,
            trajectory_id TEXT PRIMARY KEY,
            session_id TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            meta TEXT NOT NULL DEFAULT '{}',
            owner TEXT NOT NULL DEFAULT 'public'
        )""",
        """CREATE TABLE turns (
            seq BIGSERIAL NOT NULL,
            turn_id TEXT PRIMARY KEY,
            trajectory_id TEXT NOT NULL,
            session_id TEXT NOT NULL,
            idx INTEGER NOT NULL,
            parent_turn_id TEXT,
            completion_id TEXT NOT NULL,
            choice_index INTEGER NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            model TEXT NOT NULL,
            adapter TEXT,
            context_ids BYTEA NOT NULL,
            output_ids BYTEA NOT NULL,
            logprobs BYTEA NOT NULL,
            loss_mask BYTEA NOT NULL,
            sampling TEXT NOT NULL,
            tool_calls TEXT NOT NULL,
            finish_reason TEXT NOT NULL,
            timings TEXT NOT NULL,
            messages TEXT NOT NULL,
            output_text TEXT NOT NULL,
            continuation_key TEXT NOT NULL,
            prefix_key TEXT NOT NULL,
            owner TEXT NOT NULL DEFAULT 'public'
        )""",
        """CREATE TABLE rewards (
            seq BIGSERIAL NOT NULL,
            reward_id TEXT PRIMARY KEY,
            target TEXT NOT NULL CHECK (target IN ('turn', 'trajectory')),
            target_id TEXT NOT NULL,
            value DOUBLE PRECISION NOT NULL,
            source TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            comment TEXT,
            idempotency_key TEXT,
            owner TEXT NOT NULL DEFAULT 'public'
        )""",
        "CREATE INDEX trajectories_session ON trajectories (owner, session_id)",
        "CREATE INDEX trajectories_created ON trajectories (created_at)",
        "CREATE UNIQUE INDEX trajectories_seq ON trajectories (seq)",
        "CREATE UNIQUE INDEX turns_seq ON turns (seq)",
        "CREATE INDEX turns_trajectory ON turns (trajectory_id, idx)",
        "CREATE INDEX turns_completion ON turns (completion_id, choice_index)",
        "CREATE INDEX turns_continuation ON turns (owner, session_id, continuation_key)",
        "CREATE INDEX turns_parent ON turns (parent_turn_id)",
        "CREATE INDEX turns_created ON turns (created_at)",
        "CREATE INDEX turns_adapter ON turns (adapter, created_at)",
        "CREATE INDEX rewards_target ON rewards (target_id)",
        "CREATE UNIQUE INDEX rewards_idempotency ON rewards (owner, idempotency_key) WHERE idempotency_key IS NOT NULL",
    ):
        conn.execute(sql)


def _v6_registry(conn: psycopg.Connection) -> None:
    # the adapter registry's shared state: published versions every runtime loads, and the family aliases
    conn.execute(
        """CREATE TABLE registry (kind TEXT NOT NULL CHECK (kind IN ('adapter', 'alias')), name TEXT NOT NULL,
                                  value TEXT NOT NULL, updated_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (kind, name))"""
    )


def _v7_turn_checks(conn: psycopg.Connection) -> None:
    # a self-verifying agent's turn carries its parsed self-check and per-turn correctness (TurnCheck as JSON)
    conn.execute("ALTER TABLE turns ADD COLUMN self_check TEXT")


def _v8_turn_claims(conn: psycopg.Connection) -> None:
    # one continuation per turn across runtimes: the turn ids already continued (StoreQueries.claim_continuation)
    conn.execute("CREATE TABLE turn_claims (turn_id TEXT PRIMARY KEY, claimed_at DOUBLE PRECISION NOT NULL)")
    conn.execute("CREATE INDEX turn_claims_claimed ON turn_claims (claimed_at)")


def _v9_experiments(conn: psycopg.Connection) -> None:
    # the A/B experiments' table (learner/records/experiments_store.py); a database its store opened before has it already
    conn.execute(experiments_table("DOUBLE PRECISION"))


INTERACTIONS: Schema[psycopg.Connection] = Schema(
    "loopwise_schema", ((5, _initial_v5), (6, _v6_registry), (7, _v7_turn_checks), (8, _v8_turn_claims), (9, _v9_experiments))
)


def _where(url: str) -> str:
    """The host (and port) a URL names, for messages: the server a connection goes to."""
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number: the URL says it all
        return redact_url(url)
    if not host:
        return "the local socket"
    return f"{host}:{port}" if port else host


def probe(url: str, timeout_s: float = 3.0) -> None:
    """Connect once to ``url`` and close; a ``ConnectionError`` naming the host (never the password) when that fails or
    takes longer than ``timeout_s`` (libpq's ``connect_timeout``, under a hard deadline that a slow name lookup cannot
    stretch either)."""
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            psycopg.connect(url, connect_timeout=max(2, math.ceil(timeout_s))).close()  # libpq's least timeout is 2 s
            outcome.append(None)
        except BaseException as exc:  # reported by the caller's thread
            outcome.append(exc)

    worker = threading.Thread(target=attempt, name="loopwise-store-probe", daemon=True)
    worker.start()
    worker.join(max(2, math.ceil(timeout_s)) + 1.0)
    where = f"cannot reach the PostgreSQL store at {_where(url)} ({redact_url(url)})"
    if not outcome:
        raise ConnectionError(f"{where}: no answer within {timeout_s:g} s")
    error = outcome[0]
    if error is None:
        return
    if not isinstance(error, psycopg.Error):
        raise error
    text = str(error).strip()
    raise ConnectionError(f"{where}: {text.splitlines()[0] if text else type(error).__name__}") from None


# ---------------------------------------------------------------------------------------------------


class _NulSafeStr(StrDumperUnknown):
    """PostgreSQL text cannot hold U+0000 (SQLite can): one NUL in a model's output or a client's id would fail the
    whole batch of turns it was written with, other owners' turns included. Every string parameter is sent with
    each NUL replaced by U+FFFD; the exact token ids (``output_ids``) are bytes and unaffected."""

    def dump(self, obj: str) -> Buffer | None:
        return super().dump(obj.replace("\x00", "\ufffd"))


class PostgresStore(StoreQueries):
    """The interaction store on PostgreSQL. See the module docstring; the queries are ``learner/records/store_sql.py``'s."""

    _d = POSTGRESQL

    shared = True  # other processes write to the same store: continuation lookups must ask it, not a local index
    _turn_row = staticmethod(turn_row)

    def __init__(
        self, url: str, *, synchronous_full: bool = False, max_size: int = 8, timeout_s: float = 10.0, connect_timeout_s: float = 3.0
    ) -> None:
        if not is_postgres_url(url):
            raise ValueError("a PostgreSQL store URL starts with postgresql:// or postgres://")
        self.url = url
        self.display_url = redact_url(url)
        self.synchronous_full = synchronous_full  # kept for the interface: commits are always synchronous here
        probe(url, connect_timeout_s)  # an unreachable server fails here within seconds, not after the pool's wait
        self._pool = ConnectionPool(
            url, min_size=1, max_size=max_size, timeout=timeout_s, open=False, name="loopwise-store", configure=self._configure
        )
        try:
            self._pool.open(wait=True, timeout=timeout_s)
        except PoolTimeout:
            self._pool.close()
            probe(url, connect_timeout_s)  # why, if it says
            raise ConnectionError(f"cannot reach the PostgreSQL store at {_where(url)} ({self.display_url}): the connection pool timed out") from None
        try:
            self.schema_version = self.migrate(INTERACTIONS)
        except BaseException:
            self._pool.close()
            raise

    def migrate(self, schema: Schema[psycopg.Connection]) -> int:
        """Bring ``schema``'s tables in this database to their newest version (``migrate_postgres`` on a pooled
        connection); the modules that keep tables of their own here call it once when they open (stored responses,
        agent memory)."""
        with self._pool.connection() as conn:
            conn.autocommit = True
            try:
                return migrate_postgres(conn, schema)
            finally:
                conn.autocommit = False

    @staticmethod
    def _configure(conn: psycopg.Connection) -> None:
        conn.adapters.register_dumper(str, _NulSafeStr)
        conn.execute("SET synchronous_commit = on")
        conn.execute("SET application_name = 'loopwise'")
        conn.commit()

    @contextmanager
    def _tx(self, snapshot: bool = False) -> Iterator[psycopg.Connection]:
        """One pooled connection for one transaction (committed on success, rolled back on error)."""
        with self._pool.connection() as conn:
            if snapshot:
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            yield conn

    # StoreQueries' three ways to run a query. Reads and writes are each one READ COMMITTED transaction (every
    # statement sees what was committed before it began); a snapshot is REPEATABLE READ, so several reads see one
    # state. Writers are not serialized as on SQLite: row locks and unique indexes settle races (add_reward,
    # set_trajectory_meta, a deletion against a reward on what it deletes).
    def _read(self) -> AbstractContextManager[psycopg.Connection]:
        return self._tx()

    def _snapshot(self) -> AbstractContextManager[psycopg.Connection]:
        return self._tx(snapshot=True)

    def _write(self) -> AbstractContextManager[psycopg.Connection]:
        return self._tx()

    placeholder = "%s"

    @contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[psycopg.Connection]:
        """One pooled connection in one transaction, for tables other modules own in this database
        (``learner/records/experiments_store.py``); ``write`` is accepted for the SQLite store's interface."""
        with self._tx() as conn:
            yield conn

    def close(self) -> None:
        self._pool.close()

    # -- writes --------------------------------------------------------------------------------------

    def append_turns(self, turns: Sequence[Turn]) -> None:
        """Store a batch of turns (and their sessions/trajectories) in one transaction."""
        if not turns:
            return
        sessions, trajectories = first_seen(turns)
        rows = [self._turn_row(t) for t in turns]  # an unencodable turn fails the batch before anything is sent
        # psycopg pipelines each executemany: its rows go out without waiting for one answer each
        with self._tx() as conn, conn.cursor() as cur:
            cur.executemany(self._q(INSERT_SESSION), [(o, s, ts) for (o, s), ts in sessions.items()])
            cur.executemany(self._q(INSERT_TRAJECTORY), [(tid, o, sid, ts) for tid, (o, sid, ts) in trajectories.items()])
            cur.executemany(self._q(INSERT_TURN), rows)
