"""Re-rollouts: a run branched from a recorded trajectory replays its prefix and samples from the exact stored context.

Scripted engine at the edge; the loop, formatter, tools, recorder and SQLite store are real.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agents.config import AgentConfig
from agents.loop import AgentLoop, Branch, BranchMismatch, context_sha256
from learner.store import SqliteStore
from tests.agents._scripted import ScriptedEngine, make_client
from tools.builtins import default_registry

QUESTION = [{"role": "user", "content": "what is 2+3+4+5+6?"}]


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def call(expr: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "\n</tool_call>"


def run(tok, tmp_path: Path, script, branch: Branch | None = None, max_turns: int = 6):
    engine = ScriptedEngine(tok, script)
    client, recorder, _ = make_client(tok, engine, tmp_path)
    loop = AgentLoop(AgentConfig(name="t-agent", tools=("calculator",), max_turns=max_turns), client, default_registry())

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
    turns = traj.turns
    return Branch(
        prefix_outputs=tuple(tuple(x.output_ids) for x in turns[:t]),
        context_sha256=context_sha256(turns[t].context_ids),
        parent_turn_id=turns[t - 1].turn_id if t else None,
        of=traj.trajectory_id,
        kind=kind,
    )


def test_a_branch_samples_from_the_byte_identical_stored_context(tok, tmp_path, backbone):
    result, engine = run(tok, tmp_path, [call("9+5"), "It is <answer>21</answer>"], branch=branch_at(backbone, 2))
    # the engine saw exactly the backbone's recorded context at turn 2, and the replayed turns were never generated
    assert next(list(c.input_ids) for c in engine.calls) == backbone.turns[2].context_ids
    assert len(engine.calls) == 2
    assert [s.replayed for s in result.steps] == [True, True, False, False]
    assert result.answer == "21" and result.branch_of == backbone.trajectory_id and result.branch_turn == 2
    sampled = [[*tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in (call("9+5"), "It is <answer>21</answer>")]
    assert result.completion_tokens == sum(map(len, sampled))  # sampled tokens only
    traj = SqliteStore(tmp_path / "interactions.db").get_trajectory(result.trajectory_id)
    assert [t.index for t in traj.turns] == [2, 3]  # only the sampled turns are recorded, at their turn index
    assert traj.turns[0].parent_turn_id == backbone.turns[1].turn_id
    assert traj.turns[0].context_ids == backbone.turns[2].context_ids
    assert traj.meta["branch_of"] == backbone.trajectory_id and traj.meta["branch_turn"] == 2 and traj.meta["rerollout"] == "rtpo"
    assert traj.meta["anchor"] == context_sha256(backbone.turns[2].context_ids)


def test_a_branch_at_turn_zero_is_a_fresh_sample_of_the_same_prompt(tok, tmp_path, backbone):
    result, engine = run(tok, tmp_path, ["<answer>20</answer>"], branch=branch_at(backbone, 0, kind="tcpo"), max_turns=1)
    assert list(engine.calls[0].input_ids) == backbone.turns[0].context_ids
    assert result.turns == 1 and result.rerollout == "tcpo"


def test_a_replay_that_does_not_rebuild_the_context_is_refused_before_sampling(tok, tmp_path, backbone):
    b = branch_at(backbone, 2)
    wrong = Branch(prefix_outputs=b.prefix_outputs, context_sha256="0" * 64, parent_turn_id=b.parent_turn_id, of=b.of)
    with pytest.raises(BranchMismatch, match="differs"):
        run(tok, tmp_path, [call("1+1")], branch=wrong)
    # a changed prefix (another tool call) changes the observation, so the context no longer matches either
    changed = Branch(
        prefix_outputs=(b.prefix_outputs[0], (*tuple(tok.encode(call("5+5"), add_special_tokens=False)), tok.eos_token_id)),
        context_sha256=b.context_sha256,
    )
    with pytest.raises(BranchMismatch):
        run(tok, tmp_path, [call("1+1")], branch=changed)
    before = len(SqliteStore(tmp_path / "interactions.db").list_trajectories(limit=100))
    assert before == 1  # only the backbone: refused branches record nothing


def test_a_prefix_that_ends_the_run_early_is_refused(tok, tmp_path, backbone):
    # replaying the final-answer turn stops the run before the branch turn is reached
    b = Branch(prefix_outputs=tuple(tuple(t.output_ids) for t in backbone.turns), context_sha256="0" * 64, of=backbone.trajectory_id)
    with pytest.raises(BranchMismatch, match="stopped at turn 4"):
        run(tok, tmp_path, [call("1+1")], branch=b, max_turns=8)


def test_branch_arguments_are_validated(tok, tmp_path, backbone):
    with pytest.raises(ValueError, match="not below max_turns"):
        run(tok, tmp_path, ["x"], branch=branch_at(backbone, 3), max_turns=3)
    with pytest.raises(ValueError, match="token ids"):
        run(tok, tmp_path, ["x"], branch=Branch(prefix_outputs=((10**9,),), context_sha256="0" * 64))
