"""A served agent used as a model by frameworks: client tools, response_format / text.format, n > 1, over every API.

In process: ``create_app`` with the real agent host (``agents.host.Host``, the calculator tool) around a
scripted engine; the loop, tool execution, recording and wire formats are real.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from transformers import AutoTokenizer

from agents.host import Host
from tests.runtime._inproc import InProc, scripted_app
from tools.builtins import default_registry

AGENT = {"name": "calc", "system_prompt": "You compute.", "tools": ["calculator"], "stop_policy": "answer", "max_turns": 4}
LOOKUP = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}},
}


def calc_call(expr: str) -> str:
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expr + '"}}\n</tool_call>'


LOOKUP_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def serve(tokenizer, tmp_path):
    made: list[InProc] = []

    def make(script):
        host = Host([AGENT], default_registry())
        app, engine, store = scripted_app(tokenizer, script, tmp_path, agents=host)
        srv = InProc(app)
        srv.engine, srv.store = engine, store
        made.append(srv)
        return srv

    yield make
    for s in made:
        s.close()


def oai(srv):
    return openai.OpenAI(base_url=srv.url, api_key="x", http_client=srv.client, max_retries=0)


def test_agent_runs_its_own_tool_then_calls_the_clients_tool(serve):
    srv = serve([calc_call("6*7"), LOOKUP_CALL, "The answer is 42."])
    c = oai(srv)
    r = c.chat.completions.create(model="calc", messages=[{"role": "user", "content": "6*7, then look up paris"}], tools=[LOOKUP])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "lookup"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"q": "paris"}
    ids = r.model_extra["loopwise"]
    assert ids["stop_reason"] == "client_tool_call" and ids["turns"] == 2
    # the agent's own calculator ran in between: its result is in the second turn's context
    assert "42" in srv.engine.tok.decode(srv.engine.calls[1].input_ids)
    assert "lookup" in srv.engine.tok.decode(srv.engine.calls[0].input_ids)  # the client's tool was offered to the model
    traj = srv.store.get_trajectory(ids["trajectory_id"])
    assert [t.tool_calls[0].name for t in traj.turns] == ["calculator", "lookup"]
    # the client runs its tool and sends the result back: a new run continues from the whole conversation
    call = choice.message.tool_calls[0]
    history = [
        {"role": "user", "content": "6*7, then look up paris"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Paris is in France."},
    ]
    r2 = c.chat.completions.create(model="calc", messages=history, tools=[LOOKUP])
    assert r2.choices[0].message.content == "The answer is 42." and r2.choices[0].finish_reason == "stop"
    assert "Paris is in France." in srv.engine.tok.decode(srv.engine.calls[2].input_ids)


def test_agent_answer_in_the_requested_format(serve):
    schema = {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"]}
    srv = serve(["It is 42.", '{"value":42}'])
    r = oai(srv).chat.completions.create(
        model="calc",
        messages=[{"role": "user", "content": "6*7?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema}},
    )
    assert json.loads(r.choices[0].message.content) == {"value": 42}
    final = srv.engine.calls[-1]
    assert final.sampling.grammar is not None and final.sampling.grammar.kind == "json_schema"
    assert "final answer in the requested JSON format" in srv.engine.tok.decode(final.input_ids)
    traj = srv.store.get_trajectory(r.model_extra["loopwise"]["trajectory_id"])
    assert len(traj.turns) == 2 and traj.turns[1].context_ids[: len(traj.turns[0].context_ids)] == traj.turns[0].context_ids
    assert traj.meta.get("trainable") is True  # the formatting turn extends the context exactly


def test_agent_forced_client_tool_and_n_runs(serve):
    srv = serve(["Thinking: 42.", LOOKUP_CALL, "a", "b", "c"])
    c = oai(srv)
    r = c.chat.completions.create(model="calc", messages=[{"role": "user", "content": "q"}], tools=[LOOKUP], tool_choice="required")
    assert r.choices[0].message.tool_calls[0].function.name == "lookup"
    assert srv.engine.calls[-1].sampling.grammar is not None and srv.engine.calls[-1].sampling.grammar.kind == "ebnf"
    r = c.chat.completions.create(model="calc", messages=[{"role": "user", "content": "q"}], n=3)
    assert sorted(ch.message.content for ch in r.choices) == ["a", "b", "c"] and [ch.index for ch in r.choices] == [0, 1, 2]
    trajs = {ch["trajectory_id"] for ch in r.model_extra["loopwise"]["choices"]}
    assert len(trajs) == 3


def test_agent_through_responses_and_messages_with_client_tools(serve):
    srv = serve([LOOKUP_CALL, LOOKUP_CALL])
    rtools = [{"type": "function", **LOOKUP["function"]}]
    r = oai(srv).responses.create(model="calc", input="look up paris", tools=rtools)
    assert r.output[-1].type == "function_call" and r.output[-1].name == "lookup"
    assert r.model_extra["loopwise"]["agent"] == "calc"
    m = anthropic.Anthropic(base_url=srv.base_url, api_key="x", http_client=srv.client, max_retries=0).messages.create(
        model="calc",
        max_tokens=100,
        messages=[{"role": "user", "content": "look up paris"}],
        tools=[{"name": "lookup", "input_schema": LOOKUP["function"]["parameters"]}],
    )
    assert m.stop_reason == "tool_use" and m.content[-1].input == {"q": "paris"}


def test_client_tool_named_like_the_agents_tool_is_a_400(serve):
    srv = serve([])
    clash = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as ei:
        oai(srv).chat.completions.create(model="calc", messages=[{"role": "user", "content": "q"}], tools=[clash])
    assert "calculator" in ei.value.body["message"]
