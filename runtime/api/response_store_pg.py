"""Stored Responses on PostgreSQL (``--store postgresql://``): the ``responses`` table in the interaction store's database.

What it does: ``PostgresResponseStore(db)`` keeps the same rows as ``runtime/api/response_store.py``'s SQLite file (id,
owner, session, the response object, its context items) with the same rules: every read and delete selects by
(id, owner), so another owner's response is not found and never replaced; ``delete_session`` removes an owner's
session's responses; ``forbid`` drops the responses of turns whose session was deleted while they generated. Every
runtime on the database sees every response, so ``previous_response_id`` continues a conversation on any of them.

``db`` is the interaction store (``learner.records.store_pg.PostgresStore``), used for its pooled transactions and
its migrations (``learner/records/migrations.py``'s runner): the table's schema is its own ``RESPONSES`` (version in
``loopwise_responses_schema``), migrated when the store opens. The pool belongs to ``db``: ``close`` leaves it open.

What it does not: erase securely (PostgreSQL keeps deleted rows' bytes until vacuum and in its WAL, as for turns), or
forbid across runtimes: ``forbid`` reaches this process's requests only (as the recorder's tombstones do).
"""

from __future__ import annotations

from collections.abc import Iterable

import psycopg

from learner.records.migrations import Schema
from learner.records.store_pg import PostgresStore
from runtime.api.response_store import SELECT, UPSERT, ForbiddenTurns, StoredResponse, responses_table


def _v1_responses(conn: psycopg.Connection) -> None:
    for sql in responses_table("DOUBLE PRECISION"):
        conn.execute(sql)


RESPONSES: Schema[psycopg.Connection] = Schema("loopwise_responses_schema", ((1, _v1_responses),))


def _pg(sql: str) -> str:
    return sql.replace("?", "%s")


class PostgresResponseStore:
    """The stored responses of every runtime on one PostgreSQL database (see the module docstring). Calls block."""

    def __init__(self, db: PostgresStore, *, forbidden_size: int = 100_000) -> None:
        self.db = db
        self.schema_version = db.migrate(RESPONSES)
        self._forbidden = ForbiddenTurns(forbidden_size)

    def forbid(self, turn_ids: Iterable[str]) -> None:
        """The responses of these turns (their session was deleted while they generated) will not be stored."""
        self._forbidden.add(turn_ids)

    def put(self, stored: StoredResponse) -> None:
        """Store (or replace) a response, unless its turn was forbidden."""
        row = stored.row()
        with self._forbidden.admitting(stored) as admitted:
            if admitted:
                with self.db.transaction(write=True) as conn:
                    conn.execute(_pg(UPSERT), row)

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self.db.transaction() as conn:
            row = conn.execute(_pg(SELECT), (response_id, owner)).fetchone()
        return None if row is None else StoredResponse.from_row(row)

    def delete(self, response_id: str, owner: str) -> bool:
        with self.db.transaction(write=True) as conn:
            return conn.execute("DELETE FROM responses WHERE id = %s AND owner = %s", (response_id, owner)).rowcount > 0

    def delete_session(self, owner: str, session_id: str) -> int:
        """Delete every response of ``owner``'s session ``session_id`` (another owner's session of that name is untouched)."""
        with self.db.transaction(write=True) as conn:
            return int(conn.execute("DELETE FROM responses WHERE owner = %s AND session_id = %s", (owner, session_id)).rowcount)

    def close(self) -> None:
        """Nothing to close: the connections are the interaction store's."""
