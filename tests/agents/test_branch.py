"""Re-rollouts: a run branched from a recorded trajectory replays its recorded prefix (outputs and observations,
no tool running again) and samples from the exact stored context.

Scripted engine at the edge; the loop, formatter, tools, recorder and SQLite store are real.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agents.config import AgentConfig
from agents.loop import AgentLoop, BranchMismatch, context_sha256
from agents.run_state import Branch
from learner.records.store import SqliteStore
from tests.agents._scripted import ScriptedEngine, make_client
from tools.builtins import default_registry

QUESTION = [{"role": "user", "content": "what is 2+3+4+5+6?"}]


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def call(expr: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "\n</tool_call>"


TOOL_CALLS: list[str] = []  # arguments of every calculator call the loop made


def counting_registry():
    registry = default_registry(python=False, cuda=False)
    real = registry.call

    async def call(name, arguments, **kw):
        TOOL_CALLS.append(str(arguments))
        return await real(name, arguments, **kw)

    registry.call = call  # type: ignore[method-assign]
    return registry


def run(tok, tmp_path: Path, script, branch: Branch | None = None, max_turns: int = 6, system: str | None = None):
    engine = ScriptedEngine(tok, script)
    client, recorder, _ = make_client(tok, engine, tmp_path)
    config = AgentConfig(name="t-agent", tools=("calculator",), max_turns=max_turns, **({"system_prompt": system} if system else {}))
    loop = AgentLoop(config, client, counting_registry())

    async def go():
        try:
            return await loop.run(QUESTION, session_id="s1", seed=3, branch=branch)
        finally:
            await recorder.flush()

    try:
        return asyncio.run(go()), engine
    finally:
        recorder.close()


@pytest.fixture
def backbone(tok, tmp_path):
    script = [call("2+3"), call("5+4"), call("9+5"), call("14+6"), "The sum is <answer>20</answer>"]
    result, _ = run(tok, tmp_path, script)
    return SqliteStore(tmp_path / "interactions.db").get_trajectory(result.trajectory_id)


def branch_at(traj, t: int, kind: str = "rtpo") -> Branch:
    return Branch(backbone=tuple(traj.turns[: t + 1]), turn=t, of=traj.trajectory_id, kind=kind)


def test_a_branch_samples_from_the_byte_identical_stored_context(tok, tmp_path, backbone):
    TOOL_CALLS.clear()
    result, engine = run(tok, tmp_path, [call("9+5"), "It is <answer>21</answer>"], branch=branch_at(backbone, 2))
    # the engine saw exactly the backbone's recorded context at turn 2, and the replayed turns were never generated
    assert next(list(c.input_ids) for c in engine.calls) == backbone.turns[2].context_ids
    assert len(engine.calls) == 2
    # the replayed turns' tool calls were not run again: only the sampled turn 2's call ran
    assert TOOL_CALLS == ['{"expression": "9+5"}']
    assert [s.replayed for s in result.steps] == [True, True, False, False]
    assert result.steps[0].observation == "5" and result.steps[1].observation == "9"  # the recorded tool results
    assert result.answer == "21" and result.branch_of == backbone.trajectory_id and result.branch_turn == 2
    sampled = [[*tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in (call("9+5"), "It is <answer>21</answer>")]
    assert result.completion_tokens == sum(map(len, sampled))  # sampled tokens only
    traj = SqliteStore(tmp_path / "interactions.db").get_trajectory(result.trajectory_id)
    assert [t.index for t in traj.turns] == [2, 3]  # only the sampled turns are recorded, at their turn index
    assert traj.turns[0].parent_turn_id == backbone.turns[1].turn_id
    assert traj.turns[0].context_ids == backbone.turns[2].context_ids
    assert traj.turns[0].messages == backbone.turns[2].messages  # the conversation continues from the recorded one
    assert traj.meta["branch_of"] == backbone.trajectory_id and traj.meta["branch_turn"] == 2 and traj.meta["rerollout"] == "rtpo"
    assert traj.meta["anchor"] == context_sha256(backbone.turns[2].context_ids)


def test_the_recorded_observations_are_replayed_not_recomputed(tok, tmp_path, backbone):
    """A doctored record shows what is replayed: the branch's context is the stored one, whatever a tool would say now."""
    doctored = [t.model_copy(update={"context_ids": [*t.context_ids[:-3], 7, 7, 7]}) if t.index == 2 else t for t in backbone.turns]
    b = Branch(backbone=tuple(doctored[:3]), turn=2, of=backbone.trajectory_id)
    _, engine = run(tok, tmp_path, ["<answer>20</answer>"], branch=b)
    assert list(engine.calls[0].input_ids) == doctored[2].context_ids


def test_a_branch_at_turn_zero_is_a_fresh_sample_of_the_same_prompt(tok, tmp_path, backbone):
    result, engine = run(tok, tmp_path, ["<answer>20</answer>"], branch=branch_at(backbone, 0, kind="tcpo"), max_turns=1)
    assert list(engine.calls[0].input_ids) == backbone.turns[0].context_ids
    assert result.turns == 1 and result.rerollout == "tcpo"


def test_a_changed_agent_is_refused_before_sampling(tok, tmp_path, backbone):
    with pytest.raises(BranchMismatch, match="first context differs"):
        run(tok, tmp_path, [call("1+1")], branch=branch_at(backbone, 2), system="You are a different agent now.")
    before = len(SqliteStore(tmp_path / "interactions.db").list_trajectories(limit=100))
    assert before == 1  # only the backbone: refused branches record nothing


def test_branch_arguments_are_validated(tok, tmp_path, backbone):
    with pytest.raises(ValueError, match="not below max_turns"):
        run(tok, tmp_path, ["x"], branch=branch_at(backbone, 3), max_turns=3)
    with pytest.raises(ValueError, match="not one of the backbone"):
        run(tok, tmp_path, ["x"], branch=Branch(backbone=tuple(backbone.turns[:2]), turn=2))
