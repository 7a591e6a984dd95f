"""The interaction store's queries, said once for both backends: a small SQL ``Dialect`` and ``StoreQueries``.

What it does:
- ``Dialect`` carries the few fragments in which SQLite and PostgreSQL spell the same query differently: the
  placeholder (queries here are written with ``?``; ``Dialect.sql`` turns them into psycopg's ``%s`` and
  doubles a literal ``%``), the insertion-order column (SQLite's ``rowid``, PostgreSQL's ``BIGSERIAL seq``),
  null-safe equality, a blob's byte length, a JSON field of a text column, a row lock, and a list
  parameter (``IN (?, ?, …)`` on SQLite, one array ``= ANY(?)`` on PostgreSQL). ``SQLITE`` and
  ``POSTGRESQL`` are the two; ``is_postgres_url`` says which backend a ``--store`` value names.
- ``StoreQueries`` holds every read and write whose SQL and Python are the same on both backends once the
  dialect has spoken: listing, trajectories, turns, training samples, stitching lookups and continuation claims,
  owners, deletion, pruning, trajectory metadata, rewards, arm statistics, the adapter registry's state. A backend
  (``learner.records.store.SqliteStore``, ``learner.records.store_pg.PostgresStore``) supplies its dialect and the three
  ways it runs them: ``_read`` (one or more independent reads), ``_snapshot`` (several reads seeing one
  state) and ``_write`` (one write transaction), plus ``_after_delete`` (SQLite truncates its WAL).

What it does not: open connections, choose isolation levels, create or migrate tables, or append turns
(each backend's batch write is its own: SQLite encodes inside its transaction, psycopg sends a pipeline);
those stay in the backend modules, where the differences are said and commented.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Self

from learner.records import ADMIN_OWNER, LEARNER_SOURCE_PREFIX, Reward, TooManyRewards, Trajectory, Turn, TurnRef, UnknownTarget
from learner.records.store_rows import N_TURN_COLUMNS, REWARD_COLUMNS, TURN_COLUMNS, encode_json, reward_from_row, reward_row, turn_from_row, unpack

__all__ = ["POSTGRESQL", "SQLITE", "Dialect", "StoreQueries", "first_seen", "is_postgres_url"]


@functools.lru_cache(maxsize=512)
def _pyformat(text: str) -> str:
    return text.replace("%", "%%").replace("?", "%s")


@dataclass(frozen=True)
class Dialect:
    """What differs between the backends' spelling of one query (see the module docstring)."""

    name: Literal["sqlite", "postgresql"]
    order: str  # the insertion-order column of turns, trajectories and rewards
    same: str  # null-safe equality (``adapter IS NULL`` must match the base model's turns); SQLite's ``IS`` predates its IS NOT DISTINCT FROM (3.39)
    byte_length: str  # a blob's size in bytes
    lock_row: str  # appended to a SELECT that reads a row it will update
    list_limit: int  # how many values one list parameter may hold

    def sql(self, text: str) -> str:
        """``text`` (written with ``?`` placeholders) in this driver's parameter style."""
        return text if self.name == "sqlite" else _pyformat(text)

    def meta_is(self, column: str) -> str:
        """True when the JSON object in ``column`` has the string value ``?`` (2nd parameter) at key ``?`` (1st):
        JSON strings only, a number or boolean never equals a string on either backend."""
        if self.name == "sqlite":
            return f"json_extract({column}, '$.' || ?) = ?"  # a JSON number comes back an INTEGER/REAL: never = TEXT
        return f"({column}::jsonb -> ?) = to_jsonb(?::text)"

    def any_of(self, values: Sequence[Any]) -> tuple[str, tuple[Any, ...]]:
        """``IN (?, ?, …)`` / ``= ANY(?)`` for ``values`` (at most ``list_limit`` of them), and its parameters."""
        if self.name == "sqlite":
            return f"IN ({', '.join('?' * len(values))})", tuple(values)
        return "= ANY(?)", (list(values),)

    def chunks(self, values: Sequence[Any]) -> Iterator[Sequence[Any]]:
        """``values`` in pieces that fit one list parameter."""
        for k in range(0, len(values), self.list_limit):
            yield values[k : k + self.list_limit]


# SQLite: a write takes the database's write lock at BEGIN IMMEDIATE, so a row read in a write transaction needs no lock
# of its own; IN lists of at most 500 (SQLite's bound-variable limit was 999 before 3.32).
SQLITE = Dialect(name="sqlite", order="rowid", same="IS", byte_length="length", lock_row="", list_limit=500)
# PostgreSQL: row-level locks (FOR UPDATE keeps a concurrent writer's merge from being lost); lists travel as one array.
POSTGRESQL = Dialect(
    name="postgresql", order="seq", same="IS NOT DISTINCT FROM", byte_length="octet_length", lock_row=" FOR UPDATE", list_limit=sys.maxsize
)

_REWARD_COLS_R = ", ".join("r." + c.strip() for c in REWARD_COLUMNS.split(","))

# trajectory ids with a reward on the trajectory or on one of its turns
_REWARDED_TRAJECTORIES = """
    SELECT target_id FROM rewards WHERE target = 'trajectory'
    UNION
    SELECT u.trajectory_id FROM rewards r JOIN turns u ON u.turn_id = r.target_id WHERE r.target = 'turn'"""

# turns with a reward on them or on their trajectory
_REWARDED_TURN = (
    "(t.turn_id IN (SELECT target_id FROM rewards WHERE target = 'turn')"
    " OR t.trajectory_id IN (SELECT target_id FROM rewards WHERE target = 'trajectory'))"
)


def is_postgres_url(spec: object) -> bool:
    """Whether a ``--store`` value is a PostgreSQL URL (``postgresql://`` or ``postgres://``), not an SQLite file path."""
    return isinstance(spec, str) and spec.startswith(("postgresql://", "postgres://"))


def first_seen(turns: Sequence[Turn]) -> tuple[dict[tuple[str, str], float], dict[str, tuple[str, str, float]]]:
    """The sessions ``(owner, session_id) → created_at`` and trajectories ``id → (owner, session_id, created_at)`` a
    batch of turns opens, each dated by its earliest turn (rows that exist already are kept as they are)."""
    sessions: dict[tuple[str, str], float] = {}
    trajectories: dict[str, tuple[str, str, float]] = {}
    for t in turns:
        if t.created_at < sessions.get((t.owner, t.session_id), float("inf")):
            sessions[(t.owner, t.session_id)] = t.created_at
        if t.trajectory_id not in trajectories or t.created_at < trajectories[t.trajectory_id][2]:
            trajectories[t.trajectory_id] = (t.owner, t.session_id, t.created_at)
    return sessions, trajectories


# the rows a batch of turns writes: re-appending is a no-op (the first copy wins), so a retried batch is safe
INSERT_SESSION = "INSERT INTO sessions (owner, session_id, created_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING"
INSERT_TRAJECTORY = "INSERT INTO trajectories (trajectory_id, owner, session_id, created_at) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING"
INSERT_TURN = f"INSERT INTO turns ({TURN_COLUMNS}) VALUES ({', '.join('?' * N_TURN_COLUMNS)}) ON CONFLICT (turn_id) DO NOTHING"


def _sample(r: Sequence[Any], rewards: list[Reward]) -> dict[str, Any]:
    """One training sample: a row of ``iter_samples``' page query and the rewards on the turn and its trajectory (in order)."""
    turn_values = [x.value for x in rewards if x.target == "turn"]
    traj_values = [x.value for x in rewards if x.target == "trajectory"]
    meta = json.loads(r[12] or "{}")
    return {
        "turn_id": r[1],
        "trajectory_id": r[2],
        "session_id": r[3],
        "owner": r[13],
        "index": r[4],
        "context_ids": unpack("i", r[5]),
        "output_ids": unpack("i", r[6]),
        "logprobs": unpack("f", r[7]),
        "loss_mask": unpack("b", r[8]),
        "adapter": r[9],
        "finish_reason": r[10],
        "created_at": r[11],
        "reward": turn_values[-1] if turn_values else None,
        "trajectory_reward": traj_values[-1] if traj_values else None,
        "rewards": [x.model_dump() for x in rewards],
        "trainable": bool(meta.get("trainable", True)),
        "task_key": meta.get("task_key"),
    }


class StoreQueries:
    """The store methods both backends share (see the module docstring). Subclasses set ``_d`` and the hooks."""

    _d: Dialect

    def _read(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _snapshot(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _after_delete(self) -> None:
        """Called after a deletion committed (SQLite: leave no copy of the deleted pages in the WAL)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _q(self, text: str) -> str:
        return self._d.sql(text)

    # -- writes --------------------------------------------------------------------------------------

    def add_reward(self, reward: Reward, max_per_target: int | None = None) -> tuple[Reward, bool]:
        """Store ``reward``; returns (the stored reward, created).

        The target must exist and belong to ``reward.owner`` (else :class:`UnknownTarget`: another owner's
        turn is indistinguishable from a missing one). A repeated idempotency key of the same owner returns
        the first reward stored under it; idempotency keys of different owners never meet. With
        ``max_per_target`` (a client's feedback), a target that already holds that many rewards takes no more
        (:class:`TooManyRewards`); the runtime's own rewards pass none."""
        by_key = self._q(f"SELECT {REWARD_COLUMNS} FROM rewards WHERE owner = ? AND idempotency_key = ?")
        with self._write() as conn:
            if reward.idempotency_key is not None:
                row = conn.execute(by_key, (reward.owner, reward.idempotency_key)).fetchone()
                if row is not None:
                    return reward_from_row(row), False
            table, column = ("turns", "turn_id") if reward.target == "turn" else ("trajectories", "trajectory_id")
            # locked (PostgreSQL): a deletion of the target waits for this reward, or this reward sees the target gone
            found = conn.execute(self._q(f"SELECT owner FROM {table} WHERE {column} = ?{self._d.lock_row}"), (reward.target_id,)).fetchone()
            if found is None or found[0] != reward.owner:
                raise UnknownTarget(f"no {reward.target} with id {reward.target_id!r}")
            if max_per_target is not None:
                (held,) = conn.execute(self._q("SELECT COUNT(*) FROM rewards WHERE target_id = ?"), (reward.target_id,)).fetchone()
                if held >= max_per_target:
                    raise TooManyRewards(f"{reward.target} {reward.target_id!r} already holds {held} rewards (at most {max_per_target})")
            inserted = conn.execute(
                self._q(f"""INSERT INTO rewards ({REWARD_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
                             ON CONFLICT (owner, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING"""),
                reward_row(reward),
            ).rowcount
            if not inserted:
                # PostgreSQL: another process stored this key between our check and our insert; the unique index let
                # one insert win and this one returns it. (SQLite's write lock, held since BEGIN IMMEDIATE, rules that out.)
                return reward_from_row(conn.execute(by_key, (reward.owner, reward.idempotency_key)).fetchone()), False
        return reward, True

    def set_trajectory_meta(self, trajectory_id: str, meta: dict[str, Any]) -> None:
        """Merge ``meta`` into the trajectory's metadata (top-level keys replace); the trajectory must exist."""
        with self._write() as conn:
            row = conn.execute(self._q(f"SELECT meta FROM trajectories WHERE trajectory_id = ?{self._d.lock_row}"), (trajectory_id,)).fetchone()
            if row is None:
                raise UnknownTarget(f"no trajectory with id {trajectory_id!r}")
            merged = {**json.loads(row[0]), **meta}
            conn.execute(self._q("UPDATE trajectories SET meta = ? WHERE trajectory_id = ?"), (encode_json(merged), trajectory_id))

    def delete_session(self, owner: str, session_id: str) -> int:
        """Delete one owner's session with its trajectories, turns and their rewards; returns the number of turns deleted.

        Another owner's session of the same name is untouched."""
        key = (owner, session_id)
        with self._write() as conn:
            self._lock_targets(conn, "owner = ? AND session_id = ?", key)
            conn.execute(
                self._q("""DELETE FROM rewards WHERE
                     (target = 'turn' AND target_id IN (SELECT turn_id FROM turns WHERE owner = ? AND session_id = ?))
                  OR (target = 'trajectory' AND target_id IN (SELECT trajectory_id FROM trajectories WHERE owner = ? AND session_id = ?))"""),
                (*key, *key),
            )
            conn.execute(self._q("DELETE FROM turn_claims WHERE turn_id IN (SELECT turn_id FROM turns WHERE owner = ? AND session_id = ?)"), key)
            n = int(conn.execute(self._q("DELETE FROM turns WHERE owner = ? AND session_id = ?"), key).rowcount)
            conn.execute(self._q("DELETE FROM trajectories WHERE owner = ? AND session_id = ?"), key)
            conn.execute(self._q("DELETE FROM sessions WHERE owner = ? AND session_id = ?"), key)
        self._after_delete()
        return n

    def _lock_targets(self, conn: Any, where: str, params: Sequence[Any]) -> None:
        """Lock the trajectories and turns a deletion removes (``where`` selects them in both tables) before it deletes
        the rewards on them. PostgreSQL only (SQLite's write transaction holds the whole database): ``add_reward`` locks
        its target too, so a reward committed while the deletion waited is seen by its reward DELETE (READ COMMITTED:
        each statement sees what was committed before it began), and a reward arriving later finds its target gone.
        Without it, a reward stored concurrently was left behind on a deleted turn."""
        if self._d.lock_row:
            for table in ("trajectories", "turns"):
                conn.execute(self._q(f"SELECT 1 FROM {table} WHERE {where} ORDER BY {self._d.order}{self._d.lock_row}"), params).fetchall()

    def delete_trajectories(self, trajectory_ids: Sequence[str]) -> int:
        """Delete trajectories with their turns and the rewards on them (e.g. the ones that read a deleted memory);
        returns the number of turns deleted. Like :meth:`delete_session` (on SQLite, securely)."""
        ids = list(dict.fromkeys(trajectory_ids))
        if not ids:
            return 0
        n = 0
        with self._write() as conn:
            for chunk in self._d.chunks(ids):
                in_ids, params = self._d.any_of(chunk)
                self._lock_targets(conn, f"trajectory_id {in_ids}", params)
                conn.execute(
                    self._q(f"""DELETE FROM rewards WHERE
                          (target = 'turn' AND target_id IN (SELECT turn_id FROM turns WHERE trajectory_id {in_ids}))
                       OR (target = 'trajectory' AND target_id {in_ids})"""),
                    (*params, *params),
                )
                conn.execute(self._q(f"DELETE FROM turn_claims WHERE turn_id IN (SELECT turn_id FROM turns WHERE trajectory_id {in_ids})"), params)
                n += conn.execute(self._q(f"DELETE FROM turns WHERE trajectory_id {in_ids}"), params).rowcount
                conn.execute(self._q(f"DELETE FROM trajectories WHERE trajectory_id {in_ids}"), params)
        self._after_delete()
        return n

    def prune(self, older_than: float) -> int:
        """Delete unrewarded turns created before ``older_than`` (Unix time), then what became empty; returns turns deleted."""
        with self._write() as conn:
            n = int(
                conn.execute(
                    self._q("""DELETE FROM turns
                   WHERE created_at < ?
                     AND turn_id NOT IN (SELECT target_id FROM rewards WHERE target = 'turn')
                     AND trajectory_id NOT IN (SELECT target_id FROM rewards WHERE target = 'trajectory')"""),
                    (older_than,),
                ).rowcount
            )
            conn.execute(
                self._q("""DELETE FROM trajectories
                   WHERE created_at < ?
                     AND NOT EXISTS (SELECT 1 FROM turns u WHERE u.trajectory_id = trajectories.trajectory_id)
                     AND trajectory_id NOT IN (SELECT target_id FROM rewards WHERE target = 'trajectory')"""),
                (older_than,),
            )
            conn.execute(
                self._q("""DELETE FROM sessions
                   WHERE created_at < ?
                     AND NOT EXISTS (SELECT 1 FROM trajectories t WHERE t.owner = sessions.owner AND t.session_id = sessions.session_id)"""),
                (older_than,),
            )
            # a claim matters until its successor is stored (then the turn's has_successor answers): an old one is spent
            conn.execute(self._q("DELETE FROM turn_claims WHERE claimed_at < ?"), (older_than,))
        return n

    def claim_continuation(self, turn_id: str) -> bool:
        """Claim the continuation of ``turn_id`` for the caller's next turn: True for the one caller that claims it first
        (in any process on this store), False for every later one, which must start a branch instead. Claimed before
        generating, so two runtimes asked to continue the same turn at once never both extend its trajectory."""
        with self._write() as conn:
            sql = "INSERT INTO turn_claims (turn_id, claimed_at) VALUES (?, ?) ON CONFLICT (turn_id) DO NOTHING"
            return bool(conn.execute(self._q(sql), (turn_id, time.time())).rowcount)

    # -- lookups -------------------------------------------------------------------------------------

    def trajectories_with_meta(self, owner: str, key: str, value: str) -> list[str]:
        """Ids of ``owner``'s trajectories whose meta ``key`` is the string ``value`` (e.g. the runs that held a memory),
        oldest first."""
        sql = f"SELECT trajectory_id FROM trajectories WHERE owner = ? AND {self._d.meta_is('meta')} ORDER BY {self._d.order}"
        with self._read() as conn:
            rows = conn.execute(self._q(sql), (owner, key, value)).fetchall()
        return [r[0] for r in rows]

    def record_owner(self, target: str, target_id: str) -> str | None:
        """The owner of a turn (``target="turn"``) or trajectory, or None when it is not stored."""
        table, column = ("turns", "turn_id") if target == "turn" else ("trajectories", "trajectory_id")
        with self._read() as conn:
            row = conn.execute(self._q(f"SELECT owner FROM {table} WHERE {column} = ?"), (target_id,)).fetchone()
        return None if row is None else row[0]

    def session_owners(self, session_id: str) -> list[str]:
        """The owners that have a session named ``session_id`` (the admin API names one when several do)."""
        with self._read() as conn:
            rows = conn.execute(self._q("SELECT owner FROM sessions WHERE session_id = ? ORDER BY owner"), (session_id,)).fetchall()
        return [r[0] for r in rows]

    def turns_for_completion(self, completion_id: str, owner: str | None = None, choice_index: int | None = None) -> list[str]:
        """The turn ids of a completion's choices (only ``owner``'s, when given; only choice ``choice_index``'s, when given)."""
        # CAST: PostgreSQL cannot tell the type of a bare NULL parameter; SQLite's CAST of NULL is NULL too
        sql = f"""SELECT turn_id FROM turns WHERE completion_id = ? AND (CAST(? AS TEXT) IS NULL OR owner = ?)
                     AND (CAST(? AS INTEGER) IS NULL OR choice_index = ?) ORDER BY choice_index, {self._d.order}"""
        with self._read() as conn:
            rows = conn.execute(self._q(sql), (completion_id, owner, owner, choice_index, choice_index)).fetchall()
        return [r[0] for r in rows]

    def find_continuation(self, session_id: str, continuation_key: str, owner: str = "public") -> TurnRef | None:
        """The newest turn of ``owner``'s session ``session_id`` whose continuation key matches, or None."""
        sql = f"""SELECT turn_id, trajectory_id, session_id, idx,
                         EXISTS (SELECT 1 FROM turns c WHERE c.parent_turn_id = t.turn_id AND c.trajectory_id = t.trajectory_id)
                    FROM turns t
                   WHERE owner = ? AND session_id = ? AND continuation_key = ?
                   ORDER BY created_at DESC, {self._d.order} DESC LIMIT 1"""
        with self._read() as conn:
            row = conn.execute(self._q(sql), (owner, session_id, continuation_key)).fetchone()
        if row is None:
            return None
        return TurnRef(turn_id=row[0], trajectory_id=row[1], session_id=row[2], index=row[3], has_successor=bool(row[4]))

    def has_successor(self, turn_id: str, trajectory_id: str) -> bool:
        """Whether a stored turn continues ``turn_id`` in its trajectory (another runtime may have continued it)."""
        with self._read() as conn:
            sql = "SELECT 1 FROM turns WHERE parent_turn_id = ? AND trajectory_id = ? LIMIT 1"
            return conn.execute(self._q(sql), (turn_id, trajectory_id)).fetchone() is not None

    def turn_exists(self, turn_id: str, owner: str | None = None) -> bool:
        """Whether the turn is stored (and, when ``owner`` is given, belongs to it)."""
        with self._read() as conn:
            sql = "SELECT 1 FROM turns WHERE turn_id = ? AND (CAST(? AS TEXT) IS NULL OR owner = ?)"
            return conn.execute(self._q(sql), (turn_id, owner, owner)).fetchone() is not None

    def trajectory_exists(self, trajectory_id: str, owner: str | None = None) -> bool:
        """Whether the trajectory is stored (and, when ``owner`` is given, belongs to it)."""
        with self._read() as conn:
            sql = "SELECT 1 FROM trajectories WHERE trajectory_id = ? AND (CAST(? AS TEXT) IS NULL OR owner = ?)"
            return conn.execute(self._q(sql), (trajectory_id, owner, owner)).fetchone() is not None

    # -- reads ---------------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """How many sessions, trajectories, turns and rewards are stored (one statement: one snapshot)."""
        with self._read() as conn:
            row = conn.execute(
                self._q(
                    "SELECT (SELECT COUNT(*) FROM sessions), (SELECT COUNT(*) FROM trajectories),"
                    " (SELECT COUNT(*) FROM turns), (SELECT COUNT(*) FROM rewards)"
                ),
                (),
            ).fetchone()
        return dict(zip(("sessions", "trajectories", "turns", "rewards"), (int(x) for x in row), strict=True))

    def list_trajectories(
        self, limit: int = 50, since: float | None = None, rewarded: bool | None = None, owner: str | None = None
    ) -> list[dict[str, Any]]:
        """Newest first (by creation); ``since`` keeps trajectories created at or after it (Unix time), ``owner`` one owner's."""
        where: list[str] = []
        params: list[Any] = []
        if owner is not None:
            where.append("t.owner = ?")
            params.append(owner)
        if since is not None:
            where.append("t.created_at >= ?")
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
             ORDER BY t.created_at DESC, t.{self._d.order} DESC
             LIMIT ?"""
        with self._read() as conn:
            rows = conn.execute(self._q(sql), (*params, limit)).fetchall()
        return [
            {
                "trajectory_id": r[0],
                "session_id": r[1],
                "created_at": r[2],
                "meta": json.loads(r[3]),
                "owner": r[4],
                "turns": int(r[5]),
                "rewards": int(r[6]),
                "last_turn_at": r[7],
            }
            for r in rows
        ]

    def get_turn(self, turn_id: str) -> Turn | None:
        with self._read() as conn:
            row = conn.execute(self._q(f"SELECT {TURN_COLUMNS} FROM turns WHERE turn_id = ?"), (turn_id,)).fetchone()
        return None if row is None else turn_from_row(row)

    def get_trajectory(self, trajectory_id: str) -> Trajectory | None:
        """The trajectory with its turns (by index) and every reward on it or on its turns (one snapshot)."""
        with self._snapshot() as conn:
            row = conn.execute(
                self._q("SELECT trajectory_id, session_id, created_at, meta, owner FROM trajectories WHERE trajectory_id = ?"), (trajectory_id,)
            ).fetchone()
            if row is None:
                return None
            turns = conn.execute(
                self._q(f"SELECT {TURN_COLUMNS} FROM turns WHERE trajectory_id = ? ORDER BY idx, created_at, {self._d.order}"), (trajectory_id,)
            ).fetchall()
            rewards = conn.execute(
                self._q(f"""SELECT {REWARD_COLUMNS} FROM rewards WHERE target = 'trajectory' AND target_id = ?
                            UNION ALL
                            SELECT {_REWARD_COLS_R} FROM rewards r JOIN turns u ON u.turn_id = r.target_id
                             WHERE r.target = 'turn' AND u.trajectory_id = ?
                            ORDER BY created_at, reward_id"""),
                (trajectory_id, trajectory_id),
            ).fetchall()
        return Trajectory(
            trajectory_id=row[0],
            session_id=row[1],
            created_at=row[2],
            meta=json.loads(row[3]),
            owner=row[4],
            turns=[turn_from_row(r) for r in turns],
            rewards=[reward_from_row(r) for r in rewards],
        )

    def iter_samples(self, since: float | None = None, rewarded: bool | None = None, page_size: int = 256) -> Iterator[dict[str, Any]]:
        """Per-turn training samples in insertion order (see ``learner/__main__.py`` for the fields).

        ``since``: turns created at or after it (Unix time). ``rewarded``: True → only turns with a reward
        on them or on their trajectory; False → only turns with neither. Reads page by page (a page and the
        rewards on it are two short reads), so a long export never pins an old snapshot.
        """
        order = self._d.order
        where, params = [f"t.{order} > ?"], []
        if since is not None:
            where.append("t.created_at >= ?")
            params.append(since)
        if rewarded is not None:
            where.append(_REWARDED_TURN if rewarded else f"NOT {_REWARDED_TURN}")
        sql = self._q(f"""SELECT t.{order}, t.turn_id, t.trajectory_id, t.session_id, t.idx, t.context_ids, t.output_ids, t.logprobs,
                                 t.loss_mask, t.adapter, t.finish_reason, t.created_at,
                                 (SELECT j.meta FROM trajectories j WHERE j.trajectory_id = t.trajectory_id), t.owner
                            FROM turns t WHERE {" AND ".join(where)} ORDER BY t.{order} LIMIT ?""")
        last = 0
        while True:
            with self._read() as conn:  # per page: the generator may be resumed on another thread
                rows = conn.execute(sql, (last, *params, page_size)).fetchall()
                if not rows:
                    return
                on_turns = self._rewards_on(conn, "turn", [r[1] for r in rows])
                on_trajectories = self._rewards_on(conn, "trajectory", list(dict.fromkeys(r[2] for r in rows)))
            for r in rows:
                last = r[0]
                both = sorted(on_turns.get(r[1], []) + on_trajectories.get(r[2], []), key=lambda p: p[0])
                yield _sample(r, [x for _, x in both])
            if len(rows) < page_size:
                return

    def _rewards_on(self, conn: Any, target: str, ids: Sequence[str]) -> dict[str, list[tuple[tuple[float, int], Reward]]]:
        """The rewards on the turns or trajectories ``ids``, by target id, each keyed by its (created_at, insertion order)."""
        out: dict[str, list[tuple[tuple[float, int], Reward]]] = {}
        for chunk in self._d.chunks(ids):
            in_ids, params = self._d.any_of(chunk)
            sql = f"""SELECT {REWARD_COLUMNS}, {self._d.order} FROM rewards
                       WHERE target = ? AND target_id {in_ids} ORDER BY created_at, {self._d.order}"""
            for x in conn.execute(self._q(sql), (target, *params)):
                out.setdefault(x[2], []).append(((x[5], x[9]), reward_from_row(x)))
        return out

    # ---- the A/B experiments' per-arm data (their config and state: learner/records/experiments_store.py) ----
    def arm_observations(
        self, adapter: str, since: float, source: str | None = None, *, trusted_only: bool = True, until: float | None = None
    ) -> dict[str, list[Any]]:
        """For one adapter version since ``since``: the rewards on its turns and on the trajectories it served (a
        verifier's outcome reward is on the trajectory), of one ``source``, or with ``source=None`` of the trusted
        sources (the runtime's own ``verifier:*`` and ``judge:*``; every source with ``trusted_only=False``), in
        the order they came (ties: in the order they were stored); and per turn, oldest first, its total latency
        and output tokens/s. Work done through the admin API (owner ``admin``: the learner's own runs, re-rollouts,
        siblings, gate and evaluation runs) is never an observation, nor is a score the learner gave a user's turn for
        training (source ``learner:*``, group completion's): an A/B experiment judges by users' evidence.
        ``until`` (an experiment's end) leaves out rewards given, and turns made, after it: a decided experiment's figures stay.

        ``evidence`` has one row per reward, in the same order: ``(value, source, target, target_id, owner)``, for
        the experiments' source and owner rules (``runtime/adapters/experiments.py``)."""
        d = self._d
        if source is not None:
            where_source, source_args = " AND r.source = ?", [source]
        elif trusted_only:
            where_source, source_args = " AND (r.source LIKE 'verifier:%' OR r.source LIKE 'judge:%')", []
        else:
            where_source, source_args = "", []
        end = float("inf") if until is None else until
        where_source += f" AND r.source NOT LIKE '{LEARNER_SOURCE_PREFIX}%'"
        cols = f"r.value, r.created_at, r.{d.order}, r.source, r.target, r.target_id, r.owner"
        query = f"""SELECT {cols} FROM rewards r JOIN turns t ON r.target = 'turn' AND r.target_id = t.turn_id
                    WHERE t.adapter {d.same} ? AND t.created_at >= ? AND r.owner <> ? AND r.created_at <= ?{where_source}
                    UNION ALL
                    SELECT {cols} FROM rewards r
                    WHERE r.target = 'trajectory' AND r.target_id IN
                          (SELECT DISTINCT trajectory_id FROM turns WHERE adapter {d.same} ? AND created_at >= ?)
                          AND r.owner <> ? AND r.created_at <= ?{where_source}
                    ORDER BY 2, 3"""
        one: list[Any] = [adapter, since, ADMIN_OWNER, end, *source_args]
        timings_sql = f"""SELECT {d.byte_length}(output_ids), timings FROM turns
                          WHERE adapter {d.same} ? AND created_at >= ? AND created_at <= ? AND owner <> ? ORDER BY created_at, {d.order}"""
        with self._read() as conn:
            rows = conn.execute(self._q(query), one + one).fetchall()
            timing_rows = conn.execute(self._q(timings_sql), (adapter, since, end, ADMIN_OWNER)).fetchall()
        rewards = [row[0] for row in rows]
        evidence = [(row[0], row[3], row[4], row[5], row[6]) for row in rows]
        latency, tps = [], []
        for n_bytes, timings in timing_rows:
            total = json.loads(timings).get("total_s") or 0.0
            latency.append(total)
            if total > 0:
                tps.append((n_bytes // 4) / total)
        return {"rewards": rewards, "latency_s": latency, "tokens_per_s": tps, "evidence": evidence}

    # ---- the adapter registry's shared state ---------------------------------------------------
    def save_registry(self, kind: str, name: str, value: dict[str, Any] | None) -> None:
        """Set (or with ``value=None`` remove) one registry entry: ``kind`` ``adapter`` (``family@N`` → its path and
        hash) or ``alias`` (family → ``{"target": "family@N"}``)."""
        with self._write() as conn:
            if value is None:
                conn.execute(self._q("DELETE FROM registry WHERE kind = ? AND name = ?"), (kind, name))
            else:
                conn.execute(
                    self._q("""INSERT INTO registry (kind, name, value, updated_at) VALUES (?, ?, ?, ?)
                       ON CONFLICT (kind, name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at"""),
                    (kind, name, encode_json(value), time.time()),
                )

    def load_registry(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Every registry entry: ``{"adapter": {name: value}, "alias": {family: value}}``."""
        out: dict[str, dict[str, dict[str, Any]]] = {"adapter": {}, "alias": {}}
        with self._read() as conn:
            for kind, name, value in conn.execute(self._q("SELECT kind, name, value FROM registry ORDER BY updated_at, name"), ()).fetchall():
                out[kind][name] = json.loads(value)
        return out
