"""PATR's segments through the admin runs endpoint: paused paths, continuations over the exact recorded prefix, and
whole trees grown by ``learner.patr`` against an in-process runtime (scripted engine at the edge; the app, agent
loop, FrozenLake, recorder and SQLite store are real).

The scripted engine answers by the request's sampling seed (``sample_seed * 1000 + turn``), so a path cut into
one-turn segments that all use one sample seed must see exactly what one uninterrupted run with that seed saw.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agents.tasks.frozenlake import shortest_path
from learner.config import PatrConfig, SampleConfig
from learner.patr import RuntimeStepper, grow_tree, read_nodes, tree_advantages
from learner.records.store import SqliteStore
from learner.samples import Cursor, collect_samples
from learner.sources import tree_samples
from tests.agents._scripted import ScriptedEngine
from tests.security._app import ADMIN, KEY1, auth, served

MAP = ["SFFF", "FHFH", "FFFH", "HFFG"]  # gymnasium's fixed 4x4 map
GOLD = shortest_path(MAP)
WORD = {"L": "left", "D": "down", "R": "right", "U": "up"}


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def script(req):
    sample_seed, turn = divmod(req.sampling.seed or 0, 1000)
    if sample_seed == 1:  # the gold path
        letter = GOLD[turn] if turn < len(GOLD) else "R"
    elif sample_seed == 2:  # bumps into the top wall forever
        letter = "U"
    else:
        letter = "LDRU"[(sample_seed * 7 + turn * 3) % 4]
    return f"<action>{WORD[letter]}</action>"


def host():
    from agents.host import Host
    from tools.builtins import default_registry

    agent = {"name": "fl", "task": "frozenlake", "task_options": {"map_name": "4x4"}, "max_turns": 12, "max_tokens_per_turn": 16}
    return Host([agent], default_registry(python=False, cuda=False))


@pytest.fixture
def app(tmp_path, tiny_model_path, tok):
    engine = ScriptedEngine(tok, script)
    engine.tokenizer = tok  # the app reads the tokenizer off the engine
    with served(tmp_path, tiny_model_path, engine=engine, agents=host()) as client:
        client.engine = engine
        yield client


def cont(tid: str, turn: int) -> dict:
    """A PATR branch: continue (turn = the path's length) or fork (an earlier turn) the path ending in segment ``tid``."""
    return {"trajectory_id": tid, "turn": turn, "kind": "patr"}


def post(app, body, key=ADMIN):
    path = "/admin/agents/fl/runs" if key == ADMIN else "/v1/agents/fl/runs"
    return app.post(path, json={"problem_index": 0, "seed": 0, **body}, headers=auth(key))


def store(tmp_path: Path) -> SqliteStore:
    return SqliteStore(tmp_path / "interactions.db")


def test_a_path_grown_one_segment_at_a_time_replays_byte_identical_prefixes(app, tmp_path):
    whole = post(app, {"sample_seed": 1}).json()
    assert whole["reward"] == 1.0 and whole["turns"] == len(GOLD)
    n_calls = len(app.engine.calls)
    seg = post(app, {"sample_seed": 1, "segment": {"tree": "t1", "turns": 1}}).json()
    assert seg["stop_reason"] == "paused" and seg["reward"] is None and seg["turns"] == 1
    assert seg["prefix_score"] == pytest.approx(7 / 12)  # one move down: progress 1/6 of the 6-move path, (1 + 1/6) / 2
    ids = [seg["trajectory_id"]]
    while seg["stop_reason"] == "paused":
        depth = len(seg["steps"])
        seg = post(app, {"sample_seed": 1, "segment": {"tree": "t1", "turns": 1}, "branch": cont(ids[-1], depth)}).json()
        assert [s["replayed"] for s in seg["steps"]] == [True] * depth + [False]
        ids.append(seg["trajectory_id"])
    assert seg["stop_reason"] == "env_done" and seg["reward"] == 1.0 and seg["prefix_score"] == 1.0 and len(ids) == len(GOLD)
    db = store(tmp_path)
    ref = db.get_trajectory(whole["trajectory_id"])
    segments = [db.get_trajectory(t) for t in ids]
    for k, traj in enumerate(segments):
        (turn,) = traj.turns
        assert turn.index == k
        assert turn.context_ids == ref.turns[k].context_ids  # byte-identical to the uninterrupted run's context
        assert turn.output_ids == ref.turns[k].output_ids and turn.messages == ref.turns[k].messages
        assert traj.meta["rerollout"] == "patr" and traj.meta["patr_tree"] == "t1"
        assert traj.meta["paused"] is (k < len(ids) - 1)
        assert traj.meta.get("branch_of") == (ids[k - 1] if k else None)
        if k:
            assert turn.parent_turn_id == segments[k - 1].turns[0].turn_id
    # the engine sampled each turn once more, from those same contexts (replayed turns are never generated)
    assert [list(c.input_ids) for c in app.engine.calls[n_calls:]] == [t.context_ids for t in ref.turns]
    assert [r.value for r in segments[-1].rewards if r.target == "trajectory"] == [1.0]
    assert all(not t.rewards for t in segments[:-1])  # a paused segment has no verdict
    # the live sample stream never takes the segments (the tree's own update trains on them)
    batch = collect_samples(db, family="fl", cursor=Cursor(), cfg=SampleConfig(settle_s=0.0), min_version=0)
    assert {s.trajectory_id for s in batch.samples} == {whole["trajectory_id"]}
    assert batch.counts.rerollout == len(GOLD)


def test_segments_fork_mid_path_and_refuse_what_cannot_continue(app, tmp_path):
    first = post(app, {"sample_seed": 1, "segment": {"tree": "t2", "turns": 3}}).json()
    assert first["turns"] == 3 and first["stop_reason"] == "paused"
    ref = store(tmp_path).get_trajectory(first["trajectory_id"])
    # a fork at turn 1 of the path resamples from the recorded context there
    fork = post(app, {"sample_seed": 5, "segment": {"tree": "t2", "turns": 1}, "branch": cont(first["trajectory_id"], 1)})
    assert fork.status_code == 200, fork.text
    assert list(app.engine.calls[-1].input_ids) == ref.turns[1].context_ids
    # a finished path cannot continue at its end
    done = post(app, {"sample_seed": 1, "segment": {"tree": "t2", "turns": 9}, "branch": cont(first["trajectory_id"], 3)})
    assert done.json()["stop_reason"] == "env_done"
    r = post(app, {"sample_seed": 1, "segment": {"tree": "t2", "turns": 1}, "branch": cont(done.json()["trajectory_id"], len(GOLD))})
    assert r.status_code == 409 and "ended" in r.json()["error"]["message"]
    # an ordinary run is not a PATR path, and a PATR segment is not an RTPO backbone
    plain = post(app, {"sample_seed": 3}).json()
    r = post(app, {"sample_seed": 1, "segment": {"tree": "t2"}, "branch": cont(plain["trajectory_id"], 1)})
    assert r.status_code == 409
    r = post(app, {"sample_seed": 1, "branch": {"trajectory_id": first["trajectory_id"], "turn": 1}})
    assert r.status_code == 409
    # kind patr without a segment, and segments on eval runs, are refused before anything runs
    r = post(app, {"sample_seed": 1, "branch": cont(first["trajectory_id"], 1)})
    assert r.status_code == 400
    assert post(app, {"sample_seed": 1, "eval": True, "segment": {"tree": "t2"}}).status_code == 400


def test_a_user_key_cannot_grow_segments(app):
    r = post(app, {"sample_seed": 1, "segment": {"tree": "t3", "turns": 1}}, key=KEY1)
    assert r.status_code == 403 and r.json()["error"]["param"] == "segment"


def test_a_whole_tree_through_the_runtime(app, tmp_path):
    cfg = PatrConfig(leaves=4, roots=2, branch=2, fork_rounds=2, repeat_n=3)
    stepper = RuntimeStepper("", ADMIN, agent="fl", task=None, problem_index=0, seed=0, tree="t9", client=app)
    tree = grow_tree(stepper, cfg, random.Random(4))
    assert 2 <= len(tree.leaves) <= 4 and tree.budget.failed == 0
    trajs = read_nodes(tree, store(tmp_path))
    assert set(trajs) == set(tree.nodes)
    for nid, node in tree.nodes.items():
        (turn,) = trajs[nid].turns
        if node.parent is not None:  # a child continues its parent's exact context
            (p,) = trajs[node.parent].turns
            assert turn.context_ids[: len(p.context_ids) + len(p.output_ids)] == [*p.context_ids, *p.output_ids]
    assert tree.budget.tokens == sum(len(t.turns[0].output_ids) for t in trajs.values())
    adv = tree_advantages(tree)
    samples, values = tree_samples(tree, trajs, adv, family="fl", group="patr:t9")
    assert len(samples) == len(tree.nodes) == len({s.turn_id for s in samples})  # shared prefixes: one sample each
    assert [values[i] for i, s in enumerate(samples)] == [adv[n] for n in sorted(trajs)]


def test_a_tool_path_continues_over_the_recorded_tool_result_without_running_the_tool_again(tmp_path, tiny_model_path, tok):
    import json

    from agents.host import Host
    from tools.builtins import default_registry

    calls: list[str] = []
    registry = default_registry(python=False, cuda=False)
    real = registry.call

    async def counting(name, arguments, **kw):
        calls.append(str(arguments))
        return await real(name, arguments, **kw)

    registry.call = counting  # type: ignore[method-assign]

    def calc_script(req):
        _, turn = divmod(req.sampling.seed or 0, 1000)
        if turn == 0:
            return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": "7 + 5"}}) + "\n</tool_call>"
        return "It is <answer>12</answer>"

    engine = ScriptedEngine(tok, calc_script)
    engine.tokenizer = tok
    agent = {"name": "calc", "tools": ["calculator"], "task": "calc_arith", "max_turns": 4, "max_tokens_per_turn": 48}
    with served(tmp_path, tiny_model_path, engine=engine, agents=Host([agent], registry)) as app:

        def run(body):
            r = app.post("/admin/agents/calc/runs", json={"problem_index": 0, "seed": 0, "sample_seed": 3, **body}, headers=auth(ADMIN))
            assert r.status_code == 200, r.text
            return r.json()

        whole = run({})
        assert whole["turns"] == 2 and calls == ['{"expression": "7 + 5"}']
        seg = run({"segment": {"tree": "c1"}})
        assert seg["stop_reason"] == "paused" and len(calls) == 2  # the segment's own turn ran the calculator once
        assert seg["prefix_score"] is not None
        rest = run({"segment": {"tree": "c1"}, "branch": cont(seg["trajectory_id"], 1)})
        assert len(calls) == 2  # continuing replays the recorded tool result: the tool did not run again
        assert rest["steps"][0]["replayed"] and rest["steps"][0]["observation"] == "12"
        db = store(tmp_path)
        ref = db.get_trajectory(whole["trajectory_id"])
        assert db.get_trajectory(rest["trajectory_id"]).turns[0].context_ids == ref.turns[1].context_ids
        assert rest["reward"] == whole["reward"]
