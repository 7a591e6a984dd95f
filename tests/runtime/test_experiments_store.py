"""The A/B experiments' table (learner/records/experiments_store.py) on both interaction-store backends, and on a file
written before the table moved out of the learner's store module (version 6; version 9 keeps the table it finds)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from learner.records.experiments_store import ExperimentStore
from learner.records.store import INTERACTIONS, SqliteStore
from runtime.adapters.experiments import Experiments
from tests.runtime.test_experiments import registry_with

OLD_FILE = Path(__file__).with_name("interactions_v6.sql")


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "sqlite":
        s = SqliteStore(tmp_path / "interactions.db")
    else:
        from learner.records.store_pg import PostgresStore

        s = PostgresStore(request.getfixturevalue("pg_url"))
    yield s
    s.close()


def test_save_updates_in_place_and_load_keeps_creation_order(store) -> None:
    exps = ExperimentStore(store)
    assert exps.load() == []
    exps.save("exp1", {"family": "f"}, {"status": "running"})
    exps.save("exp2", {"family": "g"}, {"status": "running"})
    exps.save("exp1", {"family": "f"}, {"status": "promoted", "winner": "f@2"})  # an update, not a second row
    expected = [("exp1", {"family": "f"}, {"status": "promoted", "winner": "f@2"}), ("exp2", {"family": "g"}, {"status": "running"})]
    assert exps.load() == expected
    assert ExperimentStore(store).load() == expected  # opening it again neither recreates nor empties the table


def test_experiments_survive_reopening_the_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "interactions.db"
    s = SqliteStore(path)
    ExperimentStore(s).save("e", {"family": "f", "arms": ["f@1", "f@2"]}, {"status": "running", "ünïcode": "✓"})
    s.close()
    s = SqliteStore(path)
    assert ExperimentStore(s).load() == [("e", {"family": "f", "arms": ["f@1", "f@2"]}, {"status": "running", "ünïcode": "✓"})]
    s.close()


def _old_file(tmp_path: Path) -> Path:
    path = tmp_path / "interactions.db"
    conn = sqlite3.connect(path)
    conn.executescript(OLD_FILE.read_text())
    conn.close()
    return path


def test_a_file_written_before_the_move_keeps_its_experiments_turns_and_registry(tmp_path: Path) -> None:
    path = _old_file(tmp_path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 6
    s = SqliteStore(path)
    assert s.schema_version == INTERACTIONS.version  # migrated from 6 as any file is
    [(name, config, state)] = ExperimentStore(s).load()
    assert (name, config["family"], state["champion"], state["started_at"]) == ("f-ab", "f", "f@1", 1_700_000_000.0)
    assert s.get_turn("turn-2").adapter == "lora-v3" and s.load_registry()["alias"] == {"f": {"target": "f@1"}}
    # the per-arm data still comes from the interaction store: the verifier's reward on the turn lora-v3 served
    assert s.arm_observations("lora-v3", 1_700_000_000.0)["rewards"] == [1.0]
    s.close()


def test_the_runtime_resumes_an_experiment_from_a_file_written_before_the_move(tmp_path: Path) -> None:
    s = SqliteStore(_old_file(tmp_path))
    exps = Experiments(s, registry_with("f@1", "f@2"))
    assert exps.running_for("f") is not None and exps.status("f-ab")["status"] == "running"
    exps.stop("f-ab")
    s.close()
    s = SqliteStore(tmp_path / "interactions.db")
    assert ExperimentStore(s).load()[0][2]["status"] == "stopped"  # the decision went to the same table
    s.close()


def test_a_fresh_file_gets_the_table_from_the_interaction_stores_migrations(tmp_path: Path) -> None:
    s = SqliteStore(tmp_path / "interactions.db")
    tables = {r[0] for r in s._conn().execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"experiments", "turns", "registry"} <= tables and ExperimentStore(s).load() == []
    s.close()
