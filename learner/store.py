"""The interaction store: sessions → trajectories → turns → rewards, in one SQLite file (WAL mode).

What it does:
- ``SqliteStore(path)`` opens (creating parent directories) an SQLite database in WAL mode with
  ``synchronous=NORMAL`` (``synchronous_full=True`` → ``FULL``: a committed batch then also survives
  power loss, not only a process crash), ``busy_timeout`` 5000 ms, ``secure_delete=ON`` and an
  automatic checkpoint every 4000 WAL pages (~16 MiB).
- Append-only for turns: a turn row is inserted once and never UPDATEd; rewards are their own rows.
  ``append_turns`` writes a batch in ONE transaction (group commit): all of it or none of it.
  Re-appending a turn id that is already stored is a no-op (``INSERT OR IGNORE``: the first copy
  wins), so a recorder may safely retry a batch whose commit outcome it did not see.
- Token data is stored compactly as packed little-endian arrays, not JSON: ``context_ids`` and
  ``output_ids`` as int32 (``array('i')``), ``loss_mask`` as int8 (``array('b')``) and ``logprobs``
  as float32 (``array('f')``). Engines produce float32 logprobs, so those round-trip exactly;
  an arbitrary Python float comes back rounded to float32 (relative error ≤ 6e-8).
  Messages, sampling, tool calls and timings are JSON text (for people and admin tools).
- Schema-versioned: ``PRAGMA user_version`` is the number of ``MIGRATIONS`` applied. Opening the
  store applies the missing ones in order, each in its own transaction together with the version
  bump (``BEGIN IMMEDIATE``, so concurrent openers do not migrate twice). Migrations must use
  ``conn.execute`` only (``executescript`` would commit mid-migration).
- Thread-safety: one sqlite connection per thread (``threading.local``); the recorder's writer
  thread and the event-loop thread each get their own, and WAL lets readers run during a write.
- Owners (version 5): every session, trajectory, turn and reward carries the identity of the API key
  that made it (``owner``; ``public`` for rows of older files and open servers). Sessions are keyed by
  (owner, session_id); continuation lookups, deletion of a session and idempotency keys are per owner,
  and ``add_reward`` accepts a reward only for a target of the reward's own owner.
- Self-checks (version 7): a self-verifying agent's turn stores its parsed self-check and per-turn
  correctness (``Turn.self_check``) as JSON in ``turns.self_check`` (NULL otherwise).
- Deletion (``delete_session``, ``delete_trajectories``, ``prune``) is complete and secure: rows are removed from every
  table, ``secure_delete`` overwrites the freed content, and ``delete_session`` truncates the WAL
  (``wal_checkpoint(TRUNCATE)``) so no copy of the deleted pages is left in the ``-wal`` file.

- ``transaction(write=...)``, ``placeholder`` and ``dialect`` let a module that owns a table of its own in this
  file use the store's connections: the A/B experiments' table (``runtime/experiments_store.py``).

- ``open_store(spec)``: the store a ``--store`` value names: a ``postgresql://`` URL opens
  ``learner.store_pg.PostgresStore`` (same public methods, same tables and columns, BYTEA for the packed
  arrays), anything else is an SQLite file path.

What it doesn't do: build training batches: ``iter_samples`` yields plain per-turn dicts (also what
``python -m learner export`` writes).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from learner.records import Reward, ToolCallRecord, Trajectory, Turn, TurnCheck, TurnRef, TurnTimings, UnknownTarget

log = logging.getLogger(__name__)

DEFAULT_DB_NAME = "interactions.db"
WAL_AUTOCHECKPOINT_PAGES = 4000


def db_path(data_dir: Path) -> Path:
    """The store's default location under a data directory."""
    return Path(data_dir) / DEFAULT_DB_NAME


__all__ = ["SchemaTooNew", "SqliteStore", "UnknownTarget", "db_path", "is_postgres_url", "migrate", "open_store"]


def is_postgres_url(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(("postgresql://", "postgres://"))


def open_store(spec: str | Path, *, synchronous_full: bool = False) -> Any:
    """The interaction store ``spec`` names: a ``postgresql://`` (or ``postgres://``) URL, else an SQLite file path."""
    if is_postgres_url(spec):
        from learner.store_pg import PostgresStore  # psycopg is imported only for a PostgreSQL store

        return PostgresStore(spec, synchronous_full=synchronous_full)
    return SqliteStore(Path(spec), synchronous_full=synchronous_full)


class SchemaTooNew(RuntimeError):
    """The database was written by a newer loopwise (its schema version is past this code's)."""


# ---------------------------------------------------------------------------------------------------
# packed arrays (little-endian on disk, whatever the host)

_SWAP = sys.byteorder != "little"


def _pack(typecode: str, values: Sequence[int] | Sequence[float]) -> bytes:
    a = array(typecode, values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _unpack(typecode: str, blob: bytes | None) -> list:
    a = array(typecode)
    if blob:
        a.frombytes(blob)
        if _SWAP:
            a.byteswap()
    return a.tolist()


_json: Callable[[Any], str] = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # reused: no per-call setup


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
    # Turns get an (adapter, created_at) index for the A/B experiments' per-arm statistics. Version 3 also
    # created the experiments table itself; it now belongs to runtime/experiments_store.py, which creates it
    # when it is missing (a file migrated before then has it already, with the same columns).
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
    # The adapter registry's shared state (runtime/registry_sync.py): the adapter versions every runtime on this
    # store loads, and the family aliases, so several runtimes agree on what a family name serves.
    conn.execute(
        """CREATE TABLE registry (kind TEXT NOT NULL CHECK (kind IN ('adapter', 'alias')), name TEXT NOT NULL,
                                  value TEXT NOT NULL, updated_at REAL NOT NULL, PRIMARY KEY (kind, name))"""
    )


def _v7_turn_checks(conn: sqlite3.Connection) -> None:
    # A self-verifying agent's turn carries its parsed self-check and the verifier's judgment of its answer
    # (``TurnCheck`` as JSON; NULL for every other turn and for rows written before version 7).
    conn.execute("ALTER TABLE turns ADD COLUMN self_check TEXT")


# MIGRATIONS[i] takes a database from version i to version i + 1 (version 0 = an empty file).
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [
    _v1_initial,
    _v2_unique_idempotency_key,
    _v3_experiments,
    _v4_trajectory_meta,
    _v5_owners,
    _v6_registry,
    _v7_turn_checks,
]
SCHEMA_VERSION = len(MIGRATIONS)


def user_version(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA user_version").fetchone()[0]


def migrate(conn: sqlite3.Connection, migrations: Sequence[Callable[[sqlite3.Connection], None]] = MIGRATIONS) -> int:
    """Apply the missing ``migrations`` in order, one transaction each; returns the final version.

    ``conn`` must be in autocommit mode (``isolation_level=None``).
    """
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = user_version(conn)  # re-read under the write lock: another process may have migrated
            if version > len(migrations):
                raise SchemaTooNew(f"database schema version {version} is newer than this code's {len(migrations)}")
            if version == len(migrations):
                conn.execute("COMMIT")
                return version
            migrations[version](conn)
            conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


# ---------------------------------------------------------------------------------------------------
# rows ↔ records

TURN_COLUMNS = (
    "turn_id, trajectory_id, session_id, idx, parent_turn_id, completion_id, choice_index, created_at, model, adapter, "
    "context_ids, output_ids, logprobs, loss_mask, sampling, tool_calls, finish_reason, timings, messages, output_text, "
    "continuation_key, prefix_key, owner, self_check"
)
N_TURN_COLUMNS = 24
_INSERT_TURN = f"INSERT OR IGNORE INTO turns ({TURN_COLUMNS}) VALUES ({', '.join('?' * N_TURN_COLUMNS)})"
REWARD_COLUMNS = "reward_id, target, target_id, value, source, created_at, comment, idempotency_key, owner"


def turn_row(t: Turn) -> tuple:
    """A turn as the 24 values of ``TURN_COLUMNS``."""
    return (
        t.turn_id,
        t.trajectory_id,
        t.session_id,
        t.index,
        t.parent_turn_id,
        t.completion_id,
        t.choice_index,
        t.created_at,
        t.model,
        t.adapter,
        _pack("i", t.context_ids),
        _pack("i", t.output_ids),
        _pack("f", t.logprobs),
        _pack("b", t.loss_mask),
        _json(t.sampling),
        _json([tc.model_dump() for tc in t.tool_calls]),
        t.finish_reason,
        _json(t.timings.model_dump()),
        _json(t.messages),
        t.output_text,
        t.continuation_key,
        t.prefix_key,
        t.owner,
        None if t.self_check is None else _json(t.self_check.model_dump()),
    )


def _turn_from_row(r: tuple) -> Turn:
    return Turn(
        turn_id=r[0],
        trajectory_id=r[1],
        session_id=r[2],
        index=r[3],
        parent_turn_id=r[4],
        completion_id=r[5],
        choice_index=r[6],
        created_at=r[7],
        model=r[8],
        adapter=r[9],
        context_ids=_unpack("i", r[10]),
        output_ids=_unpack("i", r[11]),
        logprobs=_unpack("f", r[12]),
        loss_mask=_unpack("b", r[13]),
        sampling=json.loads(r[14]),
        tool_calls=[ToolCallRecord(**tc) for tc in json.loads(r[15])],
        finish_reason=r[16],
        timings=TurnTimings(**json.loads(r[17])),
        messages=json.loads(r[18]),
        output_text=r[19],
        continuation_key=r[20],
        prefix_key=r[21],
        owner=r[22],
        self_check=None if r[23] is None else TurnCheck(**json.loads(r[23])),
    )


def _reward_from_row(r: tuple) -> Reward:
    return Reward(
        reward_id=r[0], target=r[1], target_id=r[2], value=r[3], source=r[4], created_at=r[5], comment=r[6], idempotency_key=r[7], owner=r[8]
    )


# rewards on a trajectory or on any of its turns (parameters: trajectory_id, trajectory_id)
_REWARDS_OF_TRAJECTORY = f"""
    SELECT {REWARD_COLUMNS} FROM rewards WHERE target = 'trajectory' AND target_id = ?
    UNION ALL
    SELECT {", ".join("r." + c.strip() for c in REWARD_COLUMNS.split(","))}
      FROM rewards r JOIN turns u ON u.turn_id = r.target_id
     WHERE r.target = 'turn' AND u.trajectory_id = ?
    ORDER BY created_at, reward_id"""

# trajectory ids with a reward on the trajectory or on one of its turns
_REWARDED_TRAJECTORIES = """
    SELECT target_id FROM rewards WHERE target = 'trajectory'
    UNION
    SELECT u.trajectory_id FROM rewards r JOIN turns u ON u.turn_id = r.target_id WHERE r.target = 'turn'"""


def trajectory_list_query(
    ph: str, order: str, limit: int, since: float | None, rewarded: bool | None, owner: str | None
) -> tuple[str, tuple[Any, ...]]:
    """``list_trajectories``' SQL and parameters for one backend: ``ph`` its placeholder (``?``, ``%s``), ``order`` its
    insertion-order column (``rowid``, ``seq``). Rows come back in :func:`trajectory_summary`'s column order."""
    where: list[str] = []
    params: list[Any] = []
    if owner is not None:
        where.append(f"t.owner = {ph}")
        params.append(owner)
    if since is not None:
        where.append(f"t.created_at >= {ph}")
        params.append(since)
    if rewarded is not None:
        where.append(f"t.trajectory_id {'IN' if rewarded else 'NOT IN'} ({_REWARDED_TRAJECTORIES})")
    sql = f"""
        SELECT t.trajectory_id, t.session_id, t.created_at, t.meta, t.owner,
               (SELECT COUNT(*) FROM turns u WHERE u.trajectory_id = t.trajectory_id),
               (SELECT COUNT(*) FROM rewards r WHERE r.target = 'trajectory' AND r.target_id = t.trajectory_id)
             + (SELECT COUNT(*) FROM rewards r JOIN turns u ON u.turn_id = r.target_id
                 WHERE r.target = 'turn' AND u.trajectory_id = t.trajectory_id),
               (SELECT MAX(u.created_at) FROM turns u WHERE u.trajectory_id = t.trajectory_id)
          FROM trajectories t
         {"WHERE " + " AND ".join(where) if where else ""}
         ORDER BY t.created_at DESC, t.{order} DESC
         LIMIT {ph}"""
    return sql, (*params, limit)


def trajectory_summary(r: Sequence[Any]) -> dict[str, Any]:
    """One row of :func:`trajectory_list_query` as ``list_trajectories`` answers it."""
    return {
        "trajectory_id": r[0],
        "session_id": r[1],
        "created_at": r[2],
        "meta": json.loads(r[3]),
        "owner": r[4],
        "turns": int(r[5]),
        "rewards": int(r[6]),
        "last_turn_at": r[7],
    }


class SqliteStore:
    """The interaction store on one SQLite file. See the module docstring."""

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
            self.schema_version = migrate(conn)
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
    def _write(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    placeholder = "?"
    dialect = "sqlite"

    @contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[sqlite3.Connection]:
        """This thread's connection in one transaction (``write``: ``BEGIN IMMEDIATE``), for tables other modules own
        in this file (``runtime/experiments_store.py``)."""
        if write:
            with self._write() as conn:
                yield conn
            return
        conn = self._conn()
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    def close(self) -> None:
        self._closed = True
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()
        self._local = threading.local()

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writes --------------------------------------------------------------------------------------

    def append_turns(self, turns: Sequence[Turn]) -> None:
        """Store a batch of turns (and their sessions/trajectories) in one transaction."""
        if not turns:
            return
        sessions: dict[tuple[str, str], float] = {}
        trajectories: dict[str, tuple[str, str, float]] = {}
        for t in turns:
            if t.created_at < sessions.get((t.owner, t.session_id), float("inf")):
                sessions[(t.owner, t.session_id)] = t.created_at
            if t.trajectory_id not in trajectories or t.created_at < trajectories[t.trajectory_id][2]:
                trajectories[t.trajectory_id] = (t.owner, t.session_id, t.created_at)
        with self._write() as conn:
            conn.executemany(
                "INSERT OR IGNORE INTO sessions (owner, session_id, created_at) VALUES (?, ?, ?)", ((o, s, ts) for (o, s), ts in sessions.items())
            )
            conn.executemany(
                "INSERT OR IGNORE INTO trajectories (trajectory_id, owner, session_id, created_at) VALUES (?, ?, ?, ?)",
                ((tid, o, sid, ts) for tid, (o, sid, ts) in trajectories.items()),
            )
            # encoded lazily inside the transaction: a turn that cannot be encoded rolls back the batch
            conn.executemany(_INSERT_TURN, (self._turn_row(t) for t in turns))

    def add_reward(self, reward: Reward) -> tuple[Reward, bool]:
        """Store ``reward``; returns (the stored reward, created).

        The target must exist and belong to ``reward.owner`` (else :class:`UnknownTarget`: another owner's
        turn is indistinguishable from a missing one). A repeated idempotency key of the same owner returns
        the first reward stored under it; idempotency keys of different owners never meet."""
        with self._write() as conn:
            if reward.idempotency_key is not None:
                row = conn.execute(
                    f"SELECT {REWARD_COLUMNS} FROM rewards WHERE owner = ? AND idempotency_key = ?", (reward.owner, reward.idempotency_key)
                ).fetchone()
                if row is not None:
                    return _reward_from_row(row), False
            table, column = ("turns", "turn_id") if reward.target == "turn" else ("trajectories", "trajectory_id")
            found = conn.execute(f"SELECT owner FROM {table} WHERE {column} = ?", (reward.target_id,)).fetchone()
            if found is None or found[0] != reward.owner:
                raise UnknownTarget(f"no {reward.target} with id {reward.target_id!r}")
            conn.execute(
                f"INSERT INTO rewards ({REWARD_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    reward.reward_id,
                    reward.target,
                    reward.target_id,
                    reward.value,
                    reward.source,
                    reward.created_at,
                    reward.comment,
                    reward.idempotency_key,
                    reward.owner,
                ),
            )
        return reward, True

    def set_trajectory_meta(self, trajectory_id: str, meta: dict[str, Any]) -> None:
        """Merge ``meta`` into the trajectory's metadata (top-level keys replace); the trajectory must exist."""
        with self._write() as conn:
            row = conn.execute("SELECT meta FROM trajectories WHERE trajectory_id = ?", (trajectory_id,)).fetchone()
            if row is None:
                raise UnknownTarget(f"no trajectory with id {trajectory_id!r}")
            merged = {**json.loads(row[0]), **meta}
            conn.execute("UPDATE trajectories SET meta = ? WHERE trajectory_id = ?", (_json(merged), trajectory_id))

    def delete_session(self, owner: str, session_id: str) -> int:
        """Delete one owner's session with its trajectories, turns and their rewards; returns the number of turns deleted.

        Another owner's session of the same name is untouched."""
        with self._write() as conn:
            conn.execute(
                """DELETE FROM rewards WHERE
                     (target = 'turn' AND target_id IN (SELECT turn_id FROM turns WHERE owner = ? AND session_id = ?))
                  OR (target = 'trajectory' AND target_id IN (SELECT trajectory_id FROM trajectories WHERE owner = ? AND session_id = ?))""",
                (owner, session_id, owner, session_id),
            )
            n = conn.execute("DELETE FROM turns WHERE owner = ? AND session_id = ?", (owner, session_id)).rowcount
            conn.execute("DELETE FROM trajectories WHERE owner = ? AND session_id = ?", (owner, session_id))
            conn.execute("DELETE FROM sessions WHERE owner = ? AND session_id = ?", (owner, session_id))
        self._checkpoint_truncate()
        return n

    def delete_trajectories(self, trajectory_ids: Sequence[str]) -> int:
        """Delete trajectories with their turns and the rewards on them (e.g. the ones that read a deleted memory);
        returns the number of turns deleted. Securely, like :meth:`delete_session`."""
        ids = list(dict.fromkeys(trajectory_ids))
        if not ids:
            return 0
        n = 0
        with self._write() as conn:
            for k in range(0, len(ids), 500):
                chunk = ids[k : k + 500]
                marks = ", ".join("?" * len(chunk))
                conn.execute(
                    f"""DELETE FROM rewards WHERE
                          (target = 'turn' AND target_id IN (SELECT turn_id FROM turns WHERE trajectory_id IN ({marks})))
                       OR (target = 'trajectory' AND target_id IN ({marks}))""",
                    (*chunk, *chunk),
                )
                n += conn.execute(f"DELETE FROM turns WHERE trajectory_id IN ({marks})", chunk).rowcount
                conn.execute(f"DELETE FROM trajectories WHERE trajectory_id IN ({marks})", chunk)
        self._checkpoint_truncate()
        return n

    def trajectories_with_meta(self, owner: str, key: str, value: str) -> list[str]:
        """Ids of ``owner``'s trajectories whose meta ``key`` is the string ``value`` (e.g. the runs that held a memory),
        oldest first. A JSON number or boolean never equals a string."""
        rows = (
            self._conn()
            .execute(
                "SELECT trajectory_id FROM trajectories WHERE owner = ? AND json_extract(meta, '$.' || ?) = ? ORDER BY rowid", (owner, key, value)
            )
            .fetchall()
        )
        return [r[0] for r in rows]

    def record_owner(self, target: str, target_id: str) -> str | None:
        """The owner of a turn (``target="turn"``) or trajectory, or None when it is not stored."""
        table, column = ("turns", "turn_id") if target == "turn" else ("trajectories", "trajectory_id")
        row = self._conn().execute(f"SELECT owner FROM {table} WHERE {column} = ?", (target_id,)).fetchone()
        return None if row is None else row[0]

    def session_owners(self, session_id: str) -> list[str]:
        """The owners that have a session named ``session_id`` (the admin API names one when several do)."""
        rows = self._conn().execute("SELECT owner FROM sessions WHERE session_id = ? ORDER BY owner", (session_id,)).fetchall()
        return [r[0] for r in rows]

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

    def prune(self, older_than: float) -> int:
        """Delete unrewarded turns created before ``older_than`` (Unix time), then what became empty; returns turns deleted."""
        with self._write() as conn:
            n = conn.execute(
                """DELETE FROM turns
                   WHERE created_at < ?
                     AND turn_id NOT IN (SELECT target_id FROM rewards WHERE target = 'turn')
                     AND trajectory_id NOT IN (SELECT target_id FROM rewards WHERE target = 'trajectory')""",
                (older_than,),
            ).rowcount
            conn.execute(
                """DELETE FROM trajectories
                   WHERE created_at < ?
                     AND NOT EXISTS (SELECT 1 FROM turns u WHERE u.trajectory_id = trajectories.trajectory_id)
                     AND trajectory_id NOT IN (SELECT target_id FROM rewards WHERE target = 'trajectory')""",
                (older_than,),
            )
            conn.execute(
                """DELETE FROM sessions
                   WHERE created_at < ?
                     AND NOT EXISTS (SELECT 1 FROM trajectories t WHERE t.owner = sessions.owner AND t.session_id = sessions.session_id)""",
                (older_than,),
            )
        return n

    # -- reads ---------------------------------------------------------------------------------------

    def turns_for_completion(self, completion_id: str, owner: str | None = None, choice_index: int | None = None) -> list[str]:
        """The turn ids of a completion's choices (only ``owner``'s, when given; only choice ``choice_index``'s, when given)."""
        rows = self._conn().execute(
            "SELECT turn_id FROM turns WHERE completion_id = ? AND (? IS NULL OR owner = ?) AND (? IS NULL OR choice_index = ?)"
            " ORDER BY choice_index, rowid",
            (completion_id, owner, owner, choice_index, choice_index),
        )
        return [r[0] for r in rows]

    def find_continuation(self, session_id: str, continuation_key: str, owner: str = "public") -> TurnRef | None:
        """The newest turn of ``owner``'s session ``session_id`` whose continuation key matches, or None."""
        row = (
            self._conn()
            .execute(
                """SELECT turn_id, trajectory_id, session_id, idx,
                          EXISTS (SELECT 1 FROM turns c WHERE c.parent_turn_id = t.turn_id AND c.trajectory_id = t.trajectory_id)
                     FROM turns t
                    WHERE owner = ? AND session_id = ? AND continuation_key = ?
                    ORDER BY created_at DESC, rowid DESC LIMIT 1""",
                (owner, session_id, continuation_key),
            )
            .fetchone()
        )
        if row is None:
            return None
        return TurnRef(turn_id=row[0], trajectory_id=row[1], session_id=row[2], index=row[3], has_successor=bool(row[4]))

    def turn_exists(self, turn_id: str, owner: str | None = None) -> bool:
        """Whether the turn is stored (and, when ``owner`` is given, belongs to it)."""
        sql = "SELECT 1 FROM turns WHERE turn_id = ? AND (? IS NULL OR owner = ?)"
        return self._conn().execute(sql, (turn_id, owner, owner)).fetchone() is not None

    def trajectory_exists(self, trajectory_id: str, owner: str | None = None) -> bool:
        """Whether the trajectory is stored (and, when ``owner`` is given, belongs to it)."""
        sql = "SELECT 1 FROM trajectories WHERE trajectory_id = ? AND (? IS NULL OR owner = ?)"
        return self._conn().execute(sql, (trajectory_id, owner, owner)).fetchone() is not None

    def stats(self) -> dict[str, int]:
        conn = self._conn()
        conn.execute("BEGIN")  # one snapshot for all four counts
        try:
            return {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("sessions", "trajectories", "turns", "rewards")}
        finally:
            conn.execute("COMMIT")

    def list_trajectories(self, limit: int = 50, since: float | None = None, rewarded: bool | None = None, owner: str | None = None) -> list[dict]:
        """Newest first (by creation); ``since`` keeps trajectories created at or after it (Unix time), ``owner`` one owner's."""
        sql, params = trajectory_list_query("?", "rowid", limit, since, rewarded, owner)
        return [trajectory_summary(r) for r in self._conn().execute(sql, params).fetchall()]

    def get_turn(self, turn_id: str) -> Turn | None:
        row = self._conn().execute(f"SELECT {TURN_COLUMNS} FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
        return None if row is None else _turn_from_row(row)

    def get_trajectory(self, trajectory_id: str) -> Trajectory | None:
        """The trajectory with its turns (by index) and every reward on it or on its turns."""
        conn = self._conn()
        conn.execute("BEGIN")  # one consistent snapshot
        try:
            row = conn.execute(
                "SELECT trajectory_id, session_id, created_at, meta, owner FROM trajectories WHERE trajectory_id = ?", (trajectory_id,)
            ).fetchone()
            if row is None:
                return None
            turns = conn.execute(
                f"SELECT {TURN_COLUMNS} FROM turns WHERE trajectory_id = ? ORDER BY idx, created_at, rowid", (trajectory_id,)
            ).fetchall()
            rewards = conn.execute(_REWARDS_OF_TRAJECTORY, (trajectory_id, trajectory_id)).fetchall()
        finally:
            conn.execute("COMMIT")
        return Trajectory(
            trajectory_id=row[0],
            session_id=row[1],
            created_at=row[2],
            meta=json.loads(row[3]),
            owner=row[4],
            turns=[_turn_from_row(r) for r in turns],
            rewards=[_reward_from_row(r) for r in rewards],
        )

    def iter_samples(self, since: float | None = None, rewarded: bool | None = None, page_size: int = 256) -> Iterator[dict]:
        """Per-turn training samples in insertion order (see ``learner/__main__.py`` for the fields).

        ``since``: turns created at or after it (Unix time). ``rewarded``: True → only turns with a reward
        on them or on their trajectory; False → only turns with neither. Reads page by page (short
        read transactions), so a long export never pins an old snapshot.
        """
        where, params = ["t.rowid > ?"], []
        if since is not None:
            where.append("t.created_at >= ?")
            params.append(since)
        if rewarded is not None:
            cond = (
                "(t.turn_id IN (SELECT target_id FROM rewards WHERE target = 'turn')"
                " OR t.trajectory_id IN (SELECT target_id FROM rewards WHERE target = 'trajectory'))"
            )
            where.append(cond if rewarded else f"NOT {cond}")
        sql = f"""SELECT t.rowid, t.turn_id, t.trajectory_id, t.session_id, t.idx, t.context_ids, t.output_ids, t.logprobs,
                         t.loss_mask, t.adapter, t.finish_reason, t.created_at,
                         (SELECT j.meta FROM trajectories j WHERE j.trajectory_id = t.trajectory_id), t.owner
                    FROM turns t WHERE {" AND ".join(where)} ORDER BY t.rowid LIMIT ?"""
        last = 0
        while True:
            rows = self._conn().execute(sql, (last, *params, page_size)).fetchall()
            if not rows:
                return
            for r in rows:
                last = r[0]
                rewards = [
                    _reward_from_row(x)
                    for x in self._conn().execute(  # per call: the generator may be resumed on another thread
                        f"""SELECT {REWARD_COLUMNS} FROM rewards
                             WHERE (target = 'turn' AND target_id = ?) OR (target = 'trajectory' AND target_id = ?)
                             ORDER BY created_at, rowid""",
                        (r[1], r[2]),
                    )
                ]
                turn_values = [x.value for x in rewards if x.target == "turn"]
                traj_values = [x.value for x in rewards if x.target == "trajectory"]
                meta = json.loads(r[12] or "{}")
                yield {
                    "turn_id": r[1],
                    "trajectory_id": r[2],
                    "session_id": r[3],
                    "owner": r[13],
                    "index": r[4],
                    "context_ids": _unpack("i", r[5]),
                    "output_ids": _unpack("i", r[6]),
                    "logprobs": _unpack("f", r[7]),
                    "loss_mask": _unpack("b", r[8]),
                    "adapter": r[9],
                    "finish_reason": r[10],
                    "created_at": r[11],
                    "reward": turn_values[-1] if turn_values else None,
                    "trajectory_reward": traj_values[-1] if traj_values else None,
                    "rewards": [x.model_dump() for x in rewards],
                    "trainable": bool(meta.get("trainable", True)),
                    "task_key": meta.get("task_key"),
                }
            if len(rows) < page_size:
                return

    # ---- the A/B experiments' per-arm data (their config and state: runtime/experiments_store.py) ----
    def arm_observations(self, adapter: str, since: float, source: str | None = None, *, trusted_only: bool = True) -> dict[str, list[float]]:
        """For one adapter version since ``since``: the rewards on its turns and on the trajectories it served (a
        verifier's outcome reward is on the trajectory), of one ``source``, or with ``source=None`` of the trusted
        sources (the runtime's own ``verifier:*`` and ``judge:*``; every source with ``trusted_only=False``), in
        the order they came (ties: in the order they were stored); and per turn, oldest first, its total latency
        and output tokens/s."""
        conn = self._conn()
        if source is not None:
            where_source, source_args = " AND r.source = ?", [source]
        elif trusted_only:
            where_source, source_args = " AND (r.source LIKE 'verifier:%' OR r.source LIKE 'judge:%')", []
        else:
            where_source, source_args = "", []
        query = f"""SELECT r.value, r.created_at, r.rowid FROM rewards r JOIN turns t ON r.target = 'turn' AND r.target_id = t.turn_id
                    WHERE t.adapter IS ? AND t.created_at >= ?{where_source}
                    UNION ALL
                    SELECT r.value, r.created_at, r.rowid FROM rewards r
                    WHERE r.target = 'trajectory' AND r.target_id IN
                          (SELECT DISTINCT trajectory_id FROM turns WHERE adapter IS ? AND created_at >= ?){where_source}
                    ORDER BY 2, 3"""
        one: list[Any] = [adapter, since, *source_args]
        rewards = [row[0] for row in conn.execute(query, one + one)]
        latency, tps = [], []
        for n_bytes, timings in conn.execute(
            "SELECT length(output_ids), timings FROM turns WHERE adapter IS ? AND created_at >= ? ORDER BY created_at, rowid", (adapter, since)
        ):
            total = json.loads(timings).get("total_s") or 0.0
            latency.append(total)
            if total > 0:
                tps.append((n_bytes // 4) / total)
        return {"rewards": rewards, "latency_s": latency, "tokens_per_s": tps}

    # ---- the adapter registry's shared state ---------------------------------------------------
    def save_registry(self, kind: str, name: str, value: dict[str, Any] | None) -> None:
        """Set (or with ``value=None`` remove) one registry entry: ``kind`` ``adapter`` (``family@N`` → its path and
        hash) or ``alias`` (family → ``{"target": "family@N"}``)."""
        with self._write() as conn:
            if value is None:
                conn.execute("DELETE FROM registry WHERE kind = ? AND name = ?", (kind, name))
            else:
                conn.execute(
                    """INSERT INTO registry (kind, name, value, updated_at) VALUES (?, ?, ?, ?)
                       ON CONFLICT(kind, name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at""",
                    (kind, name, _json(value), time.time()),
                )

    def load_registry(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Every registry entry: ``{"adapter": {name: value}, "alias": {family: value}}``."""
        out: dict[str, dict[str, dict[str, Any]]] = {"adapter": {}, "alias": {}}
        for kind, name, value in self._conn().execute("SELECT kind, name, value FROM registry ORDER BY updated_at, name"):
            out[kind][name] = json.loads(value)
        return out

    def integrity_check(self) -> str:
        rows = self._conn().execute("PRAGMA integrity_check").fetchall()
        return "\n".join(str(r[0]) for r in rows)
