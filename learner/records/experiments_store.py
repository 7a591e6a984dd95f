"""Where the A/B experiments' config and state are kept: the ``experiments`` table, beside the turns they judge.

What it does: ``ExperimentStore(db)`` saves (``save``: create or update) and reads back (``load``) each
experiment's config and running state (status, champion, stopped arms, decisions, p-value history) as JSON,
in the ``experiments`` table of the interaction store's database, so experiments survive restarts and, on a
PostgreSQL store shared by several runtimes, every runtime sees the same ones. ``experiments_table`` is the table;
the interaction store's migrations create it (version 9 on both backends, ``learner/records/store.py`` and
``learner/records/store_pg.py``), as every table of that database, so it is there whenever the store is open.

``db`` is the interaction store (``learner.records.store.SqliteStore`` or ``learner.records.store_pg.PostgresStore``), used
only through ``ExperimentDatabase``: one connection per transaction and its placeholder. The connections, their
settings, the file and the migrations belong to it; the table's definition and its queries belong here.

What it does not: decide anything (``runtime/adapters/experiments.py``), or read the arms' rewards: those are turn data,
answered by the interaction store's ``arm_observations``.
"""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager
from typing import Any, Protocol

__all__ = ["ExperimentDatabase", "ExperimentStore", "StoredExperiment", "experiments_table"]

StoredExperiment = tuple[str, dict[str, Any], dict[str, Any]]  # (name, config, state)


class ExperimentDatabase(Protocol):
    """What the experiments need from the database that holds them."""

    placeholder: str  # "?" (SQLite) or "%s" (psycopg)

    def transaction(self, *, write: bool = False) -> AbstractContextManager[Any]:
        """One connection in one transaction, committed when the block ends without an error."""
        ...


def experiments_table(real: str) -> str:
    """The ``experiments`` table of both backends (``real``: SQLite's REAL, PostgreSQL's DOUBLE PRECISION). ``IF NOT
    EXISTS``: a database migrated before the table was a migration of its own has it already, with these columns."""
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
