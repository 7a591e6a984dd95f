"""Where the A/B experiments' config and state are kept: the ``experiments`` table, beside the turns they judge.

What it does: ``ExperimentStore(db)`` saves (``save``: create or update) and reads back (``load``) each
experiment's config and running state (status, champion, stopped arms, decisions, p-value history) as JSON,
in the ``experiments`` table of the interaction store's database, so experiments survive restarts and, on a
PostgreSQL store shared by several runtimes, every runtime sees the same ones. It creates the table when
it is missing (``CREATE TABLE IF NOT EXISTS``: a database made before this module existed already has it,
with these columns; on PostgreSQL under an advisory lock, so runtimes starting together do not race).

``db`` is the interaction store (``learner.records.store.SqliteStore`` or ``learner.records.store_pg.PostgresStore``), used
only through ``ExperimentDatabase``: one connection per transaction, its placeholder and its dialect. The
connections, their settings and the file belong to it; the table and its queries belong here.

What it does not: decide anything (``runtime/experiments.py``), or read the arms' rewards: those are turn data,
answered by the interaction store's ``arm_observations``.
"""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

__all__ = ["ExperimentDatabase", "ExperimentStore", "StoredExperiment"]

StoredExperiment = tuple[str, dict[str, Any], dict[str, Any]]  # (name, config, state)

_MIGRATION_LOCK = 0x6C6F6578  # "loex": the advisory lock key serializing the table's creation across runtimes


class ExperimentDatabase(Protocol):
    """What the experiments need from the database that holds them."""

    placeholder: str  # "?" (SQLite) or "%s" (psycopg)
    dialect: Literal["sqlite", "postgresql"]

    def transaction(self, *, write: bool = False) -> AbstractContextManager[Any]:
        """One connection in one transaction, committed when the block ends without an error."""
        ...


def _table(dialect: str) -> str:
    real = "DOUBLE PRECISION" if dialect == "postgresql" else "REAL"
    return f"""CREATE TABLE IF NOT EXISTS experiments (
            name TEXT PRIMARY KEY,
            config TEXT NOT NULL,
            state TEXT NOT NULL,
            created_at {real} NOT NULL,
            updated_at {real} NOT NULL
        )"""


_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


class ExperimentStore:
    """The experiments of one database (see the module docstring). Calls block: run them off the event loop."""

    def __init__(self, db: ExperimentDatabase) -> None:
        self.db = db
        with db.transaction(write=True) as conn:
            if db.dialect == "postgresql":
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute(_table(db.dialect))

    def save(self, name: str, config: dict[str, Any], state: dict[str, Any]) -> None:
        """Create or update an experiment's config and state (experiments are not turn data: they change)."""
        p, now = self.db.placeholder, time.time()
        with self.db.transaction(write=True) as conn:
            conn.execute(
                f"""INSERT INTO experiments (name, config, state, created_at, updated_at) VALUES ({p}, {p}, {p}, {p}, {p})
                   ON CONFLICT (name) DO UPDATE SET config = excluded.config, state = excluded.state, updated_at = excluded.updated_at""",
                (name, _encode(config), _encode(state), now, now),
            )

    def load(self) -> list[StoredExperiment]:
        """Every experiment, oldest first: ``(name, config, state)``."""
        with self.db.transaction() as conn:
            rows = conn.execute("SELECT name, config, state FROM experiments ORDER BY created_at, name").fetchall()
        return [(r[0], json.loads(r[1]), json.loads(r[2])) for r in rows]
