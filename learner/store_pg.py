"""The interaction store on PostgreSQL (``--store postgresql://...``): the SQLite store's interface, shared by many processes.

What it does:
- ``PostgresStore(url)`` opens a psycopg 3 connection pool (``psycopg_pool.ConnectionPool``, ``max_size``
  connections, opened at once: a wrong URL or a down server fails here with the server's message, the
  password never printed) and migrates the schema. Every method borrows one pooled connection for one
  transaction, so the recorder's writer thread, the reader pool and a learner in another process run
  side by side; several runtime processes may append to one database at once.
- Same tables, columns, semantics and public methods as ``learner.store.SqliteStore`` (sessions keyed by
  owner + name, append-only turns whose re-insert is a no-op, rewards only on the owner's own records,
  idempotency keys unique per owner, the adapter registry's shared state). Token arrays are
  the same packed little-endian bytes in ``BYTEA`` columns (``bench/store_ingest.py --postgres`` measures
  them against native ``int4[]``/``real[]``/``smallint[]`` arrays); insertion order is a ``BIGSERIAL`` ``seq``
  (SQLite's rowid). A batch of turns is one transaction, sent in pipeline mode (one round trip).
- Durability: every commit is ``synchronous_commit = on`` (the server's WAL is flushed before the commit
  returns), so a committed batch survives the crash of any loopwise process and of the database server;
  ``--durability sync`` (the recorder answers after the commit) therefore loses no answered turn when a
  runtime is killed. Power-loss durability is the server's ``fsync`` setting, not this code's.
- Migrations: the version is the one row of ``loopwise_schema``; opening the store takes a transaction-scoped
  advisory lock, re-reads the version and applies what is missing, each migration in the same transaction
  as its version bump (PostgreSQL's DDL is transactional), so concurrent openers never migrate twice and a
  failing migration leaves the previous version. An empty database gets the version-5 layout in one step
  (PostgreSQL support began at version 5), then the later migrations, the same as SQLite's.

What it doesn't do: SQLite's page-level secure deletion. Deleted rows are gone from every table at once, but
their bytes stay in dead tuples until (auto)vacuum reuses the space, and in the server's WAL and backups:
secure erasure on PostgreSQL is the database operator's retention policy. Memory documents
(``memory/store.py``) stay in the data folder's SQLite file.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.abc import Buffer
from psycopg.types.string import StrDumperUnknown
from psycopg_pool import ConnectionPool, PoolTimeout

from learner.records import Reward, Trajectory, Turn, TurnRef, UnknownTarget
from learner.store import (
    N_TURN_COLUMNS,
    REWARD_COLUMNS,
    TURN_COLUMNS,
    SchemaTooNew,
    _json,
    _reward_from_row,
    _turn_from_row,
    _unpack,
    is_postgres_url,
    trajectory_list_query,
    trajectory_summary,
    turn_row,
)

log = logging.getLogger(__name__)

__all__ = ["PG_MIGRATIONS", "PostgresStore", "is_postgres_url", "redact_url"]

_MIGRATION_LOCK = 0x6C6F6F70  # "loop": the advisory lock key serializing migrations across processes


def redact_url(url: str) -> str:
    """``url`` without its password (for logs and errors)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


# ---------------------------------------------------------------------------------------------------
# schema: PG_MIGRATIONS[v] takes a database from version v to v + 1; version 0 (empty) jumps to 5 at once


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


PG_MIGRATIONS: dict[int, Callable[[psycopg.Connection], None]] = {0: _initial_v5, 5: _v6_registry, 6: _v7_turn_checks}
PG_SCHEMA_VERSION = 7


def _next_version(version: int) -> int:
    return 5 if version == 0 else version + 1


def migrate_pg(conn: psycopg.Connection, target: int = PG_SCHEMA_VERSION) -> int:
    """Bring the database (``conn`` in autocommit mode) to ``target``, one transaction per migration; the final version."""
    while True:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS loopwise_schema (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM loopwise_schema").fetchone()
            version = 0 if row is None else row[0]
            if version > PG_SCHEMA_VERSION:
                raise SchemaTooNew(f"database schema version {version} is newer than this code's {PG_SCHEMA_VERSION}")
            if version >= target:
                return version
            PG_MIGRATIONS[version](conn)
            if row is None:
                conn.execute("INSERT INTO loopwise_schema (version) VALUES (%s)", (_next_version(version),))
            else:
                conn.execute("UPDATE loopwise_schema SET version = %s", (_next_version(version),))


# ---------------------------------------------------------------------------------------------------


class _NulSafeStr(StrDumperUnknown):
    """PostgreSQL text cannot hold U+0000 (SQLite can): one NUL in a model's output or a client's id would fail the
    whole batch of turns it was written with, other owners' turns included. Every string parameter is sent with
    each NUL replaced by U+FFFD; the exact token ids (``output_ids``) are bytes and unaffected."""

    def dump(self, obj: str) -> Buffer | None:
        return super().dump(obj.replace("\x00", "\ufffd"))


_INSERT_TURN = f"INSERT INTO turns ({TURN_COLUMNS}) VALUES ({', '.join(['%s'] * N_TURN_COLUMNS)}) ON CONFLICT (turn_id) DO NOTHING"
_REWARD_COLS_R = ", ".join("r." + c.strip() for c in REWARD_COLUMNS.split(","))
_REWARDS_OF_TRAJECTORY = f"""
    SELECT {REWARD_COLUMNS}, seq FROM rewards WHERE target = 'trajectory' AND target_id = %(t)s
    UNION ALL
    SELECT {_REWARD_COLS_R}, r.seq FROM rewards r JOIN turns u ON u.turn_id = r.target_id
     WHERE r.target = 'turn' AND u.trajectory_id = %(t)s
    ORDER BY created_at, reward_id"""


class PostgresStore:
    """The interaction store on PostgreSQL. See the module docstring."""

    shared = True  # other processes write to the same store: continuation lookups must ask it, not a local index
    _turn_row = staticmethod(turn_row)

    def __init__(self, url: str, *, synchronous_full: bool = False, max_size: int = 8, timeout_s: float = 10.0) -> None:
        if not is_postgres_url(url):
            raise ValueError("a PostgreSQL store URL starts with postgresql:// or postgres://")
        self.url = url
        self.display_url = redact_url(url)
        self.synchronous_full = synchronous_full  # kept for the interface: commits are always synchronous here
        self._pool = ConnectionPool(
            url, min_size=1, max_size=max_size, timeout=timeout_s, open=False, name="loopwise-store", configure=self._configure
        )
        try:
            self._pool.open(wait=True, timeout=timeout_s)
        except PoolTimeout:
            error = self._why_not(url, timeout_s)
            self._pool.close()
            raise ConnectionError(f"cannot reach the PostgreSQL store {self.display_url}: {error}") from None
        try:
            with self._pool.connection() as conn:
                conn.autocommit = True
                try:
                    self.schema_version = migrate_pg(conn)
                finally:
                    conn.autocommit = False
        except BaseException:
            self._pool.close()
            raise

    @staticmethod
    def _configure(conn: psycopg.Connection) -> None:
        conn.adapters.register_dumper(str, _NulSafeStr)
        conn.execute("SET synchronous_commit = on")
        conn.execute("SET application_name = 'loopwise'")
        conn.commit()

    @staticmethod
    def _why_not(url: str, timeout_s: float) -> str:
        try:
            psycopg.connect(url, connect_timeout=max(1, int(timeout_s))).close()
        except psycopg.Error as exc:
            return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return "the connection pool timed out"

    @contextmanager
    def _tx(self, snapshot: bool = False) -> Iterator[psycopg.Connection]:
        """One pooled connection for one transaction (committed on success, rolled back on error)."""
        with self._pool.connection() as conn:
            if snapshot:
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            yield conn

    placeholder = "%s"
    dialect = "postgresql"

    @contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[psycopg.Connection]:
        """One pooled connection in one transaction, for tables other modules own in this database
        (``runtime/experiments_store.py``); ``write`` is accepted for the SQLite store's interface."""
        with self._tx() as conn:
            yield conn

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> PostgresStore:
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
        rows = [self._turn_row(t) for t in turns]  # an unencodable turn fails the batch before anything is sent
        with self._tx() as conn, conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO sessions (owner, session_id, created_at) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                [(o, s, ts) for (o, s), ts in sessions.items()],
            )
            cur.executemany(
                "INSERT INTO trajectories (trajectory_id, owner, session_id, created_at) VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                [(tid, o, sid, ts) for tid, (o, sid, ts) in trajectories.items()],
            )
            cur.executemany(_INSERT_TURN, rows)

    def add_reward(self, reward: Reward) -> tuple[Reward, bool]:
        """Store ``reward``; returns (the stored reward, created). See ``SqliteStore.add_reward``.

        Two processes racing on one idempotency key: the unique index lets one insert win, the other returns it."""
        with self._tx() as conn:
            if reward.idempotency_key is not None:
                row = conn.execute(
                    f"SELECT {REWARD_COLUMNS} FROM rewards WHERE owner = %s AND idempotency_key = %s", (reward.owner, reward.idempotency_key)
                ).fetchone()
                if row is not None:
                    return _reward_from_row(row), False
            table, column = ("turns", "turn_id") if reward.target == "turn" else ("trajectories", "trajectory_id")
            found = conn.execute(f"SELECT owner FROM {table} WHERE {column} = %s", (reward.target_id,)).fetchone()
            if found is None or found[0] != reward.owner:
                raise UnknownTarget(f"no {reward.target} with id {reward.target_id!r}")
            inserted = conn.execute(
                f"""INSERT INTO rewards ({REWARD_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)
                    ON CONFLICT (owner, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING reward_id""",
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
            ).fetchone()
            if inserted is None:  # another process stored this key between our check and our insert
                row = conn.execute(
                    f"SELECT {REWARD_COLUMNS} FROM rewards WHERE owner = %s AND idempotency_key = %s", (reward.owner, reward.idempotency_key)
                ).fetchone()
                return _reward_from_row(row), False
        return reward, True

    def set_trajectory_meta(self, trajectory_id: str, meta: dict[str, Any]) -> None:
        """Merge ``meta`` into the trajectory's metadata (top-level keys replace); the trajectory must exist."""
        with self._tx() as conn:
            row = conn.execute("SELECT meta FROM trajectories WHERE trajectory_id = %s FOR UPDATE", (trajectory_id,)).fetchone()
            if row is None:
                raise UnknownTarget(f"no trajectory with id {trajectory_id!r}")
            merged = {**json.loads(row[0]), **meta}
            conn.execute("UPDATE trajectories SET meta = %s WHERE trajectory_id = %s", (_json(merged), trajectory_id))

    def delete_session(self, owner: str, session_id: str) -> int:
        """Delete one owner's session with its trajectories, turns and their rewards; returns the number of turns deleted."""
        with self._tx() as conn:
            conn.execute(
                """DELETE FROM rewards WHERE
                     (target = 'turn' AND target_id IN (SELECT turn_id FROM turns WHERE owner = %(o)s AND session_id = %(s)s))
                  OR (target = 'trajectory' AND target_id IN (SELECT trajectory_id FROM trajectories WHERE owner = %(o)s AND session_id = %(s)s))""",
                {"o": owner, "s": session_id},
            )
            n = conn.execute("DELETE FROM turns WHERE owner = %s AND session_id = %s", (owner, session_id)).rowcount
            conn.execute("DELETE FROM trajectories WHERE owner = %s AND session_id = %s", (owner, session_id))
            conn.execute("DELETE FROM sessions WHERE owner = %s AND session_id = %s", (owner, session_id))
        return n

    def delete_trajectories(self, trajectory_ids: Sequence[str]) -> int:
        """Delete trajectories with their turns and the rewards on them; returns the number of turns deleted."""
        ids = list(dict.fromkeys(trajectory_ids))
        if not ids:
            return 0
        with self._tx() as conn:
            conn.execute(
                """DELETE FROM rewards WHERE
                     (target = 'turn' AND target_id IN (SELECT turn_id FROM turns WHERE trajectory_id = ANY(%(ids)s)))
                  OR (target = 'trajectory' AND target_id = ANY(%(ids)s))""",
                {"ids": ids},
            )
            n = conn.execute("DELETE FROM turns WHERE trajectory_id = ANY(%s)", (ids,)).rowcount
            conn.execute("DELETE FROM trajectories WHERE trajectory_id = ANY(%s)", (ids,))
        return n

    def trajectories_with_meta(self, owner: str, key: str, value: str) -> list[str]:
        """Ids of ``owner``'s trajectories whose meta ``key`` equals ``value``."""
        with self._tx() as conn:
            rows = conn.execute(
                "SELECT trajectory_id FROM trajectories WHERE owner = %s AND (meta::jsonb -> %s) = to_jsonb(%s::text) ORDER BY seq",
                (owner, key, value),
            ).fetchall()
        return [r[0] for r in rows]

    def record_owner(self, target: str, target_id: str) -> str | None:
        table, column = ("turns", "turn_id") if target == "turn" else ("trajectories", "trajectory_id")
        with self._tx() as conn:
            row = conn.execute(f"SELECT owner FROM {table} WHERE {column} = %s", (target_id,)).fetchone()
        return None if row is None else row[0]

    def session_owners(self, session_id: str) -> list[str]:
        with self._tx() as conn:
            rows = conn.execute("SELECT owner FROM sessions WHERE session_id = %s ORDER BY owner", (session_id,)).fetchall()
        return [r[0] for r in rows]

    def prune(self, older_than: float) -> int:
        """Delete unrewarded turns created before ``older_than`` (Unix time), then what became empty; returns turns deleted."""
        with self._tx() as conn:
            n = conn.execute(
                """DELETE FROM turns
                   WHERE created_at < %(t)s
                     AND turn_id NOT IN (SELECT target_id FROM rewards WHERE target = 'turn')
                     AND trajectory_id NOT IN (SELECT target_id FROM rewards WHERE target = 'trajectory')""",
                {"t": older_than},
            ).rowcount
            conn.execute(
                """DELETE FROM trajectories
                   WHERE created_at < %(t)s
                     AND NOT EXISTS (SELECT 1 FROM turns u WHERE u.trajectory_id = trajectories.trajectory_id)
                     AND trajectory_id NOT IN (SELECT target_id FROM rewards WHERE target = 'trajectory')""",
                {"t": older_than},
            )
            conn.execute(
                """DELETE FROM sessions
                   WHERE created_at < %(t)s
                     AND NOT EXISTS (SELECT 1 FROM trajectories t WHERE t.owner = sessions.owner AND t.session_id = sessions.session_id)""",
                {"t": older_than},
            )
        return n

    # -- reads ---------------------------------------------------------------------------------------

    def turns_for_completion(self, completion_id: str, owner: str | None = None, choice_index: int | None = None) -> list[str]:
        with self._tx() as conn:
            rows = conn.execute(
                "SELECT turn_id FROM turns WHERE completion_id = %(c)s AND (%(o)s::text IS NULL OR owner = %(o)s)"
                " AND (%(i)s::int IS NULL OR choice_index = %(i)s) ORDER BY choice_index, seq",
                {"c": completion_id, "o": owner, "i": choice_index},
            ).fetchall()
        return [r[0] for r in rows]

    def find_continuation(self, session_id: str, continuation_key: str, owner: str = "public") -> TurnRef | None:
        """The newest turn of ``owner``'s session ``session_id`` whose continuation key matches, or None."""
        with self._tx() as conn:
            row = conn.execute(
                """SELECT turn_id, trajectory_id, session_id, idx,
                          EXISTS (SELECT 1 FROM turns c WHERE c.parent_turn_id = t.turn_id AND c.trajectory_id = t.trajectory_id)
                     FROM turns t
                    WHERE owner = %s AND session_id = %s AND continuation_key = %s
                    ORDER BY created_at DESC, seq DESC LIMIT 1""",
                (owner, session_id, continuation_key),
            ).fetchone()
        if row is None:
            return None
        return TurnRef(turn_id=row[0], trajectory_id=row[1], session_id=row[2], index=row[3], has_successor=bool(row[4]))

    def has_successor(self, turn_id: str, trajectory_id: str) -> bool:
        """Whether a stored turn continues ``turn_id`` in its trajectory (another runtime may have continued it)."""
        with self._tx() as conn:
            row = conn.execute("SELECT 1 FROM turns WHERE parent_turn_id = %s AND trajectory_id = %s LIMIT 1", (turn_id, trajectory_id)).fetchone()
        return row is not None

    def turn_exists(self, turn_id: str, owner: str | None = None) -> bool:
        with self._tx() as conn:
            row = conn.execute(
                "SELECT 1 FROM turns WHERE turn_id = %(t)s AND (%(o)s::text IS NULL OR owner = %(o)s)", {"t": turn_id, "o": owner}
            ).fetchone()
        return row is not None

    def trajectory_exists(self, trajectory_id: str, owner: str | None = None) -> bool:
        with self._tx() as conn:
            row = conn.execute(
                "SELECT 1 FROM trajectories WHERE trajectory_id = %(t)s AND (%(o)s::text IS NULL OR owner = %(o)s)", {"t": trajectory_id, "o": owner}
            ).fetchone()
        return row is not None

    def stats(self) -> dict[str, int]:
        with self._tx() as conn:  # one statement: one snapshot for all four counts
            row = conn.execute(
                "SELECT (SELECT COUNT(*) FROM sessions), (SELECT COUNT(*) FROM trajectories),"
                " (SELECT COUNT(*) FROM turns), (SELECT COUNT(*) FROM rewards)"
            ).fetchone()
        return dict(zip(("sessions", "trajectories", "turns", "rewards"), (int(x) for x in row), strict=True))

    def list_trajectories(self, limit: int = 50, since: float | None = None, rewarded: bool | None = None, owner: str | None = None) -> list[dict]:
        """Newest first (by creation); ``since`` keeps trajectories created at or after it (Unix time), ``owner`` one owner's."""
        sql, params = trajectory_list_query("%s", "seq", limit, since, rewarded, owner)
        with self._tx() as conn:
            rows = conn.execute(sql, params).fetchall()
        return [trajectory_summary(r) for r in rows]

    def get_turn(self, turn_id: str) -> Turn | None:
        with self._tx() as conn:
            row = conn.execute(f"SELECT {TURN_COLUMNS} FROM turns WHERE turn_id = %s", (turn_id,)).fetchone()
        return None if row is None else _turn_from_row(row)

    def get_trajectory(self, trajectory_id: str) -> Trajectory | None:
        """The trajectory with its turns (by index) and every reward on it or on its turns (one snapshot)."""
        with self._tx(snapshot=True) as conn:
            row = conn.execute(
                "SELECT trajectory_id, session_id, created_at, meta, owner FROM trajectories WHERE trajectory_id = %s", (trajectory_id,)
            ).fetchone()
            if row is None:
                return None
            turns = conn.execute(
                f"SELECT {TURN_COLUMNS} FROM turns WHERE trajectory_id = %s ORDER BY idx, created_at, seq", (trajectory_id,)
            ).fetchall()
            rewards = conn.execute(_REWARDS_OF_TRAJECTORY, {"t": trajectory_id}).fetchall()
        return Trajectory(
            trajectory_id=row[0],
            session_id=row[1],
            created_at=row[2],
            meta=json.loads(row[3]),
            owner=row[4],
            turns=[_turn_from_row(r) for r in turns],
            rewards=[_reward_from_row(r[:9]) for r in rewards],
        )

    def iter_samples(self, since: float | None = None, rewarded: bool | None = None, page_size: int = 256) -> Iterator[dict]:
        """Per-turn training samples in insertion order (``seq``), page by page; see ``SqliteStore.iter_samples``."""
        where, params = ["t.seq > %s"], []
        if since is not None:
            where.append("t.created_at >= %s")
            params.append(since)
        if rewarded is not None:
            cond = (
                "(t.turn_id IN (SELECT target_id FROM rewards WHERE target = 'turn')"
                " OR t.trajectory_id IN (SELECT target_id FROM rewards WHERE target = 'trajectory'))"
            )
            where.append(cond if rewarded else f"NOT {cond}")
        sql = f"""SELECT t.seq, t.turn_id, t.trajectory_id, t.session_id, t.idx, t.context_ids, t.output_ids, t.logprobs,
                         t.loss_mask, t.adapter, t.finish_reason, t.created_at,
                         (SELECT j.meta FROM trajectories j WHERE j.trajectory_id = t.trajectory_id), t.owner
                    FROM turns t WHERE {" AND ".join(where)} ORDER BY t.seq LIMIT %s"""
        rewards_sql = f"""SELECT {REWARD_COLUMNS}, seq FROM rewards
                           WHERE (target = 'turn' AND target_id = ANY(%s)) OR (target = 'trajectory' AND target_id = ANY(%s))
                           ORDER BY created_at, seq"""
        last = 0
        while True:
            with self._tx() as conn:
                rows = conn.execute(sql, (last, *params, page_size)).fetchall()
                if not rows:
                    return
                by_target: dict[tuple[str, str], list[tuple[int, Reward]]] = {}
                for x in conn.execute(rewards_sql, ([r[1] for r in rows], list({r[2] for r in rows}))):
                    rw = _reward_from_row(x[:9])
                    by_target.setdefault((rw.target, rw.target_id), []).append((x[9], rw))
            for r in rows:
                last = r[0]
                turn_rw = [x for _, x in by_target.get(("turn", r[1]), [])]
                traj_rw = [x for _, x in by_target.get(("trajectory", r[2]), [])]
                both = sorted(by_target.get(("turn", r[1]), []) + by_target.get(("trajectory", r[2]), []), key=lambda p: (p[1].created_at, p[0]))
                rewards = [x for _, x in both]
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
                    "reward": turn_rw[-1].value if turn_rw else None,
                    "trajectory_reward": traj_rw[-1].value if traj_rw else None,
                    "rewards": [x.model_dump() for x in rewards],
                    "trainable": bool(meta.get("trainable", True)),
                    "task_key": meta.get("task_key"),
                }
            if len(rows) < page_size:
                return

    # ---- the adapter registry's shared state ---------------------------------------------------
    def save_registry(self, kind: str, name: str, value: dict[str, Any] | None) -> None:
        """See ``SqliteStore.save_registry``."""
        with self._tx() as conn:
            if value is None:
                conn.execute("DELETE FROM registry WHERE kind = %s AND name = %s", (kind, name))
            else:
                conn.execute(
                    """INSERT INTO registry (kind, name, value, updated_at) VALUES (%s, %s, %s, %s)
                       ON CONFLICT (kind, name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at""",
                    (kind, name, _json(value), time.time()),
                )

    def load_registry(self) -> dict[str, dict[str, dict[str, Any]]]:
        out: dict[str, dict[str, dict[str, Any]]] = {"adapter": {}, "alias": {}}
        with self._tx() as conn:
            for kind, name, value in conn.execute("SELECT kind, name, value FROM registry ORDER BY updated_at, name"):
                out[kind][name] = json.loads(value)
        return out

    def arm_observations(self, adapter: str, since: float, source: str | None = None, *, trusted_only: bool = True) -> dict[str, list[float]]:
        """See ``SqliteStore.arm_observations``."""
        if source is not None:
            where_source, source_args = " AND r.source = %s", [source]
        elif trusted_only:
            where_source, source_args = " AND (r.source LIKE 'verifier:%%' OR r.source LIKE 'judge:%%')", []
        else:
            where_source, source_args = "", []
        query = f"""SELECT r.value, r.created_at, r.seq FROM rewards r JOIN turns t ON r.target = 'turn' AND r.target_id = t.turn_id
                    WHERE t.adapter IS NOT DISTINCT FROM %s AND t.created_at >= %s{where_source}
                    UNION ALL
                    SELECT r.value, r.created_at, r.seq FROM rewards r
                    WHERE r.target = 'trajectory' AND r.target_id IN
                          (SELECT DISTINCT trajectory_id FROM turns WHERE adapter IS NOT DISTINCT FROM %s AND created_at >= %s){where_source}
                    ORDER BY 2, 3"""
        one: list[Any] = [adapter, since, *source_args]
        with self._tx() as conn:
            rewards = [row[0] for row in conn.execute(query, one + one)]
            timing_rows = conn.execute(
                "SELECT octet_length(output_ids), timings FROM turns WHERE adapter IS NOT DISTINCT FROM %s AND created_at >= %s"
                " ORDER BY created_at, seq",
                (adapter, since),
            ).fetchall()
        latency, tps = [], []
        for n_bytes, timings in timing_rows:
            total = json.loads(timings).get("total_s") or 0.0
            latency.append(total)
            if total > 0:
                tps.append((n_bytes // 4) / total)
        return {"rewards": rewards, "latency_s": latency, "tokens_per_s": tps}
