"""The one migration runner (learner/records/migrations.py) under every store: databases as the code before it wrote them
open and upgrade without losing a row (SQLite: files that code wrote, ``old_stores/``; PostgreSQL: the tables that code
made), openers racing on one database migrate once, a newer schema is refused, and a schema's numbering is checked."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from learner.records import Reward, ToolCallRecord, Turn, TurnCheck, TurnTimings
from learner.records.experiments_store import ExperimentStore
from learner.records.migrations import Schema, SchemaTooNew, migrate_postgres, migrate_sqlite
from learner.records.store import INTERACTIONS, SqliteStore
from memory.store import MEMORY, MemoryStore, Provenance
from runtime.api.response_store import RESPONSES, ResponseStore, StoredResponse

OLD = Path(__file__).with_name("old_stores")


def old_turn(i: int, parent: str | None = None, check: TurnCheck | None = None) -> Turn:
    """The turns ``old_stores/interactions_v8.sql`` holds (as the script that wrote it made them)."""
    return Turn(
        turn_id=f"turn-{i}", trajectory_id="traj-a", session_id="sess-a", index=i - 1, parent_turn_id=parent, completion_id=f"cmpl-{i}",
        choice_index=0, created_at=1_700_000_000.0 + i, model="tiny", adapter="f@2", context_ids=[1, 2, 3 + i], output_ids=[7, 8, 2],
        logprobs=[-0.5, -0.25, -0.125], loss_mask=[1, 1, 1], sampling={"temperature": 0.7},
        tool_calls=[ToolCallRecord(id="c1", name="calc", arguments='{"x": 1}')] if i == 1 else [], finish_reason="stop",
        timings=TurnTimings(queued_s=0.5, ttft_s=0.25, total_s=1.5), messages=[{"role": "user", "content": f"q{i} ✓"}],
        output_text=f"a{i}", continuation_key=f"ck{i}", prefix_key=f"pk{i}", owner="key-a", self_check=check,
    )  # fmt: skip


CHECK = TurnCheck(format="svr", solution="3", format_ok=True, correct=True)


def old_file(tmp_path: Path, dump: str, name: str) -> Path:
    path = tmp_path / name
    conn = sqlite3.connect(path)
    conn.executescript((OLD / dump).read_text())
    conn.close()
    return path


def rows(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of an SQLite file, by table (sorted: rowid order is not the point)."""
    conn = sqlite3.connect(path)
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    out = {t: sorted(conn.execute(f'SELECT * FROM "{t}"').fetchall(), key=repr) for t in tables}
    conn.close()
    return out


def user_version(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()


# -- the runner itself -------------------------------------------------------------------------------------------------


def test_a_schema_is_numbered_from_one_strictly_increasing_and_named_as_an_identifier() -> None:
    def step(conn: sqlite3.Connection) -> None: ...

    assert Schema("ok_name", ((5, step), (6, step))).version == 6  # a first step may skip versions
    for bad in (((0, step),), ((2, step), (2, step)), ((3, step), (1, step)), ()):
        with pytest.raises(ValueError, match="numbered"):
            Schema("ok_name", bad)
    with pytest.raises(ValueError, match="identifier"):
        Schema("x; DROP TABLE turns", ((1, step),))


def test_sqlite_steps_run_once_each_and_stop_at_a_target(tmp_path: Path) -> None:
    calls: list[int] = []

    def step(n: int) -> Callable[[sqlite3.Connection], None]:
        return lambda conn: (calls.append(n), conn.execute(f"CREATE TABLE t{n} (x)"))[0]

    schema = Schema("loopwise_test_schema", ((1, step(1)), (2, step(2)), (3, step(3))))
    conn = sqlite3.connect(tmp_path / "x.db", isolation_level=None)
    assert migrate_sqlite(conn, schema, target=2) == 2 and calls == [1, 2]
    assert migrate_sqlite(conn, schema) == 3 and migrate_sqlite(conn, schema) == 3 and calls == [1, 2, 3]
    with pytest.raises(ValueError, match="not a version"):
        migrate_sqlite(conn, schema, target=7)
    conn.close()


def test_sqlite_openers_racing_on_one_new_file_migrate_it_once(tmp_path: Path) -> None:
    path = tmp_path / "interactions.db"
    opened: list[SqliteStore] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            opened.append(SqliteStore(path))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(opened) == 6 and {s.schema_version for s in opened} == {INTERACTIONS.version}
    ExperimentStore(opened[0]).save("e", {}, {"status": "running"})
    assert ExperimentStore(opened[-1]).load() == [("e", {}, {"status": "running"})]
    for s in opened:
        s.close()


# -- SQLite files the code before the runner wrote -----------------------------------------------------------------------


def test_an_interaction_store_of_the_previous_code_upgrades_keeping_every_row(tmp_path: Path) -> None:
    path = old_file(tmp_path, "interactions_v8.sql", "interactions.db")
    before = rows(path)
    assert user_version(path) == 8 and "experiments" in before  # the experiments' store had made its table itself
    s = SqliteStore(path)
    assert s.schema_version == INTERACTIONS.version == 9
    after = rows(path)
    assert after == before  # version 9 keeps the experiments table it found (and every other table is untouched)
    assert s.get_turn("turn-1") == old_turn(1) and s.get_turn("turn-2") == old_turn(2, "turn-1", CHECK)
    traj = s.get_trajectory("traj-a")
    assert traj is not None and traj.meta == {"agent": "svr", "task_key": "t1"} and traj.owner == "key-a"
    assert [(r.reward_id, r.value, r.source) for r in traj.rewards] == [("r1", 1.0, "verifier:math"), ("r2", 0.5, "feedback")]
    again, created = s.add_reward(Reward(target="turn", target_id="turn-1", value=0.0, owner="key-a", idempotency_key="k1"))
    assert not created and again.reward_id == "r1"  # the unique idempotency index came through
    assert s.load_registry() == {"adapter": {"f@2": {"path": "/adapters/f/2", "sha256": "ab"}}, "alias": {"f": {"target": "f@2"}}}
    assert not s.claim_continuation("turn-1") and s.claim_continuation("turn-2")  # the old claim holds
    [(name, config, state)] = ExperimentStore(s).load()
    assert (name, config["family"], state["champion"]) == ("f-ab", "f", "f@1")
    s.close()
    assert SqliteStore(path).stats() == {"sessions": 1, "trajectories": 1, "turns": 2, "rewards": 2}  # reopened: nothing to do


def test_a_memory_file_of_the_previous_code_opens_with_its_documents(tmp_path: Path) -> None:
    path = old_file(tmp_path, "memory_v1.sql", "memory.db")
    before = rows(path)
    m = MemoryStore(path)
    assert m.schema_version == MEMORY.version == 1 and rows(path) == before
    assert [(v.version, v.text, v.provenance.adapter) for v in m.versions("key-a", "user:alice")] == [
        (2, "second note ✓", "memopilot@2"),
        (1, "first note", "memopilot@1"),
    ]
    assert m.versions("key-a", "user:alice")[1].provenance.meta == {"task_key": "rps"} and m.read("key-b", "agent:x")[0] == "b's note"
    assert m.write("key-a", "user:alice", "third", Provenance("memopilot")).version == 3
    m.close()


def test_a_responses_file_of_the_previous_code_gets_a_version_and_keeps_its_responses(tmp_path: Path) -> None:
    path = old_file(tmp_path, "responses_v0.sql", "responses.db")
    before = rows(path)
    assert user_version(path) == 0  # the code before versioned nothing in this file: CREATE TABLE IF NOT EXISTS on open
    r = ResponseStore(path)
    got = r.get("resp-1", "key-a")
    assert got is not None and got.response["loopwise"] == {"turn_id": "turn-2"} and got.context[0]["content"] == "q ✓"
    assert r.get("resp-2", "key-a") is None and r.get("resp-2", "key-b") is not None
    assert user_version(path) == RESPONSES.version == 1 and rows(path) == before
    r.put(StoredResponse("resp-3", "key-a", "sess-a", {"id": "resp-3"}, []))
    assert r.delete_session("key-a", "sess-a") == 2
    r.close()


def test_a_newer_responses_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "responses.db"
    ResponseStore(path).put(StoredResponse("resp-1", "key-a", "s", {"id": "resp-1"}, []))
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")  # as if written by a newer loopwise
    conn.close()
    with pytest.raises(SchemaTooNew, match="loopwise_responses_schema"):
        ResponseStore(path).get("resp-1", "key-a")


# -- PostgreSQL ------------------------------------------------------------------------------------------------------------


def test_pg_tables_of_the_previous_code_upgrade_keeping_every_row(pg_url: str) -> None:
    import psycopg

    from learner.records import store_pg
    from learner.records.store_pg import PostgresStore
    from memory.store_pg import MEMORY as PG_MEMORY
    from memory.store_pg import PostgresMemoryStore
    from runtime.api.response_store_pg import PostgresResponseStore

    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert migrate_postgres(conn, store_pg.INTERACTIONS, target=8) == 8  # versions 5-8: the same steps as before
        # what the code before made itself: the experiments table (its store, when it opened), the responses' version 1
        conn.execute(
            """CREATE TABLE experiments (name TEXT PRIMARY KEY, config TEXT NOT NULL, state TEXT NOT NULL,
                                         created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL)"""
        )
        conn.execute("INSERT INTO experiments VALUES ('e', '{}', '{\"status\": \"running\"}', 1.0, 1.0)")
        conn.execute("""CREATE TABLE responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT NOT NULL,
                        created_at DOUBLE PRECISION NOT NULL, response TEXT NOT NULL, context TEXT NOT NULL)""")
        conn.execute("CREATE INDEX responses_owner ON responses (owner, created_at)")
        conn.execute("CREATE INDEX responses_session ON responses (owner, session_id)")
        conn.execute("CREATE TABLE loopwise_responses_schema (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO loopwise_responses_schema VALUES (1)")
        conn.execute("INSERT INTO responses VALUES ('resp-1', 'key-a', 's1', 1.0, '{\"id\": \"resp-1\"}', '[]')")
        assert migrate_postgres(conn, PG_MEMORY) == 1  # the memory tables' only version, unchanged
        conn.execute("INSERT INTO memory_versions VALUES ('key-a', 'user:alice', 1, 'note', 1.0, 'memopilot', NULL, NULL, NULL, NULL, NULL, '{}')")
    s = PostgresStore(pg_url)
    s.append_turns([old_turn(1)])
    assert s.schema_version == INTERACTIONS.version and ExperimentStore(s).load() == [("e", {}, {"status": "running"})]
    responses = PostgresResponseStore(s)
    stored = responses.get("resp-1", "key-a")
    assert responses.schema_version == 1 and stored is not None and stored.response == {"id": "resp-1"}
    memory = PostgresMemoryStore(s)
    assert memory.schema_version == 1 and memory.read("key-a", "user:alice")[0] == "note"
    with s.transaction() as conn:
        versions = conn.execute(
            "SELECT (SELECT version FROM loopwise_schema), (SELECT version FROM loopwise_memory_schema),"
            " (SELECT version FROM loopwise_responses_schema), (SELECT COUNT(*) FROM loopwise_schema)"
        ).fetchone()
    assert versions == (INTERACTIONS.version, 1, 1, 1)
    s.close()


def test_pg_runtimes_starting_at_once_migrate_every_schema_once(pg_url: str) -> None:
    from learner.records.store_pg import PostgresStore
    from memory.store_pg import PostgresMemoryStore
    from runtime.api.response_store_pg import PostgresResponseStore

    opened: list[PostgresStore] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def runtime() -> None:  # what serve.py opens on a PostgreSQL store
        try:
            start.wait()
            db = PostgresStore(pg_url, max_size=2)
            opened.append(db)
            PostgresMemoryStore(db)
            PostgresResponseStore(db)
            ExperimentStore(db).load()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=runtime) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(opened) == 4
    with opened[0].transaction() as conn:
        counts = conn.execute(
            "SELECT (SELECT COUNT(*) FROM loopwise_schema), (SELECT COUNT(*) FROM loopwise_memory_schema),"
            " (SELECT COUNT(*) FROM loopwise_responses_schema)"
        ).fetchone()
    assert counts == (1, 1, 1)
    for db in opened:
        db.close()
