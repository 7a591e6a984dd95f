"""The SQLite and PostgreSQL stores answer alike: the same writes on both, then every read compared answer by answer
(listing, trajectories, samples page by page, stitching lookups, owners, arm statistics, the registry, metadata
lookups), before and after deletions and pruning. What one backend may store differently (PostgreSQL replaces NUL
in text) is kept out of the data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from learner.records import Reward, ToolCallRecord, Turn, TurnCheck, TurnTimings
from learner.records.store import SqliteStore


def _turn(i: int, *, owner: str, session: str, trajectory: str, index: int, created_at: float, **kw: Any) -> Turn:
    return Turn(
        turn_id=f"turn-{i}",
        trajectory_id=trajectory,
        session_id=session,
        index=index,
        parent_turn_id=kw.get("parent"),
        completion_id=kw.get("completion") or f"cmpl-{i}",
        choice_index=kw.get("choice", 0),
        created_at=created_at,
        model="tiny",
        adapter=kw.get("adapter"),
        context_ids=list(range(i, i + 7)),
        output_ids=[i, 2**31 - 1, -5],
        logprobs=[-0.5, -1.25, -2.0],
        loss_mask=[1, 0, 1],
        sampling={"temperature": 0.5 + i / 10},
        tool_calls=[ToolCallRecord(id=f"call-{i}", name="calc", arguments="{}")] if i % 3 == 0 else [],
        finish_reason="stop",
        timings=TurnTimings(total_s=0.0 if i % 4 == 0 else 0.5 + i),
        messages=[{"role": "user", "content": f"q{i} ✓"}],
        output_text=f"a{i}",
        continuation_key=kw.get("ckey", ""),
        prefix_key=f"pk-{i % 3}",
        owner=owner,
        self_check=TurnCheck(format="svr", solution="4", verdict="correct", confidence=0.9, correct=True) if i % 5 == 0 else None,
    )


def _fill(s: Any) -> None:
    turns = []
    n = 0
    for o, owner in enumerate(("public", "key-a", "key-b")):
        for k in range(3):
            traj = f"traj-{o}-{k}"
            for j in range(3):
                n += 1
                turns.append(
                    _turn(
                        n,
                        owner=owner,
                        session="alice" if k < 2 else f"s-{o}",  # two owners' "alice" are two sessions
                        trajectory=traj,
                        index=j,
                        created_at=100.0 + 10 * k + (j // 2),  # ties: order falls back on insertion order
                        parent=f"turn-{n - 1}" if j else None,
                        completion="cmpl-shared" if j == 2 else None,
                        choice=o,
                        adapter=(None, "lora@1", "lora@2")[(n + k) % 3],
                        ckey=f"ck-{o}-{k}-{j}",
                    )
                )
    s.append_turns(turns[:10])
    s.append_turns(turns[5:])  # overlapping batch: re-appending is a no-op
    for i, t in enumerate(turns):
        if i % 2 == 0:
            s.add_reward(
                Reward(
                    reward_id=f"rw-t{i}",
                    target="turn",
                    target_id=t.turn_id,
                    value=i / 4,
                    source=("verifier:x", "judge:y", "feedback")[i % 3],
                    created_at=500.0 + (i % 4),
                    owner=t.owner,
                )
            )
    for k, traj in enumerate(("traj-0-0", "traj-1-1", "traj-2-2", "traj-0-1")):
        owner = ("public", "key-a", "key-b", "public")[k]
        s.add_reward(
            Reward(reward_id=f"rw-j{k}", target="trajectory", target_id=traj, value=-k, source="verifier:outcome", created_at=501.0, owner=owner)
        )
    first = s.add_reward(Reward(reward_id="rw-k1", target="turn", target_id="turn-1", value=9.0, idempotency_key="k", created_at=502.0))
    again = s.add_reward(Reward(reward_id="rw-k2", target="turn", target_id="turn-2", value=8.0, idempotency_key="k", created_at=503.0))
    assert first[1] and not again[1] and again[0].reward_id == "rw-k1"
    s.set_trajectory_meta("traj-0-0", {"memory": "m1", "n": 1, "ok": True})
    s.set_trajectory_meta("traj-0-2", {"memory": "m1", "trainable": False, "task_key": "calc:1"})
    s.set_trajectory_meta("traj-0-0", {"n": 2})
    s.save_registry("adapter", "lora@1", {"path": "/a/1", "hash": "h1"})
    s.save_registry("adapter", "lora@2", {"path": "/a/2", "hash": "h2"})
    s.save_registry("alias", "lora", {"target": "lora@1"})
    s.save_registry("alias", "lora", {"target": "lora@2"})
    s.save_registry("adapter", "lora@1", None)


def _reads(s: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"stats": s.stats()}
    for owner in (None, "public", "key-a"):
        for since in (None, 110.0):
            for rewarded in (None, True, False):
                out[f"list {owner} {since} {rewarded}"] = s.list_trajectories(limit=50, since=since, rewarded=rewarded, owner=owner)
    out["list limit"] = s.list_trajectories(limit=3)
    for x in s.list_trajectories(limit=100):
        traj = s.get_trajectory(x["trajectory_id"])
        out[f"trajectory {x['trajectory_id']}"] = traj.model_dump()
        for t in traj.turns:
            out[f"turn {t.turn_id}"] = s.get_turn(t.turn_id).model_dump()
            out[f"owner turn {t.turn_id}"] = s.record_owner("turn", t.turn_id)
            out[f"exists {t.turn_id}"] = [s.turn_exists(t.turn_id, o) for o in (None, "public", "key-a")]
            ref = s.find_continuation(t.session_id, t.continuation_key, t.owner)
            out[f"continuation {t.turn_id}"] = None if ref is None else ref.model_dump()
        out[f"owner trajectory {x['trajectory_id']}"] = s.record_owner("trajectory", x["trajectory_id"])
        out[f"exists {x['trajectory_id']}"] = [s.trajectory_exists(x["trajectory_id"], o) for o in (None, "public", "key-b")]
    out["no turn"] = (s.get_turn("nope"), s.get_trajectory("nope"), s.record_owner("turn", "nope"), s.find_continuation("alice", "nope"))
    for since in (None, 105.0):
        for rewarded in (None, True, False):
            for page in (1, 4, 256):
                out[f"samples {since} {rewarded} {page}"] = list(s.iter_samples(since=since, rewarded=rewarded, page_size=page))
    for owner in (None, "public", "key-a"):
        for choice in (None, 0, 1):
            out[f"completion {owner} {choice}"] = s.turns_for_completion("cmpl-shared", owner, choice)
    out["owners alice"] = s.session_owners("alice")
    out["owners nope"] = s.session_owners("nope")
    for adapter in (None, "lora@1", "lora@2"):
        for since in (0.0, 110.0):
            for source, trusted in ((None, True), (None, False), ("feedback", True), ("verifier:outcome", True)):
                out[f"arm {adapter} {since} {source} {trusted}"] = s.arm_observations(adapter, since, source, trusted_only=trusted)
    out["registry"] = s.load_registry()
    out["meta memory"] = s.trajectories_with_meta("public", "memory", "m1")
    out["meta other owner"] = s.trajectories_with_meta("key-a", "memory", "m1")
    out["meta number"] = s.trajectories_with_meta("public", "n", "2")
    out["meta bool"] = s.trajectories_with_meta("public", "ok", "true")
    return out


@pytest.fixture
def stores(tmp_path: Path, pg_url: str):
    from learner.records.store_pg import PostgresStore

    lite, pg = SqliteStore(tmp_path / "interactions.db"), PostgresStore(pg_url)
    yield lite, pg
    lite.close()
    pg.close()


def _same(lite: Any, pg: Any) -> None:
    a, b = _reads(lite), _reads(pg)
    assert a.keys() == b.keys()
    differ = [key for key in a if a[key] != b[key]]
    assert not differ, "\n".join(differ)


def test_the_backends_answer_every_read_alike(stores) -> None:
    lite, pg = stores
    for s in stores:
        _fill(s)
    _same(lite, pg)
    for s in stores:
        assert s.delete_trajectories(["traj-1-0", "traj-nope", "traj-1-0"]) == 3
        assert s.delete_session("key-b", "alice") == 6
        assert s.delete_session("key-b", "nope") == 0
        assert s.prune(older_than=1_000.0) > 0
    _same(lite, pg)
