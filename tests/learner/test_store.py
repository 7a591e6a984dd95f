"""The interaction store on both backends (``store`` is parametrised over SQLite and PostgreSQL): round trips,
atomic batches, concurrent reads, rewards, stitching lookups, listing, deletion, pruning, the
registry's shared state, migrations (each backend's own: from an empty database and from the previous schema),
and the ``python -m learner export`` CLI."""

from __future__ import annotations

import json
import random
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from learner.records import Reward, ToolCallRecord, Turn, TurnCheck, TurnTimings
from learner.records import store as store_mod
from learner.records.experiments_store import ExperimentStore
from learner.records.migrations import Schema, SchemaTooNew, migrate_postgres, migrate_sqlite
from learner.records.store import INTERACTIONS, SqliteStore, UnknownTarget, db_path

ROOT = Path(__file__).resolve().parents[2]
# the columns before version 7 added self-checks, and before version 5 added owners: what genuine older files hold
V6_TURN_COLUMNS = store_mod.TURN_COLUMNS.removesuffix(", self_check")
OLD_TURN_COLUMNS = V6_TURN_COLUMNS.removesuffix(", owner")
OLD_REWARD_COLUMNS = store_mod.REWARD_COLUMNS.removesuffix(", owner")


def v6_turn_row(t: Turn) -> tuple:
    row = store_mod.turn_row(t)
    assert row[-1] is None and t.self_check is None
    return row[:-1]


def old_turn_row(t: Turn) -> tuple:
    row = v6_turn_row(t)
    assert row[-1] == t.owner
    return row[:-1]


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def make_turn(
    i: int,
    *,
    session: str = "sess-a",
    trajectory: str = "traj-a",
    index: int = 0,
    parent: str | None = None,
    created_at: float | None = None,
    ckey: str = "",
    content: str = "hello",
    completion: str | None = None,
    choice: int = 0,
    context_len: int = 200,
    output_len: int = 64,
) -> Turn:
    rng = random.Random(i)
    return Turn(
        turn_id=f"turn-{i}",
        trajectory_id=trajectory,
        session_id=session,
        index=index,
        parent_turn_id=parent,
        completion_id=completion or f"cmpl-{i}",
        choice_index=choice,
        created_at=1_000.0 + i if created_at is None else created_at,
        model="tiny",
        adapter=None if i % 2 else "lora-v3",
        context_ids=[rng.randrange(2**31 - 1) for _ in range(context_len)],
        output_ids=[rng.randrange(50_000) for _ in range(output_len)],
        logprobs=[f32(-rng.random() * 8) for _ in range(output_len)],
        loss_mask=[rng.randrange(2) for _ in range(output_len)],
        sampling={"temperature": 0.7, "seed": i},
        tool_calls=[ToolCallRecord(id=f"call-{i}", name="calc", arguments='{"x": 1}')] if i % 3 == 0 else [],
        finish_reason="stop",
        timings=TurnTimings(queued_s=0.5, ttft_s=0.25, total_s=1.5),
        messages=[{"role": "user", "content": content}],
        output_text=f"reply {i} ✓",
        continuation_key=ckey,
        prefix_key=f"pk-{i}",
    )


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "sqlite":
        s = SqliteStore(tmp_path / "nested" / "interactions.db")
    else:
        from learner.records.store_pg import PostgresStore

        s = PostgresStore(request.getfixturevalue("pg_url"))
    yield s
    s.close()


def raw(store, sql: str, params: tuple = ()) -> list[tuple]:
    """Run SQL on the store's own database (either backend; ``?`` placeholders)."""
    if isinstance(store, SqliteStore):
        return store._conn().execute(sql, params).fetchall()
    with store._tx() as conn:
        cur = conn.execute(sql.replace("?", "%s"), params)
        return cur.fetchall() if cur.description else []


def integrity_ok(store) -> bool:
    return store.integrity_check() == "ok" if isinstance(store, SqliteStore) else True  # PostgreSQL checks its pages itself


# -- basics ----------------------------------------------------------------------------------------------


def test_creates_parent_dirs_wal_mode_and_latest_version(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "x.db"
    s = SqliteStore(path)
    assert path.is_file()
    conn = s._conn()
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    assert conn.execute("PRAGMA secure_delete").fetchone()[0] == 1
    assert conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 4000
    assert conn.execute("PRAGMA user_version").fetchone()[0] == INTERACTIONS.version == len(INTERACTIONS.migrations) == 9
    assert s.integrity_check() == "ok"
    s.close()
    full = SqliteStore(path, synchronous_full=True)
    assert full._conn().execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    full.close()
    # WAL mode is a property of the file: a plain connection sees it too
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    raw.close()


def test_db_path_default_name() -> None:
    assert store_mod.DEFAULT_DB_NAME == "interactions.db"
    assert db_path(Path(".data")) == Path(".data") / "interactions.db"


def test_round_trip_exact(store: SqliteStore) -> None:
    turns = [make_turn(i, index=i, parent=f"turn-{i - 1}" if i else None) for i in range(5)]
    turns.append(make_turn(99, output_len=0, context_len=1).model_copy(update={"logprobs": []}))  # empty output
    store.append_turns(turns)
    for t in turns:
        got = store.get_turn(t.turn_id)
        assert got == t  # every field, token ids and float32 logprobs bit for bit
        assert got.context_ids == t.context_ids and max(t.context_ids or [0]) < 2**31
    assert store.get_turn("turn-missing") is None
    assert store.turn_exists("turn-3") and not store.turn_exists("nope")
    assert store.trajectory_exists("traj-a") and not store.trajectory_exists("traj-nope")
    assert store.stats() == {"sessions": 1, "trajectories": 1, "turns": 6, "rewards": 0}


def test_per_turn_self_checks_round_trip(store: SqliteStore) -> None:
    """An SVR turn's parsed solution, verdict, confidence and the verifier's per-turn correctness come back as
    stored (JSON in ``turns.self_check``); a turn without one stays None."""
    checks = [
        TurnCheck(format="svr", solution="42", verdict="correct", confidence=0.85, format_ok=True, correct=False),
        TurnCheck(format="svr_r1", solution="7", verdict="incorrect", format_ok=True, correct=True),
        TurnCheck(format="svr", solution="x", verdict=None, confidence=None, format_ok=False, error="missing <verdict>"),
    ]
    turns = [make_turn(i, index=i).model_copy(update={"self_check": c}) for i, c in enumerate(checks)] + [make_turn(3, index=3)]
    store.append_turns(turns)
    traj = store.get_trajectory("traj-a")
    assert [t.self_check for t in traj.turns] == [*checks, None]
    assert store.get_turn("turn-0").self_check.p_correct == 0.85 and store.get_turn("turn-1").self_check.p_correct == 0.0
    assert store.get_turn("turn-2").self_check.p_correct is None  # unparsed: no stated probability
    stored = raw(store, "SELECT self_check FROM turns WHERE turn_id = 'turn-0'")[0][0]
    assert json.loads(stored)["verdict"] == "correct" and json.loads(stored)["correct"] is False


def test_token_columns_are_packed_arrays_not_json(store: SqliteStore) -> None:
    t = make_turn(1)
    store.append_turns([t])
    ctx, out, lp, mask, sampling = raw(store, "SELECT context_ids, output_ids, logprobs, loss_mask, sampling FROM turns")[0]
    assert isinstance(ctx, bytes) and len(ctx) == 4 * 200
    assert len(out) == 4 * 64 and len(lp) == 4 * 64 and len(mask) == 64
    assert struct.unpack("<200i", ctx) == tuple(t.context_ids)  # little-endian int32
    assert json.loads(sampling) == {"temperature": 0.7, "seed": 1}


def test_arbitrary_floats_come_back_at_float32_precision(store: SqliteStore) -> None:
    values = [-0.1, -1e-7, -3.141592653589793, -123.456789]
    t = make_turn(1, output_len=4).model_copy(update={"logprobs": values})
    store.append_turns([t])
    got = store.get_turn("turn-1").logprobs
    for a, b in zip(got, values, strict=True):
        assert a == pytest.approx(b, rel=1e-6)


def test_append_is_append_only_and_idempotent(store: SqliteStore) -> None:
    t = make_turn(1, content="first")
    store.append_turns([t])
    store.append_turns([t.model_copy(update={"messages": [{"role": "user", "content": "changed"}]})])  # same id again
    assert store.get_turn("turn-1").messages == [{"role": "user", "content": "first"}]  # never updated
    assert store.stats()["turns"] == 1


def test_batch_is_atomic(store: SqliteStore) -> None:
    store.append_turns([make_turn(0, session="sess-0", trajectory="traj-0")])
    good = [make_turn(i, session="sess-new", trajectory="traj-new", index=i) for i in range(1, 6)]
    bad = make_turn(6, session="sess-new", trajectory="traj-new").model_copy(update={"context_ids": [1, 2**40]})  # not int32
    with pytest.raises(OverflowError):
        store.append_turns([*good, bad, make_turn(7, session="sess-new", trajectory="traj-new")])
    # nothing of the failed batch, not even its session/trajectory rows (inserted before the turns)
    assert store.stats() == {"sessions": 1, "trajectories": 1, "turns": 1, "rewards": 0}
    assert not store.trajectory_exists("traj-new") and not store.turn_exists("turn-1")
    if isinstance(store, SqliteStore):
        assert not store._conn().in_transaction
    store.append_turns(good)  # the store is still usable
    assert store.stats()["turns"] == 6


def test_concurrent_reads_while_a_writer_thread_appends(store: SqliteStore) -> None:
    batches, size = 40, 64
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for b in range(batches):
                store.append_turns([make_turn(b * size + i, trajectory=f"traj-{b}", index=i, context_len=50, output_len=8) for i in range(size)])
                time.sleep(0.002)
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=writer)
    th.start()
    seen: list[int] = []
    while th.is_alive():
        st = store.stats()
        seen.append(st["turns"])
        assert st["turns"] % size == 0  # a batch is visible whole or not at all
        assert st["trajectories"] == st["turns"] // size
        listed = store.list_trajectories(limit=3)
        assert all(x["turns"] == size for x in listed)
    th.join()
    assert not errors
    assert seen == sorted(seen)
    assert any(0 < n < batches * size for n in seen), seen  # reads really happened during the writes
    assert store.stats()["turns"] == batches * size
    assert integrity_ok(store)


# -- rewards --------------------------------------------------------------------------------------------


def test_rewards_idempotency_and_unknown_target(store: SqliteStore) -> None:
    store.append_turns([make_turn(1), make_turn(2, index=1, parent="turn-1")])
    r1, created = store.add_reward(Reward(target="turn", target_id="turn-1", value=0.5, source="verifier:math", idempotency_key="k1"))
    assert created
    again, created = store.add_reward(Reward(target="turn", target_id="turn-1", value=-9.0, idempotency_key="k1"))
    assert not created and again == r1 and again.value == 0.5
    r2, created = store.add_reward(Reward(target="trajectory", target_id="traj-a", value=1.0, comment="good"))
    assert created
    with pytest.raises(UnknownTarget):
        store.add_reward(Reward(target="turn", target_id="turn-nope", value=1.0))
    with pytest.raises(UnknownTarget):
        store.add_reward(Reward(target="trajectory", target_id="turn-1", value=1.0))  # a turn id is not a trajectory
    with pytest.raises(LookupError):
        store.add_reward(Reward(target="turn", target_id="traj-a", value=1.0))
    assert store.stats()["rewards"] == 2
    traj = store.get_trajectory("traj-a")
    assert [t.turn_id for t in traj.turns] == ["turn-1", "turn-2"]
    assert {r.reward_id for r in traj.rewards} == {r1.reward_id, r2.reward_id}
    assert traj.rewards[0] == r1  # the full record round-trips


def test_idempotency_key_is_unique_in_the_schema(store: SqliteStore) -> None:
    store.append_turns([make_turn(1)])
    store.add_reward(Reward(target="turn", target_id="turn-1", value=1.0, idempotency_key="dup"))
    import psycopg

    with pytest.raises((sqlite3.IntegrityError, psycopg.IntegrityError)):
        raw(
            store,
            "INSERT INTO rewards (reward_id, target, target_id, value, source, created_at, idempotency_key)"
            " VALUES ('x', 'turn', 'turn-1', 1, 's', 0, 'dup')",
        )


# -- stitching lookups -----------------------------------------------------------------------------------


def test_find_continuation_and_has_successor(store: SqliteStore) -> None:
    store.append_turns([make_turn(1, ckey="c1", index=0), make_turn(2, ckey="c2", index=1, parent="turn-1")])
    ref = store.find_continuation("sess-a", "c1")
    assert ref is not None and ref.turn_id == "turn-1" and ref.index == 0 and ref.trajectory_id == "traj-a"
    assert ref.has_successor  # turn-2 continues it in the same trajectory
    ref2 = store.find_continuation("sess-a", "c2")
    assert ref2.turn_id == "turn-2" and ref2.index == 1 and not ref2.has_successor
    assert store.find_continuation("sess-other", "c1") is None  # scoped to the session
    assert store.find_continuation("sess-a", "nope") is None
    # a child in ANOTHER trajectory (a branch) does not count as a successor
    store.append_turns([make_turn(3, ckey="c3", trajectory="traj-b", index=2, parent="turn-2")])
    assert not store.find_continuation("sess-a", "c2").has_successor
    # several matches: the newest wins
    store.append_turns([make_turn(4, ckey="same", created_at=5000.0), make_turn(5, ckey="same", created_at=6000.0, trajectory="traj-c")])
    assert store.find_continuation("sess-a", "same").turn_id == "turn-5"


def test_a_turn_is_claimed_for_continuation_once_and_its_claim_goes_with_it(store) -> None:
    store.append_turns([make_turn(1, ckey="c1"), make_turn(2, session="sess-b", trajectory="traj-b", ckey="c2")])
    assert store.claim_continuation("turn-1") is True
    assert store.claim_continuation("turn-1") is False  # one continuation per turn: a second caller branches
    assert store.claim_continuation("turn-2") is True
    assert raw(store, "SELECT turn_id FROM turn_claims ORDER BY turn_id") == [("turn-1",), ("turn-2",)]
    store.delete_session("public", "sess-a")  # a session's deletion removes its turns' claims
    store.delete_trajectories(["traj-b"])  # and so does a trajectory's
    assert raw(store, "SELECT COUNT(*) FROM turn_claims") == [(0,)]
    store.claim_continuation("turn-gone")
    assert store.prune(time.time() + 1) == 0 and raw(store, "SELECT COUNT(*) FROM turn_claims") == [(0,)]  # spent claims age out


def test_racing_claims_of_one_turn_let_one_win(store) -> None:
    store.append_turns([make_turn(1, ckey="c1")])
    barrier = threading.Barrier(8)
    won: list[bool] = []
    errors: list[BaseException] = []

    def claim() -> None:
        try:
            barrier.wait()
            won.append(store.claim_continuation("turn-1"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and sorted(won) == [False] * 7 + [True]


def test_turns_for_completion_ordered_by_choice(store: SqliteStore) -> None:
    choices = [make_turn(i, completion="cmpl-n", choice=c, trajectory=f"traj-{c}") for i, c in [(1, 2), (2, 0), (3, 1)]]
    store.append_turns([*choices, make_turn(4, completion="other")])
    assert store.turns_for_completion("cmpl-n") == ["turn-2", "turn-3", "turn-1"]
    assert store.turns_for_completion("missing") == []
    assert store.turns_for_completion("cmpl-n", choice_index=1) == ["turn-3"]
    assert store.turns_for_completion("cmpl-n", choice_index=5) == []


# -- listing ---------------------------------------------------------------------------------------------


def test_list_trajectories_filters(store: SqliteStore) -> None:
    for k in range(4):  # traj-k created at 100*k, two turns each
        store.append_turns([make_turn(10 * k + j, trajectory=f"traj-{k}", index=j, created_at=100.0 * k + j) for j in range(2)])
    store.add_reward(Reward(target="trajectory", target_id="traj-1", value=1.0))
    store.add_reward(Reward(target="turn", target_id="turn-31", value=0.0))
    store.add_reward(Reward(target="turn", target_id="turn-30", value=1.0))
    everything = store.list_trajectories()
    assert [x["trajectory_id"] for x in everything] == ["traj-3", "traj-2", "traj-1", "traj-0"]  # newest first
    assert everything[0] == {
        "trajectory_id": "traj-3",
        "session_id": "sess-a",
        "created_at": 300.0,
        "meta": {},
        "owner": "public",
        "turns": 2,
        "rewards": 2,
        "last_turn_at": 301.0,
    }
    assert everything[2]["rewards"] == 1 and everything[3]["rewards"] == 0
    assert [x["trajectory_id"] for x in store.list_trajectories(limit=2)] == ["traj-3", "traj-2"]
    assert [x["trajectory_id"] for x in store.list_trajectories(since=100.0)] == ["traj-3", "traj-2", "traj-1"]
    assert [x["trajectory_id"] for x in store.list_trajectories(rewarded=True)] == ["traj-3", "traj-1"]
    assert [x["trajectory_id"] for x in store.list_trajectories(rewarded=False)] == ["traj-2", "traj-0"]
    assert [x["trajectory_id"] for x in store.list_trajectories(rewarded=True, since=200.0)] == ["traj-3"]
    assert store.get_trajectory("traj-nope") is None


def test_iter_samples(store: SqliteStore) -> None:
    store.append_turns([make_turn(1, index=0), make_turn(2, index=1, parent="turn-1"), make_turn(3, trajectory="traj-b", created_at=5000.0)])
    store.add_reward(Reward(target="turn", target_id="turn-1", value=0.25, created_at=1.0))
    store.add_reward(Reward(target="turn", target_id="turn-1", value=0.75, created_at=2.0))
    store.add_reward(Reward(target="trajectory", target_id="traj-a", value=-1.0))
    samples = list(store.iter_samples(page_size=2))  # pages really used
    assert [s["turn_id"] for s in samples] == ["turn-1", "turn-2", "turn-3"]
    s1 = samples[0]
    t1 = store.get_turn("turn-1")
    assert s1["context_ids"] == t1.context_ids and s1["output_ids"] == t1.output_ids
    assert s1["logprobs"] == t1.logprobs and s1["loss_mask"] == t1.loss_mask
    assert (s1["index"], s1["adapter"], s1["finish_reason"], s1["session_id"]) == (0, None, "stop", "sess-a")
    assert s1["reward"] == 0.75 and s1["trajectory_reward"] == -1.0 and len(s1["rewards"]) == 3
    assert samples[1]["reward"] is None and samples[1]["trajectory_reward"] == -1.0
    assert samples[2]["reward"] is None and samples[2]["trajectory_reward"] is None and samples[2]["rewards"] == []
    assert [s["turn_id"] for s in store.iter_samples(rewarded=True)] == ["turn-1", "turn-2"]
    assert [s["turn_id"] for s in store.iter_samples(rewarded=False)] == ["turn-3"]
    assert [s["turn_id"] for s in store.iter_samples(since=1002.0)] == ["turn-2", "turn-3"]


# -- deletion -------------------------------------------------------------------------------------------


def test_delete_session_is_complete_and_overwrites_content(tmp_path: Path) -> None:
    path = tmp_path / "interactions.db"
    s = SqliteStore(path)
    marker = "SECRET-MARKER-7f3a9c"
    doomed = [make_turn(i, session="sess-doomed", trajectory=f"traj-d{i % 2}", content=marker * 50) for i in range(6)]
    kept = [make_turn(100 + i, session="sess-kept", trajectory="traj-k", content="keep me") for i in range(3)]
    s.append_turns(doomed[:3] + kept)
    s.append_turns(doomed[3:])
    s.add_reward(Reward(target="turn", target_id="turn-1", value=1.0, idempotency_key="idem-doomed"))
    s.add_reward(Reward(target="trajectory", target_id="traj-d0", value=1.0))
    s.add_reward(Reward(target="trajectory", target_id="traj-k", value=1.0))
    s._conn().execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the marker is in the main file now
    assert marker.encode() in path.read_bytes()

    assert s.delete_session("public", "sess-doomed") == 6
    conn = s._conn()
    for table in ("sessions", "trajectories", "turns"):
        assert conn.execute(f"SELECT COUNT(*) FROM {table} WHERE session_id = 'sess-doomed'").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM rewards WHERE target_id IN ('turn-1', 'traj-d0') OR idempotency_key = 'idem-doomed'").fetchone()[0] == 0
    assert s.stats() == {"sessions": 1, "trajectories": 1, "turns": 3, "rewards": 1}
    assert s.get_trajectory("traj-k").turns[0].messages == [{"role": "user", "content": "keep me"}]
    assert s.delete_session("public", "sess-doomed") == 0
    assert s.integrity_check() == "ok"
    # nothing of the deleted session is left in the file or its WAL
    wal = path.with_name(path.name + "-wal")
    raw = path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")
    assert marker.encode() not in raw
    assert b"sess-doomed" not in raw
    s.close()


def test_prune_keeps_rewarded_and_recent(store: SqliteStore) -> None:
    store.append_turns(
        [
            make_turn(1, trajectory="traj-old", created_at=10.0),
            make_turn(2, trajectory="traj-old", index=1, created_at=11.0),
            make_turn(3, trajectory="traj-turn-rewarded", created_at=10.0),
            make_turn(4, trajectory="traj-turn-rewarded", index=1, created_at=11.0),
            make_turn(5, trajectory="traj-traj-rewarded", created_at=10.0),
            make_turn(6, trajectory="traj-new", created_at=1000.0),
            make_turn(7, session="sess-old", trajectory="traj-old2", created_at=5.0),
        ]
    )
    store.add_reward(Reward(target="turn", target_id="turn-3", value=1.0))
    store.add_reward(Reward(target="trajectory", target_id="traj-traj-rewarded", value=1.0))
    assert store.prune(older_than=100.0) == 4  # turns 1, 2, 4 (its sibling's reward is per turn), 7
    assert {s["turn_id"] for s in store.iter_samples()} == {"turn-3", "turn-5", "turn-6"}
    assert not store.trajectory_exists("traj-old") and not store.trajectory_exists("traj-old2")
    assert store.trajectory_exists("traj-turn-rewarded") and store.trajectory_exists("traj-new")
    assert store.stats() == {"sessions": 1, "trajectories": 3, "turns": 3, "rewards": 2}  # sess-old is gone
    assert store.prune(older_than=100.0) == 0


# -- migrations -----------------------------------------------------------------------------------------


def test_migrates_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.write_bytes(b"")  # version 0
    s = SqliteStore(path)
    assert s._conn().execute("PRAGMA user_version").fetchone()[0] == INTERACTIONS.version
    s.append_turns([make_turn(1)])
    assert s.get_turn("turn-1") == make_turn(1)
    s.close()
    assert SqliteStore(path).stats()["turns"] == 1  # reopening does not migrate again


def test_migrates_a_genuine_v1_database(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path, isolation_level=None)
    assert migrate_sqlite(conn, INTERACTIONS, target=1) == 1  # the v1-only code path
    v1_indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "rewards_idempotency" not in v1_indexes
    turns = [make_turn(i, index=i) for i in range(3)]
    conn.executemany(f"INSERT INTO turns ({OLD_TURN_COLUMNS}) VALUES ({', '.join('?' * 22)})", [old_turn_row(t) for t in turns])
    conn.execute("INSERT INTO sessions VALUES ('sess-a', 1.0)")
    conn.execute("INSERT INTO trajectories VALUES ('traj-a', 'sess-a', 1.0)")
    cols = OLD_REWARD_COLUMNS
    # v1 had no unique index: a racing writer could store one key twice
    conn.execute(f"INSERT INTO rewards ({cols}) VALUES ('r1', 'turn', 'turn-0', 1.0, 'feedback', 1.0, NULL, 'k')")
    conn.execute(f"INSERT INTO rewards ({cols}) VALUES ('r2', 'turn', 'turn-1', 0.5, 'feedback', 2.0, 'dup', 'k')")
    conn.execute(f"INSERT INTO rewards ({cols}) VALUES ('r3', 'trajectory', 'traj-a', -1.0, 'verifier:x', 3.0, NULL, NULL)")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    conn.close()

    s = SqliteStore(path)
    c = s._conn()
    assert c.execute("PRAGMA user_version").fetchone()[0] == INTERACTIONS.version
    assert "rewards_idempotency" in {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    for t in turns:
        assert s.get_turn(t.turn_id) == t  # data intact
    traj = s.get_trajectory("traj-a")
    assert [t.turn_id for t in traj.turns] == ["turn-0", "turn-1", "turn-2"]
    assert [(r.reward_id, r.value, r.idempotency_key) for r in traj.rewards] == [("r1", 1.0, "k"), ("r2", 0.5, None), ("r3", -1.0, None)]
    assert s.stats() == {"sessions": 1, "trajectories": 1, "turns": 3, "rewards": 3}
    got, created = s.add_reward(Reward(target="turn", target_id="turn-2", value=9.0, idempotency_key="k"))
    assert not created and got.reward_id == "r1"
    assert s.integrity_check() == "ok"
    s.close()


def test_a_failing_migration_leaves_the_previous_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.db"
    SqliteStore(path).close()

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE half_done (x)")
        raise RuntimeError("boom")

    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(RuntimeError, match="boom"):
        migrate_sqlite(conn, Schema(INTERACTIONS.name, (*INTERACTIONS.migrations, (INTERACTIONS.version + 1, broken))))
    assert conn.execute("PRAGMA user_version").fetchone()[0] == INTERACTIONS.version
    assert conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name = 'half_done'").fetchone()[0] == 0  # rolled back
    conn.execute(f"PRAGMA user_version = {INTERACTIONS.version + 1}")  # as if written by a newer loopwise
    conn.close()
    with pytest.raises(SchemaTooNew):
        SqliteStore(path)


# -- export CLI -----------------------------------------------------------------------------------------


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "learner", "export", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_export_cli_jsonl(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    s = SqliteStore(db_path(data_dir))
    s.append_turns([make_turn(1), make_turn(2, index=1, parent="turn-1"), make_turn(3, trajectory="traj-b", created_at=1_767_225_600.0)])
    s.add_reward(Reward(target="turn", target_id="turn-2", value=0.5))
    expected = {t.turn_id: t for t in (s.get_turn(f"turn-{i}") for i in (1, 2, 3))}
    s.close()

    out = tmp_path / "samples.jsonl"
    proc = _export("--format", "jsonl", "--data-dir", str(data_dir), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "exported 3 samples" in proc.stderr
    lines = out.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 3
    keys = {"turn_id", "trajectory_id", "session_id", "index", "context_ids", "output_ids", "logprobs", "loss_mask", "adapter", "finish_reason"}
    keys |= {"created_at", "reward", "trajectory_reward", "rewards", "trainable", "task_key", "owner"}
    for row in rows:
        assert set(row) == keys
        t = expected[row["turn_id"]]
        assert row["context_ids"] == t.context_ids and row["output_ids"] == t.output_ids
        assert row["logprobs"] == t.logprobs and row["loss_mask"] == t.loss_mask
    assert rows[1]["reward"] == 0.5 and rows[1]["rewards"][0]["source"] == "feedback"

    proc = _export("--format", "jsonl", "--db", str(db_path(data_dir)), "--rewarded")  # stdout
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x)["turn_id"] for x in proc.stdout.splitlines()] == ["turn-2"]

    proc = _export("--format", "jsonl", "--db", str(db_path(data_dir)), "--since", "2026-01-01T00:00:00")
    assert [json.loads(x)["turn_id"] for x in proc.stdout.splitlines()] == ["turn-3"]
    proc = _export("--format", "jsonl", "--db", str(db_path(data_dir)), "--since", "1002")
    assert [json.loads(x)["turn_id"] for x in proc.stdout.splitlines()] == ["turn-2", "turn-3"]


def test_export_cli_errors(tmp_path: Path) -> None:
    SqliteStore(tmp_path / "interactions.db").close()
    proc = _export("--format", "parquet", "--data-dir", str(tmp_path))
    assert proc.returncode == 2 and "unsupported export format 'parquet'" in proc.stderr and "jsonl" in proc.stderr
    proc = _export("--format", "jsonl", "--db", str(tmp_path / "missing.db"))
    assert proc.returncode == 2 and "no interaction store" in proc.stderr
    assert not (tmp_path / "missing.db").exists()  # export never creates a store
    proc = _export("--format", "jsonl", "--data-dir", str(tmp_path), "--since", "yesterday-ish")
    assert proc.returncode == 2 and "not a Unix time" in proc.stderr


def test_migrates_a_genuine_v2_database(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    conn = sqlite3.connect(path, isolation_level=None)
    assert migrate_sqlite(conn, INTERACTIONS, target=2) == 2
    turns = [make_turn(i, index=i) for i in range(4)]
    conn.executemany(f"INSERT INTO turns ({OLD_TURN_COLUMNS}) VALUES ({', '.join('?' * 22)})", [old_turn_row(t) for t in turns])
    conn.close()
    s = SqliteStore(path)
    assert s._conn().execute("PRAGMA user_version").fetchone()[0] == INTERACTIONS.version == 9
    assert [s.get_turn(t.turn_id) for t in turns] == turns
    indexes = {r[0] for r in s._conn().execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "turns_adapter" in indexes  # version 3's index for the A/B experiments' per-arm statistics
    s.close()


def test_arm_observations_by_adapter_and_source(store) -> None:
    s = store
    turns = [make_turn(i, trajectory=f"traj-{i}", created_at=2_000.0 + i) for i in range(6)]  # even i: lora-v3, odd: base
    s.append_turns(turns)
    for t in turns:
        s.add_reward(Reward(target="turn", target_id=t.turn_id, value=float(int(t.turn_id[-1])), source="verifier:x"))
    s.add_reward(Reward(target="turn", target_id="turn-0", value=100.0, source="feedback"))
    arm = s.arm_observations("lora-v3", since=0.0, source="verifier:x")
    assert sorted(arm["rewards"]) == [0.0, 2.0, 4.0]
    assert sorted(s.arm_observations("lora-v3", since=0.0)["rewards"]) == [0.0, 2.0, 4.0]  # no metric: trusted sources only
    assert sorted(s.arm_observations("lora-v3", since=0.0, trusted_only=False)["rewards"]) == [0.0, 2.0, 4.0, 100.0]
    assert sorted(s.arm_observations(None, since=0.0, source="verifier:x")["rewards"]) == [1.0, 3.0, 5.0]  # the base model
    assert s.arm_observations("lora-v3", since=2_003.0, source="verifier:x")["rewards"] == [4.0]
    assert len(arm["latency_s"]) == 3
    # a verifier's outcome reward is on the trajectory: it counts for the arm that served the trajectory's turns
    s.add_reward(Reward(target="trajectory", target_id="traj-2", value=7.0, source="verifier:outcome"))
    s.add_reward(Reward(target="trajectory", target_id="traj-3", value=9.0, source="verifier:outcome"))
    assert s.arm_observations("lora-v3", since=0.0, source="verifier:outcome")["rewards"] == [7.0]
    assert s.arm_observations(None, since=0.0, source="verifier:outcome")["rewards"] == [9.0]
    assert sorted(s.arm_observations("lora-v3", since=0.0, trusted_only=False)["rewards"]) == [0.0, 2.0, 4.0, 7.0, 100.0]
    assert s.arm_observations("lora-v3", since=2_003.0, source="verifier:outcome")["rewards"] == []  # traj-2 is older
    # the learner's score of a user's turn (group completion) is never evidence, whatever the query
    s.add_reward(Reward(target="turn", target_id="turn-2", value=50.0, source="learner:judge:m"))
    s.add_reward(Reward(target="trajectory", target_id="traj-4", value=60.0, source="learner:hook:h"))
    assert s.arm_observations("lora-v3", since=0.0, source="learner:judge:m")["rewards"] == []
    assert sorted(s.arm_observations("lora-v3", since=0.0, trusted_only=False)["rewards"]) == [0.0, 2.0, 4.0, 7.0, 100.0]


def test_trajectory_meta_merges_and_reaches_samples(store: SqliteStore) -> None:
    store.append_turns([make_turn(j, trajectory="traj-m", index=j) for j in range(2)])
    store.set_trajectory_meta("traj-m", {"agent": "calc", "task_key": "calc_arith:7", "trainable": True})
    store.set_trajectory_meta("traj-m", {"trainable": False, "stop_reason": "verified"})
    traj = store.get_trajectory("traj-m")
    assert traj is not None
    assert traj.meta == {"agent": "calc", "task_key": "calc_arith:7", "trainable": False, "stop_reason": "verified"}
    samples = list(store.iter_samples())
    assert [(x["trainable"], x["task_key"]) for x in samples] == [(False, "calc_arith:7")] * 2
    with pytest.raises(UnknownTarget):
        store.set_trajectory_meta("traj-nope", {"x": 1})


# -- owners (version 5) ---------------------------------------------------------------------------------


def _owned(i: int, owner: str, **kw) -> Turn:
    return make_turn(i, **kw).model_copy(update={"owner": owner})


def test_sessions_are_named_per_owner(store: SqliteStore) -> None:
    store.append_turns(
        [_owned(1, "key-a", session="alice", trajectory="traj-a", ckey="c1"), _owned(2, "key-b", session="alice", trajectory="traj-b")]
    )
    assert store.stats()["sessions"] == 2  # two owners' "alice" are two sessions
    assert store.session_owners("alice") == ["key-a", "key-b"]
    assert store.find_continuation("alice", "c1", "key-a").turn_id == "turn-1"
    assert store.find_continuation("alice", "c1", "key-b") is None  # never another owner's trajectory
    assert store.get_trajectory("traj-b").owner == "key-b" and store.get_turn("turn-2").owner == "key-b"
    assert [t["trajectory_id"] for t in store.list_trajectories(owner="key-a")] == ["traj-a"]
    assert store.turn_exists("turn-1", "key-a") and not store.turn_exists("turn-1", "key-b") and store.turn_exists("turn-1")
    assert store.trajectory_exists("traj-b", "key-b") and not store.trajectory_exists("traj-b", "key-a")
    assert store.delete_session("key-b", "alice") == 1
    assert store.turn_exists("turn-1") and not store.turn_exists("turn-2")
    assert store.session_owners("alice") == ["key-a"]


def test_rewards_only_on_the_owners_records_and_idempotency_per_owner(store: SqliteStore) -> None:
    store.append_turns([_owned(1, "key-a", trajectory="traj-a"), _owned(2, "key-b", trajectory="traj-b")])
    with pytest.raises(UnknownTarget):
        store.add_reward(Reward(target="turn", target_id="turn-1", value=1.0, owner="key-b"))
    with pytest.raises(UnknownTarget):
        store.add_reward(Reward(target="trajectory", target_id="traj-a", value=1.0, owner="key-b"))
    _, created_b = store.add_reward(Reward(target="turn", target_id="turn-2", value=0.0, owner="key-b", idempotency_key="k"))
    saved_a, created_a = store.add_reward(Reward(target="turn", target_id="turn-1", value=1.0, owner="key-a", idempotency_key="k"))
    assert created_b and created_a and saved_a.target_id == "turn-1"
    again, created = store.add_reward(Reward(target="turn", target_id="turn-1", value=5.0, owner="key-a", idempotency_key="k"))
    assert not created and again.value == 1.0 and again.owner == "key-a"
    assert store.get_trajectory("traj-a").rewards[0].owner == "key-a"


def test_migrates_a_genuine_v4_database_to_owners(tmp_path: Path) -> None:
    path = tmp_path / "v4.db"
    conn = sqlite3.connect(path, isolation_level=None)
    assert migrate_sqlite(conn, INTERACTIONS, target=4) == 4
    turns = [make_turn(i, index=i, ckey=f"c{i}") for i in range(2)]
    conn.executemany(f"INSERT INTO turns ({OLD_TURN_COLUMNS}) VALUES ({', '.join('?' * 22)})", [old_turn_row(t) for t in turns])
    conn.execute("INSERT INTO sessions VALUES ('sess-a', 1.0)")
    conn.execute("INSERT INTO trajectories (trajectory_id, session_id, created_at) VALUES ('traj-a', 'sess-a', 1.0)")
    conn.execute(f"INSERT INTO rewards ({OLD_REWARD_COLUMNS}) VALUES ('r1', 'turn', 'turn-0', 1.0, 'feedback', 1.0, NULL, 'k')")
    conn.close()
    s = SqliteStore(path)
    assert s._conn().execute("PRAGMA user_version").fetchone()[0] == INTERACTIONS.version
    assert [s.get_turn(t.turn_id) for t in turns] == turns  # data intact, owner "public"
    assert s.get_trajectory("traj-a").owner == "public" and s.session_owners("sess-a") == ["public"]
    assert s.find_continuation("sess-a", "c1").turn_id == "turn-1"
    again, created = s.add_reward(Reward(target="turn", target_id="turn-1", value=0.0, idempotency_key="k"))
    assert not created and again.reward_id == "r1"
    assert s.integrity_check() == "ok"
    s.close()


# -- both backends: deletion, the registry's shared state, racing writers ---------------------


def test_delete_session_removes_every_row(store) -> None:
    doomed = [make_turn(i, session="sess-doomed", trajectory=f"traj-d{i % 2}") for i in range(4)]
    kept = [make_turn(100 + i, session="sess-kept", trajectory="traj-k") for i in range(2)]
    store.append_turns(doomed + kept)
    store.add_reward(Reward(target="turn", target_id="turn-1", value=1.0, idempotency_key="idem-doomed"))
    store.add_reward(Reward(target="trajectory", target_id="traj-d0", value=1.0))
    store.add_reward(Reward(target="trajectory", target_id="traj-k", value=1.0))
    assert store.delete_session("public", "sess-doomed") == 4
    for table in ("sessions", "trajectories", "turns"):
        assert raw(store, f"SELECT COUNT(*) FROM {table} WHERE session_id = 'sess-doomed'")[0][0] == 0
    assert raw(store, "SELECT COUNT(*) FROM rewards WHERE target_id IN ('turn-1', 'traj-d0') OR idempotency_key = 'idem-doomed'")[0][0] == 0
    assert store.stats() == {"sessions": 1, "trajectories": 1, "turns": 2, "rewards": 1}
    assert store.delete_session("public", "sess-doomed") == 0
    # the idempotency key is free again: a new reward under it is created, not a "duplicate"
    _, created = store.add_reward(Reward(target="turn", target_id="turn-100", value=0.0, idempotency_key="idem-doomed"))
    assert created
    store.set_trajectory_meta("traj-k", {"memory_id": "m1"})
    assert store.trajectories_with_meta("public", "memory_id", "m1") == ["traj-k"]
    assert store.trajectories_with_meta("other", "memory_id", "m1") == []
    assert store.delete_trajectories(["traj-k", "traj-k"]) == 2 and store.stats()["turns"] == 0


def test_registry_state_round_trip(store) -> None:
    assert store.load_registry() == {"adapter": {}, "alias": {}}
    store.save_registry("adapter", "f@1", {"path": "/a/f/v1", "sha256": "aa"})
    store.save_registry("adapter", "f@2", {"path": "/a/f/v2", "sha256": "bb"})
    store.save_registry("alias", "f", {"target": "f@1"})
    store.save_registry("alias", "f", {"target": "f@2"})
    store.save_registry("adapter", "f@1", None)
    assert store.load_registry() == {"adapter": {"f@2": {"path": "/a/f/v2", "sha256": "bb"}}, "alias": {"f": {"target": "f@2"}}}


def test_racing_rewards_with_one_idempotency_key_store_one(store) -> None:
    store.append_turns([make_turn(1)])
    results: list[tuple[Reward, bool]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def give(k: int) -> None:
        try:
            barrier.wait()
            results.append(store.add_reward(Reward(target="turn", target_id="turn-1", value=float(k), idempotency_key="same")))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=give, args=(k,)) for k in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert sum(created for _, created in results) == 1
    assert len({r.reward_id for r, _ in results}) == 1  # every caller got the one stored reward
    assert store.stats()["rewards"] == 1


# -- PostgreSQL: its own migrations -----------------------------------------------------------------------


def test_pg_migrates_an_empty_database_and_reopens_without_migrating(pg_url: str) -> None:
    from learner.records import store_pg
    from learner.records.store_pg import PostgresStore

    s = PostgresStore(pg_url)
    assert s.schema_version == store_pg.INTERACTIONS.version == INTERACTIONS.version  # the two backends' schemas are one version
    assert raw(s, "SELECT version FROM loopwise_schema") == [(INTERACTIONS.version,)]
    s.append_turns([make_turn(1)])
    s.close()
    again = PostgresStore(pg_url)
    assert raw(again, "SELECT COUNT(*) FROM loopwise_schema") == [(1,)] and again.get_turn("turn-1") == make_turn(1)
    again.close()


def test_pg_migrates_the_previous_schema(pg_url: str) -> None:
    import psycopg

    from learner.records import store_pg
    from learner.records.store_pg import PostgresStore

    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert migrate_postgres(conn, store_pg.INTERACTIONS, target=5) == 5  # a database as the previous version left it
        tables = {r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()")}
        assert "registry" not in tables and "turns" in tables
        t = make_turn(1, ckey="c1")
        conn.execute("INSERT INTO sessions VALUES ('public', 'sess-a', 1.0)")
        conn.execute("INSERT INTO trajectories (trajectory_id, session_id, created_at) VALUES ('traj-a', 'sess-a', 1.0)")
        conn.execute(f"INSERT INTO turns ({V6_TURN_COLUMNS}) VALUES ({', '.join(['%s'] * 23)})", v6_turn_row(t))
        # the experiments table as version 5 created it before learner/records/experiments_store.py owned it, with a row
        conn.execute(
            """CREATE TABLE experiments (name TEXT PRIMARY KEY, config TEXT NOT NULL, state TEXT NOT NULL,
                                         created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL)"""
        )
        conn.execute("INSERT INTO experiments VALUES ('e', '{}', '{\"status\": \"running\"}', 1.0, 1.0)")
    s = PostgresStore(pg_url)
    assert s.schema_version == INTERACTIONS.version and s.get_turn("turn-1") == t and s.find_continuation("sess-a", "c1").turn_id == "turn-1"
    assert ExperimentStore(s).load() == [("e", {}, {"status": "running"})]
    s.save_registry("alias", "f", {"target": "f@1"})
    assert s.load_registry()["alias"] == {"f": {"target": "f@1"}}
    s.close()


def test_pg_failing_migration_leaves_the_previous_version_and_newer_is_refused(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg

    from learner.records import store_pg
    from learner.records.store_pg import PostgresStore

    with psycopg.connect(pg_url, autocommit=True) as conn:
        migrate_postgres(conn, store_pg.INTERACTIONS, target=5)

    def broken(conn) -> None:
        conn.execute("CREATE TABLE half_done (x int)")
        raise RuntimeError("boom")

    monkeypatch.setattr(
        store_pg, "INTERACTIONS", Schema("loopwise_schema", tuple((v, broken if v == 6 else step) for v, step in store_pg.INTERACTIONS.migrations))
    )
    with pytest.raises(RuntimeError, match="boom"):
        PostgresStore(pg_url)
    monkeypatch.undo()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute("SELECT version FROM loopwise_schema").fetchone()[0] == 5
        assert conn.execute("SELECT to_regclass('half_done')").fetchone()[0] is None  # DDL rolled back with it
        conn.execute("UPDATE loopwise_schema SET version = 99")  # as if written by a newer loopwise
    with pytest.raises(SchemaTooNew):
        PostgresStore(pg_url)


def test_pg_concurrent_openers_migrate_once(pg_url: str) -> None:
    from learner.records.store_pg import PostgresStore

    stores: list = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            stores.append(PostgresStore(pg_url, max_size=2))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(stores) == 4
    assert raw(stores[0], "SELECT version FROM loopwise_schema") == [(INTERACTIONS.version,)]
    for s in stores:
        s.close()


def test_pg_bad_url_says_why_without_the_password() -> None:
    from learner.records.store_pg import PostgresStore

    with pytest.raises(ConnectionError) as err:
        PostgresStore("postgresql://u:hunter2@127.0.0.1:1/db", timeout_s=1)
    assert "hunter2" not in str(err.value) and "u:***@127.0.0.1:1" in str(err.value)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that takes TCP connections and never answers (a hung server, or a firewall that swallows packets):
    what a client waits longest on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # connections queue in the backlog, the startup packet is never read
        yield sock.getsockname()[1]


def test_pg_an_unreachable_server_fails_within_seconds_naming_the_host(silent_server: int) -> None:
    """Before: the pool waited its 10 s timeout, then a second connection attempt waited 10 s more (20 s in all)."""
    from learner.records.store_pg import PostgresStore

    url = f"postgresql://u:hunter2@127.0.0.1:{silent_server}/db"
    start = time.monotonic()
    with pytest.raises(ConnectionError) as err:
        PostgresStore(url)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert elapsed < 6, f"took {elapsed:.1f} s"
    assert f"cannot reach the PostgreSQL store at 127.0.0.1:{silent_server}" in message and "hunter2" not in message, message


def test_learner_export_and_run_fail_fast_on_an_unreachable_store(silent_server: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from learner.__main__ import main

    url = f"postgresql://u:hunter2@127.0.0.1:{silent_server}/db"
    for argv in (
        ["export", "--format", "jsonl", "--store", url, "--out", str(tmp_path / "out.jsonl")],
        ["run", "--store", url, "--admin-key", "k", "--base-model", str(tmp_path / "no-model"), "--data-dir", str(tmp_path)],
    ):
        start = time.monotonic()
        assert main(argv) == 2
        elapsed = time.monotonic() - start
        err = capsys.readouterr().err
        assert elapsed < 6, f"{argv[0]} took {elapsed:.1f} s"
        assert f"error: cannot reach the PostgreSQL store at 127.0.0.1:{silent_server}" in err and "hunter2" not in err, err


def test_sqlite_migrates_the_previous_schema(tmp_path: Path) -> None:
    path = tmp_path / "v5.db"
    conn = sqlite3.connect(path, isolation_level=None)
    assert migrate_sqlite(conn, INTERACTIONS, target=5) == 5
    conn.close()
    s = SqliteStore(path)
    assert s.schema_version == INTERACTIONS.version and s.load_registry() == {"adapter": {}, "alias": {}}
    s.close()


def test_sqlite_v6_turns_migrate_without_self_checks(tmp_path: Path) -> None:
    path = tmp_path / "v6.db"
    conn = sqlite3.connect(path, isolation_level=None)
    assert migrate_sqlite(conn, INTERACTIONS, target=6) == 6
    t = make_turn(1)
    conn.execute(f"INSERT INTO turns ({V6_TURN_COLUMNS}) VALUES ({', '.join('?' * 23)})", v6_turn_row(t))
    conn.close()
    s = SqliteStore(path)
    assert s.schema_version == INTERACTIONS.version and s.get_turn("turn-1") == t and s.get_turn("turn-1").self_check is None
    checked = make_turn(2).model_copy(update={"self_check": TurnCheck(format="svr", solution="3", format_ok=False, error="missing <verdict>")})
    s.append_turns([checked])
    assert s.get_turn("turn-2") == checked
    s.close()


def test_export_cli_reads_a_postgres_store(pg_url: str, tmp_path: Path) -> None:
    from learner.records.store_pg import PostgresStore

    s = PostgresStore(pg_url)
    s.append_turns([make_turn(1), make_turn(2, index=1, parent="turn-1")])
    s.add_reward(Reward(target="turn", target_id="turn-2", value=0.5))
    expected = s.get_turn("turn-2")
    s.close()
    proc = _export("--format", "jsonl", "--store", pg_url, "--rewarded")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [r["turn_id"] for r in rows] == ["turn-2"] and rows[0]["context_ids"] == expected.context_ids and rows[0]["reward"] == 0.5
    s = PostgresStore(pg_url)
    ExperimentStore(s).save("e1", {"family": "f", "arms": [{"adapter": "f@1"}, {"adapter": "f@2"}]}, {"status": "running", "started_at": 0.0})
    s.close()
    rep = subprocess.run(
        [sys.executable, "-m", "learner", "report", "--data-dir", str(tmp_path), "--store", pg_url, "--out", str(tmp_path / "r.html")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rep.returncode == 0 and "1 experiment(s)" in rep.stderr, rep.stderr
    proc = _export("--format", "jsonl", "--store", "postgresql://u:hunter2@127.0.0.1:1/nope")
    assert proc.returncode == 2 and "cannot reach the PostgreSQL store" in proc.stderr and "hunter2" not in proc.stderr


def test_a_nul_in_text_fails_no_batch(store: SqliteStore) -> None:
    """PostgreSQL text cannot hold U+0000: a model's output (or a client's id) with a NUL must not fail the batch it is
    written with; the other turns of that batch are stored, and the text reads back with U+FFFD there (as is on SQLite)."""
    nul = make_turn(1).model_copy(update={"output_text": "a\x00b", "session_id": "sess\x00x"})
    store.append_turns([nul, make_turn(2)])
    got = store.get_turn("turn-1")
    assert got is not None and store.get_turn("turn-2") is not None
    assert got.output_text == ("a\ufffdb" if getattr(store, "shared", False) else "a\x00b")
    assert got.output_ids == nul.output_ids  # the exact tokens are bytes, untouched
