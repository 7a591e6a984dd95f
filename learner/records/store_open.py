"""Opening the interaction store a ``--store`` value names: ``open_store(spec)``.

A ``postgresql://`` (or ``postgres://``) URL opens ``learner.records.store_pg.PostgresStore`` (same public methods, same
tables and columns, BYTEA for the packed arrays; psycopg is imported only then), anything else is an SQLite file path
(``learner.records.store.SqliteStore``).

What it does not: the stores themselves, their default location (``learner.records.store.db_path``), or telling a URL
from a path (``is_postgres_url``, ``learner/records/store_sql.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from learner.records.store import SqliteStore
from learner.records.store_sql import is_postgres_url


def open_store(spec: str | Path, *, synchronous_full: bool = False) -> Any:
    """The interaction store ``spec`` names: a ``postgresql://`` (or ``postgres://``) URL, else an SQLite file path."""
    if is_postgres_url(spec):
        from learner.records.store_pg import PostgresStore  # psycopg is imported only for a PostgreSQL store

        return PostgresStore(str(spec), synchronous_full=synchronous_full)
    return SqliteStore(Path(spec), synchronous_full=synchronous_full)
