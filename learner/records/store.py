"""The interaction store: sessions → trajectories → turns → rewards, in one SQLite file (WAL mode).

What it does:
- ``SqliteStore(path)`` opens (creating parent directories) an SQLite database in WAL mode with
  ``synchronous=NORMAL`` (``synchronous_full=True`` → ``FULL``: a committed batch then also survives
  power loss, not only a process crash), ``busy_timeout`` 5000 ms, ``secure_delete=ON`` and an
  automatic checkpoint every 4000 WAL pages (~16 MiB).
- Append-only for turns: a turn row is inserted once and never UPDATEd; rewards are their own rows.
  ``append_turns`` writes a batch in ONE transaction (group commit): all of it or none of it.
  Re-appending a turn id that is already stored is a no-op (``ON CONFLICT DO NOTHING``: the first copy
  wins), so a recorder may safely retry a batch whose commit outcome it did not see.
- The queries are said once for this store and the PostgreSQL one: ``learner/records/store_sql.py`` (``StoreQueries``
  with the ``SQLITE`` dialect); this module adds the file, its connections and transactions, the batch append,
  the WAL truncation after deletions and the schema's migrations. Rows ↔ records: ``learner/records/store_rows.py``.
- Token data is stored compactly as packed little-endian arrays, not JSON: ``context_ids`` and
  ``output_ids`` as int32 (``array('i')``), ``loss_mask`` as int8 (``array('b')``) and ``logprobs``
  as float32 (``array('f')``). Engines produce float32 logprobs, so those round-trip exactly;
  an arbitrary Python float comes back rounded to float32 (relative error ≤ 6e-8).
  Messages, sampling, tool calls and timings are JSON text (for people and admin tools).
- Schema-versioned: ``INTERACTIONS`` numbers the file's migrations and ``PRAGMA user_version`` is the last one
  applied. Opening the store applies the missing ones in order through ``learner/records/migrations.py``'s runner
  (``migrate_sqlite``: each in one ``BEGIN IMMEDIATE`` transaction with its version bump, so concurrent openers do
  not migrate twice; a file of a newer loopwise is refused with ``SchemaTooNew``).
- Thread-safety: one sqlite connection per thread (``threading.local``); the recorder's writer
  thread and the event-loop thread each get their own, and WAL lets readers run during a write.
- Owners (version 5): every session, trajectory, turn and reward carries the identity of the API key
  that made it (``owner``; ``public`` for rows of older files and open servers). Sessions are keyed by
  (owner, session_id); continuation lookups, deletion of a session and idempotency keys are per owner,
  and ``add_reward`` accepts a reward only for a target of the reward's own owner.
- Self-checks (version 7): a self-verifying agent's turn stores its parsed self-check and per-turn
  correctness (``Turn.self_check``) as JSON in ``turns.self_check`` (NULL otherwise).
- Continuation claims (version 8): ``turn_claims`` holds the ids of turns a runtime has continued
  (``claim_continuation``: the primary key lets one claim win), so two runtimes on one PostgreSQL store never
  extend one trajectory from the same turn; a single runtime's own index makes them unneeded on SQLite.
- Experiments (version 9): the A/B experiments' table, created by the migrations as every table of this file;
  ``transaction(write=...)`` and ``placeholder`` let the module that owns its queries
  (``learner/records/experiments_store.py``) use the store's connections.
- Deletion (``delete_session``, ``delete_trajectories``, ``prune``) is complete and secure: rows are removed from every
  table, ``secure_delete`` overwrites the freed content, and ``delete_session`` truncates the WAL
  (``wal_checkpoint(TRUNCATE)``) so no copy of the deleted pages is left in the ``-wal`` file.

- The store a ``--store`` value names (this one, or ``learner.records.store_pg.PostgresStore`` for a ``postgresql://``
  URL) is opened by ``learner/records/store_open.py``'s ``open_store``.

What it doesn't do: build training batches: ``iter_samples`` yields plain per-turn dicts (also what
``python -m learner export`` writes).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from learner.records import Turn, UnknownTarget
from learner.records.experiments_store import experiments_table
from learner.records.migrations import Schema, migrate_sqlite
from learner.records.store_rows import REWARD_COLUMNS, TURN_COLUMNS, turn_row
from learner.records.store_sql import INSERT_SESSION, INSERT_TRAJECTORY, INSERT_TURN, SQLITE, StoreQueries, first_seen

log = logging.getLogger(__name__)

DEFAULT_DB_NAME = "interactions.db"
WAL_AUTOCHECKPOINT_PAGES = 4000


def db_path(data_dir: Path) -> Path:
    """The store's default location under a data directory."""
    return Path(data_dir) / DEFAULT_DB_NAME


__all__ = [
    "INTERACTIONS",
    "REWARD_COLUMNS",
    "TURN_COLUMNS",
    "SqliteStore",
    "UnknownTarget",
    "db_path",
    "turn_row",
]


# ---------------------------------------------------------------------------------------------------
# schema and migrations


def _v1_initial(conn: sqlite3.Connection) -> None:
    for sql in (
        "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, created_at REAL NOT NULL)",
        "CREATE TABLE trajectories (trajectory_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, created_at REAL NOT NULL)",
        """CREATE TABLE turns (
            turn_id TEXT PRIMARY KEY,
            trajectory_id TEXT NOT NULL,
            session_id TEXT NOT NULL,
            idx INTEGER NOT NULL,
            parent_turn_id TEXT,
            completion_id TEXT NOT NULL,
            choice_index INTEGER NOT NULL,
            created_at REAL NOT NULL,
            model TEXT NOT NULL,
            adapter TEXT,
            context_ids BLOB NOT NULL,
            output_ids BLOB NOT NULL,
            logprobs BLOB NOT NULL,
            loss_mask BLOB NOT NULL,
            sampling TEXT NOT NULL,
            tool_calls TEXT NOT NULL,
            finish_reason TEXT NOT NULL,
            timings TEXT NOT NULL,
            messages TEXT NOT NULL,
            output_text TEXT NOT NULL,
            continuation_key TEXT NOT NULL,
            prefix_key TEXT NOT NULL
        )""",
        """CREATE TABLE rewards (
            reward_id TEXT PRIMARY KEY,
            target TEXT NOT NULL CHECK (target IN ('turn', 'trajectory')),
            target_id TEXT NOT NULL,
            value REAL NOT NULL,
            source TEXT NOT NULL,
            created_at REAL NOT NULL,
            comment TEXT,
            idempotency_key TEXT
        )""",
        "CREATE INDEX trajectories_session ON trajectories (session_id)",
        "CREATE INDEX trajectories_created ON trajectories (created_at)",
        "CREATE INDEX turns_trajectory ON turns (trajectory_id, idx)",
        "CREATE INDEX turns_completion ON turns (completion_id, choice_index)",
        "CREATE INDEX turns_continuation ON turns (session_id, continuation_key)",
        "CREATE INDEX turns_parent ON turns (parent_turn_id)",
        "CREATE INDEX turns_created ON turns (created_at)",
        "CREATE INDEX rewards_target ON rewards (target_id)",
    ):
        conn.execute(sql)


def _v2_unique_idempotency_key(conn: sqlite3.Connection) -> None:
    # Version 1 looked idempotency keys up by a table scan. Version 2 makes them unique and indexed.
    # A v1 file written by a racing client could hold a key twice: the earliest reward keeps the key,
    # later duplicates stay stored (rewards are never dropped) but lose the key.
    conn.execute(
        """UPDATE rewards SET idempotency_key = NULL
           WHERE idempotency_key IS NOT NULL
             AND rowid > (SELECT MIN(r2.rowid) FROM rewards r2 WHERE r2.idempotency_key = rewards.idempotency_key)"""
    )
    conn.execute("CREATE UNIQUE INDEX rewards_idempotency ON rewards (idempotency_key) WHERE idempotency_key IS NOT NULL")


def _v3_experiments(conn: sqlite3.Connection) -> None:
    # Turns get an (adapter, created_at) index for the A/B experiments' per-arm statistics. Version 3 also created the
    # experiments table itself; version 9 does now (a file migrated in between has it already, with the same columns).
    conn.execute("CREATE INDEX turns_adapter ON turns (adapter, created_at)")


def _v4_trajectory_meta(conn: sqlite3.Connection) -> None:
    # Agent runs annotate their trajectory (agent, task key, stop reason, whether it is trainable).
    conn.execute("ALTER TABLE trajectories ADD COLUMN meta TEXT NOT NULL DEFAULT '{}'")


def _v5_owners(conn: sqlite3.Connection) -> None:
    # Every record has an owner: the identity of the API key that made it (``runtime/identity.py``;
    # ``public`` on an open server, which is also what rows written before version 5 get). A session name
    # is the client's word, so sessions are keyed by (owner, session_id): two keys' "alice" are two
    # sessions. Stitching looks up continuations within one owner's session, idempotency keys are unique
    # per owner (one key's claim can no longer make another's feedback a "duplicate"), and a reward
    # records who gave it.
    conn.execute(
        "CREATE TABLE sessions_v5 (owner TEXT NOT NULL, session_id TEXT NOT NULL, created_at REAL NOT NULL, PRIMARY KEY (owner, session_id))"
    )
    conn.execute("INSERT INTO sessions_v5 (owner, session_id, created_at) SELECT 'public', session_id, created_at FROM sessions")
    conn.execute("DROP TABLE sessions")
    conn.execute("ALTER TABLE sessions_v5 RENAME TO sessions")
    for table in ("trajectories", "turns", "rewards"):
        conn.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT NOT NULL DEFAULT 'public'")
    conn.execute("DROP INDEX trajectories_session")
    conn.execute("CREATE INDEX trajectories_session ON trajectories (owner, session_id)")
    conn.execute("DROP INDEX turns_continuation")
    conn.execute("CREATE INDEX turns_continuation ON turns (owner, session_id, continuation_key)")
    conn.execute("DROP INDEX rewards_idempotency")
    conn.execute("CREATE UNIQUE INDEX rewards_idempotency ON rewards (owner, idempotency_key) WHERE idempotency_key IS NOT NULL")


def _v6_registry(conn: sqlite3.Connection) -> None:
    # The adapter registry's shared state (runtime/adapters/sync.py): the adapter versions every runtime on this
    # store loads, and the family aliases, so several runtimes agree on what a family name serves.
    conn.execute(
        """CREATE TABLE registry (kind TEXT NOT NULL CHECK (kind IN ('adapter', 'alias')), name TEXT NOT NULL,
                                  value TEXT NOT NULL, updated_at REAL NOT NULL, PRIMARY KEY (kind, name))"""
    )


def _v7_turn_checks(conn: sqlite3.Connection) -> None:
    # A self-verifying agent's turn carries its parsed self-check and the verifier's judgment of its answer
    # (``TurnCheck`` as JSON; NULL for every other turn and for rows written before version 7).
    conn.execute("ALTER TABLE turns ADD COLUMN self_check TEXT")


def _v8_turn_claims(conn: sqlite3.Connection) -> None:
    # One continuation per turn across runtimes (``StoreQueries.claim_continuation``): the ids of the turns a runtime
    # has continued, claimed before it generates. Only a store other processes write too (PostgreSQL) is asked; the
    # table is here as well so that both backends keep one schema.
    conn.execute("CREATE TABLE turn_claims (turn_id TEXT PRIMARY KEY, claimed_at REAL NOT NULL)")
    conn.execute("CREATE INDEX turn_claims_claimed ON turn_claims (claimed_at)")


def _v9_experiments(conn: sqlite3.Connection) -> None:
    # The A/B experiments' config and state (``learner/records/experiments_store.py``). Files migrated between versions
    # 3 and 8 have the table already, with these columns (version 3 created it; then the experiments' store did when it
    # opened): ``IF NOT EXISTS`` keeps it and its rows.
    conn.execute(experiments_table("REAL"))


# INTERACTIONS' migration N takes the file from version N - 1 to N (version 0 = an empty file).
INTERACTIONS: Schema[sqlite3.Connection] = Schema(
    "loopwise_schema",
    (
        (1, _v1_initial),
        (2, _v2_unique_idempotency_key),
        (3, _v3_experiments),
        (4, _v4_trajectory_meta),
        (5, _v5_owners),
        (6, _v6_registry),
        (7, _v7_turn_checks),
        (8, _v8_turn_claims),
        (9, _v9_experiments),
    ),
)


class SqliteStore(StoreQueries):
    """The interaction store on one SQLite file. See the module docstring; the queries are ``learner/records/store_sql.py``'s."""

    _d = SQLITE

    _turn_row = staticmethod(turn_row)  # a Turn → the row to insert (the ingest benchmark swaps in JSON)
    shared = False  # one runtime writes this file: its recorder's recent-turn index is authoritative

    def __init__(self, path: Path, *, synchronous_full: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._synchronous = "FULL" if synchronous_full else "NORMAL"
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._closed = False
        try:
            conn = self._conn()
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RuntimeError(f"could not put {self.path} in WAL mode (journal_mode={mode})")
            self.schema_version = migrate_sqlite(conn, INTERACTIONS)
        except BaseException:
            self.close()
            raise

    # -- connections ---------------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise RuntimeError("the store is closed")
            # check_same_thread=False only so that close() may close every thread's connection;
            # each connection is otherwise used by the one thread that opened it.
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
            conn.execute("PRAGMA busy_timeout = 5000")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            conn.execute("PRAGMA secure_delete = ON")
            # checkpoint every ~16 MiB of WAL instead of 4 MiB: fewer fsyncs on the ingest path (≈ +30% turns/s)
            conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}")
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        yield self._conn()  # autocommit: each statement reads the latest committed state

    @contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn()
        conn.execute("BEGIN")  # a read transaction: every statement in it sees one snapshot
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")  # takes the write lock now: the transaction's reads see what it will write over
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    placeholder = "?"

    @contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[sqlite3.Connection]:
        """This thread's connection in one transaction (``write``: ``BEGIN IMMEDIATE``), for tables other modules own
        in this file (``learner/records/experiments_store.py``)."""
        with self._write() if write else self._snapshot() as conn:
            yield conn

    def close(self) -> None:
        self._closed = True
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()
        self._local = threading.local()

    # -- writes --------------------------------------------------------------------------------------

    def append_turns(self, turns: Sequence[Turn]) -> None:
        """Store a batch of turns (and their sessions/trajectories) in one transaction."""
        if not turns:
            return
        sessions, trajectories = first_seen(turns)
        with self._write() as conn:
            conn.executemany(INSERT_SESSION, ((o, s, ts) for (o, s), ts in sessions.items()))
            conn.executemany(INSERT_TRAJECTORY, ((tid, o, sid, ts) for tid, (o, sid, ts) in trajectories.items()))
            # encoded lazily inside the transaction: a turn that cannot be encoded rolls back the batch
            conn.executemany(INSERT_TURN, (self._turn_row(t) for t in turns))

    def _after_delete(self) -> None:
        self._checkpoint_truncate()

    def _checkpoint_truncate(self) -> None:
        # Copies the (securely overwritten) pages into the main file and truncates the WAL, so the
        # deleted rows survive nowhere. Each try waits up to busy_timeout for readers of an older
        # snapshot (ours are short); if one still holds on, the next checkpoint finishes the job.
        conn = self._conn()
        for _ in range(3):
            busy, _log, _done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                return
            time.sleep(0.05)
        log.warning("wal_checkpoint(TRUNCATE) after a deletion stayed busy; the WAL of %s still holds old pages", self.path)

    def integrity_check(self) -> str:
        rows = self._conn().execute("PRAGMA integrity_check").fetchall()
        return "\n".join(str(r[0]) for r in rows)
