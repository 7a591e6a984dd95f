"""The frameworks' default clients against ``serve.py``'s app on a real port (tiny model): openai, openai-agents, pydantic-ai, anthropic.

The tiny model's text is random, so these tests check what the frameworks need from the server (the
shapes parse into each library's own types, tool calls round trip, constrained outputs validate,
streams assemble), with ``tool_choice`` forcing calls where a random model would not make one and
schemas a random model always finishes (enums, booleans; a free string could run past any limit).

openai-agents is imported as ``agents``, the name of loopwise's own package: its scripts run in a
subprocess outside the checkout, as a user's project would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.runtime._client import client

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False}
BRIEF = {"name": "brief-agent", "system_prompt": "Be brief.", "stop_policy": "answer", "max_turns": 1, "max_tokens_per_turn": 16}
RTOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--cors-origin", "https://app.example", "--admin-key", "fw-admin", "--agent", json.dumps(BRIEF))


def trajectory(server, tid: str) -> dict:
    r = httpx.get(f"{server.base_url}/admin/trajectories/{tid}", headers={"Authorization": "Bearer fw-admin"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_responses_plain_stream_tools_chain_and_format(server):
    c = client(server)
    r = c.responses.create(model="tiny", input="Hello", max_output_tokens=8)
    assert r.status in ("completed", "incomplete") and isinstance(r.output_text, str) and r.usage.output_tokens > 0
    with c.responses.stream(model="tiny", input="Hello", max_output_tokens=8) as s:
        events = list(s)
    # the last event is response.completed, or response.incomplete where the limit cut it, as OpenAI sends it (the SDK's
    # get_final_response() then raises: tests/runtime/test_truncated_tool_calls.py)
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == f"response.{final.status}" and text == final.output_text
    # a forced tool call, its output sent back through previous_response_id: one trajectory
    r1 = c.responses.create(model="tiny", input="Weather in Paris?", tools=RTOOLS, tool_choice="required", max_output_tokens=64)
    [call] = [o for o in r1.output if o.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    r2 = c.responses.create(
        model="tiny",
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22C"}],
        max_output_tokens=8,
    )
    t1, t2 = r1.model_extra["loopwise"], r2.model_extra["loopwise"]
    assert t1["trajectory_id"] == t2["trajectory_id"]
    turns = trajectory(server, t1["trajectory_id"])["turns"]
    assert [t["turn_id"] for t in turns] == [t1["turn_id"], t2["turn_id"]]
    # text.format json_schema: even a random model answers in the schema (constrained decoding)
    schema = {"type": "object", "properties": {"n": {"type": "boolean"}}, "required": ["n"], "additionalProperties": False}
    r3 = c.responses.create(
        model="tiny",
        input="A number",
        text={"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}},
        max_output_tokens=32,
    )
    if r3.status == "completed":
        assert set(json.loads(r3.output_text)) == {"n"}


def test_openai_completions_and_embeddings(server):
    c = client(server)
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, logprobs=2, echo=False)
    assert r.object == "text_completion" and len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    e = c.embeddings.create(model="tiny", input=["one", "two words"])
    assert len(e.data) == 2 and len(e.data[0].embedding) == len(e.data[1].embedding) > 0
    assert abs(sum(x * x for x in e.data[0].embedding) - 1) < 1e-4


def test_anthropic_sdk_plain_stream_tools(server):
    c = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    m = c.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
    assert m.type == "message" and m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    with c.messages.stream(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "".join(b.text for b in final.content if b.type == "text")
    tools = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}]
    m = c.messages.create(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "Weather?"}], tools=tools, tool_choice={"type": "any"})
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather" and set(use.input) == {"city"}
    m2 = c.messages.create(
        model="tiny",
        max_tokens=8,
        tools=tools,
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22C"}]},
        ],
    )
    assert m2.model_extra["loopwise"]["trajectory_id"] == m.model_extra["loopwise"]["trajectory_id"]


class City(BaseModel):
    name: Literal["Paris", "Rome"]
    capital: bool


def test_pydantic_ai_default_agent_with_a_tool_and_structured_output(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls: list[str] = []
    model = OpenAIResponsesModel("tiny", provider=OpenAIProvider(base_url=server.url, api_key="unused"))
    agent = Agent(model, output_type=City, instructions="Answer about cities.", model_settings={"max_tokens": 96})

    @agent.tool_plain
    def lookup(city: Literal["Paris", "Rome"]) -> str:
        """Facts about a city."""
        calls.append(city)
        return f"{city} has 2000000 people."

    result = agent.run_sync("Tell me about Paris.")
    assert isinstance(result.output, City)
    asked = [p for m in result.all_messages() if m.kind == "response" for p in m.parts if p.part_kind == "tool-call" and p.tool_name == "lookup"]
    assert len(calls) == len(asked)  # every lookup the model asked for ran, with arguments that validated


AGENTS_SCRIPT = """
import asyncio, json, sys
from openai import AsyncOpenAI
from typing import Literal
from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled

set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0), use_for_tracing=False)
seen = []

@function_tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    \"\"\"The weather in a city.\"\"\"
    seen.append(city)
    return f"sunny in {city}"

agent = Agent(
    name="weather",
    instructions="Use the tool.",
    model=sys.argv[2],
    tools=[get_weather],
    model_settings=ModelSettings(tool_choice="required", max_tokens=64),
    tool_use_behavior="stop_on_first_tool",
)
result = asyncio.run(Runner.run(agent, "Weather in Paris?"))
print(json.dumps({"final": result.final_output, "seen": seen}))
"""


@pytest.mark.parametrize("model", ["tiny", "brief-agent"], ids=["base-model", "agent-as-model"])
def test_openai_agents_default_model_runs_a_function_tool(server, tmp_path, model):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = tmp_path / "run_agent.py"
    script.write_text(textwrap.dedent(AGENTS_SCRIPT))
    p = subprocess.run([sys.executable, str(script), server.url, model], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(out["seen"]) == 1 and out["final"] == f"sunny in {out['seen'][0]}"


def test_cors_preflight_on_a_real_server(server):
    r = httpx.options(
        server.url + "/responses",
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"},
        timeout=10,
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_unknown_route_on_a_real_server(server):
    with pytest.raises(openai.NotFoundError) as ei:
        client(server).post("/responsez", cast_to=object, body={})
    assert "POST /v1/responsez" in ei.value.message and "POST /v1/responses" in ei.value.message
