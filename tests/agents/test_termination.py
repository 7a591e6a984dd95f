"""Each way an agent run ends: runs that end by the token budget, the context window and a call to one of the
client's tools (the policies' own reasons, ``max_turns`` and ``env_done`` end runs in test_loop.py), over a
scripted engine with the real loop, formatter, tools, recorder and SQLite store; and ``ending``, the one rule
that decides, over every reason."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agents.config import AgentConfig
from agents.loop import AgentLoop, RunResult
from agents.run_state import ContextTracker, Phase, RunState, Stop, ending
from agents.stop import StopDecision
from agents.t2po import T2POCounters
from learner.records.store import SqliteStore
from tests.agents._scripted import ScriptedEngine, make_client
from tools.builtins import default_registry

QUESTION = [{"role": "user", "content": "what is 2+3+4+5+6?"}]


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def call(expr: str, name: str = "calculator") -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"expression": expr}}) + "\n</tool_call>"


def run(tok, tmp_path: Path, script: list[str], *, max_model_len: int = 4096, client_tools: list[dict[str, Any]] | None = None, **cfg):
    engine = ScriptedEngine(tok, script, max_model_len=max_model_len)
    client, recorder, _ = make_client(tok, engine, tmp_path)
    loop = AgentLoop(AgentConfig(name="t-agent", tools=("calculator",), **cfg), client, default_registry(python=False, cuda=False))
    if client_tools is not None:
        loop = loop.for_client(client_tools, None)

    async def go() -> RunResult:
        try:
            return await loop.run(QUESTION, session_id="s1", seed=1)
        finally:
            await recorder.flush()

    result = asyncio.run(go())
    recorder.close()
    store = SqliteStore(tmp_path / "interactions.db")
    meta = store.get_trajectory(result.trajectory_id).meta
    store.close()
    return result, engine, meta


def test_the_token_budget_ends_a_run_between_turns(tok, tmp_path):
    per_turn = len(tok.encode(call("2+3"), add_special_tokens=False)) + 1  # + eos
    script = [call("2+3"), call("5+4"), "<answer>9</answer>"]
    result, engine, meta = run(tok, tmp_path, script, token_budget=2 * per_turn, max_turns=6)
    # two tool turns spend the budget exactly: the third model call is never made
    assert len(engine.calls) == 2 and result.turns == 2 and result.completion_tokens == 2 * per_turn
    assert result.stop_reason == "token_budget" and result.finish_reason == "length" and meta["stop_reason"] == "token_budget"
    # the second turn was asked for no more than what was left of the budget
    assert [c.sampling.max_new_tokens for c in engine.calls] == [min(384, 2 * per_turn), per_turn]


def test_the_context_window_ends_a_run_when_no_room_is_left(tok, tmp_path):
    script = [call("2+3"), call("5+4"), "<answer>9</answer>"]
    _, probe, _ = run(tok, tmp_path / "probe", script)
    second_context = len(probe.calls[1].input_ids)
    # a window one token longer than the second turn's context: fewer than 2 tokens of room, so it is not sampled
    result, engine, meta = run(tok, tmp_path / "small", script, max_model_len=second_context + 1)
    assert len(engine.calls) == 1 and result.turns == 1
    assert result.stop_reason == "context_full" and result.finish_reason == "length" and meta["stop_reason"] == "context_full"


def test_a_call_to_a_client_tool_ends_the_run_with_that_call(tok, tmp_path):
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}
    script = [call("2+3"), "Let me look it up.\n" + call("capital of France", name="lookup"), "never reached"]
    result, engine, meta = run(tok, tmp_path, script, client_tools=[lookup])
    assert len(engine.calls) == 2 and result.turns == 2  # the agent's own tool ran; the client's ends the run
    assert result.steps[0].tool_calls[0].content == "5" and not result.steps[1].tool_calls
    assert result.stop_reason == "client_tool_call" and meta["stop_reason"] == "client_tool_call"
    [made] = result.tool_calls
    assert made["name"] == "lookup" and json.loads(made["arguments"]) == {"expression": "capital of France"}
    assert result.answer == "Let me look it up."


# ---- the rule itself (agents/run_state.py: ``ending``), over hand-set states -------------------------------


def state(**kw: Any) -> RunState:
    base: dict[str, Any] = dict(
        run_id="r", trajectory_id="t", request_id="q", session_id="s", lease=None, policy=None, problem=None, env=None, branch=None,
        max_turns=3, seed=None, grammar=None, t0=0.0, msgs=[], ctx=ContextTracker([1, 2]), prompt_tokens=2, counters=T2POCounters(),
        room=100, budget=100,
    )  # fmt: skip
    return RunState(**{**base, **kw})


def decided(stop: bool) -> StopDecision:
    return StopDecision(stop=stop, reason="final_answer" if stop else "continue", answer="4" if stop else None, feedback=None,
                        format_failure=False, best_turn=0 if stop else None)  # fmt: skip


@pytest.mark.parametrize(
    ("facts", "phase", "expected"),
    [
        ({}, Phase.BEGIN, None),
        ({"turn": 3}, Phase.BEGIN, Stop("max_turns")),
        ({"turn": 3}, Phase.GENERATE, None),  # the turn cap is checked as a turn begins
        ({"room": 1}, Phase.GENERATE, Stop("context_full", finish="length")),
        ({"room": 1}, Phase.BEGIN, None),  # room and budget are measured by BEGIN, checked before sampling
        ({"budget": 0}, Phase.GENERATE, Stop("token_budget", finish="length")),
        ({"room": 1, "budget": 0}, Phase.GENERATE, Stop("context_full", finish="length")),
        ({"client_calls": ["call"]}, Phase.SCORE, Stop("client_tool_call", answered=True)),
        ({"replay_end": "env_done"}, Phase.BEGIN, Stop("env_done", answered=True)),
        ({"env_done": True}, Phase.OBSERVE, Stop("env_done", answered=True)),
        ({"decision": decided(True)}, Phase.OBSERVE, Stop("final_answer", answered=True)),
        ({"decision": decided(False)}, Phase.OBSERVE, None),
        ({"decision": decided(False), "turn": 3}, Phase.BEGIN, Stop("max_turns")),
    ],
)
def test_ending_decides_every_termination_in_one_place(facts: dict[str, Any], phase: Phase, expected: Stop | None) -> None:
    assert ending(state(**facts), phase) == expected
