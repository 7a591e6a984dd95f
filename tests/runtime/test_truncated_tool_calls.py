"""A forced tool call cut by the token limit, on every API, streamed and not, with the real ``openai`` client on a real port.

A forced call (``tool_choice`` naming a function, or ``required``) is decoded under a grammar; when ``max_tokens`` cuts
it, the answer is still a tool call, its arguments the text produced so far (possibly incomplete JSON, as vLLM and
OpenAI send it), with ``finish_reason: "length"``, never ``<tool_call>`` markup as content. The Responses API says
``status: "incomplete"`` (``incomplete_details.reason: "max_output_tokens"``), and a cut Responses stream ends with
``response.incomplete``, as OpenAI's does: the SDK's ``get_final_response()`` then raises (it waits for
``response.completed``), and openai-agents raises on it in a streamed run as in a non-streamed one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.runtime._client import MODEL, USER, client

WEATHER = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast.", "parameters": WEATHER}}]
FUNCTIONS = [{"name": "get_weather", "description": "Weather forecast.", "parameters": WEATHER}]
RTOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast.", "parameters": WEATHER}]
CHOICES = {"named": {"type": "function", "function": {"name": "get_weather"}}, "required": "required"}
RCHOICES = {"named": {"type": "function", "name": "get_weather"}, "required": "required"}
CUTS = [16, 40]  # a forced call to get_weather takes some 60 tokens of the tiny model: cut before its arguments, and in them


@pytest.fixture(scope="module")
def oai(served) -> Any:
    return client(served)


def _partial(arguments: str) -> None:
    """Arguments cut short: the start of the compact JSON object the grammar admits (or nothing yet), never markup. The
    cut usually leaves the object unfinished; a sample that closed it just before the cut (before the call's own end:
    possible where the engine ignores the seed, as real SGLang on CPU) leaves the whole object, which must then parse."""
    assert isinstance(arguments, str) and "<tool_call>" not in arguments and "</tool_call>" not in arguments, arguments
    assert arguments == "" or arguments.startswith("{"), arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return  # the cut left the call unfinished
    assert isinstance(parsed, dict), arguments


def _no_markup(text: str | None) -> None:
    assert not text or "<tool_call" not in text, text


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("how", ["named", "required"])
def test_chat_cut_call_is_a_tool_call_streamed_or_not(oai, how, cut):
    kw: dict[str, Any] = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": CHOICES[how], "max_tokens": cut, "seed": 3}
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == cut
    _no_markup(choice.message.content)
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    _partial(call.function.arguments)
    # streamed: a call in deltas (not compared token for token with the run above: under concurrent load the batch differs,
    # and the grammar admits several tokenizations of the forced text)
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].id and deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}
    _partial("".join(d.function.arguments or "" for d in deltas))
    assert all(not (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


@pytest.mark.parametrize("cut", CUTS)
def test_legacy_functions_cut_call_is_a_function_call(oai, cut):
    kw: dict[str, Any] = {"model": MODEL, "messages": USER, "functions": FUNCTIONS, "function_call": {"name": "get_weather"}, "max_tokens": cut}
    r = oai.chat.completions.create(**kw, seed=5)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    _no_markup(choice.message.content)
    assert choice.message.function_call.name == "get_weather" and not choice.message.tool_calls
    _partial(choice.message.function_call.arguments)
    chunks = list(oai.chat.completions.create(**kw, seed=5, stream=True))
    calls = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert calls and calls[0].name == "get_weather"
    _partial("".join(f.arguments or "" for f in calls))
    assert all(not (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("how", ["named", "required"])
def test_responses_cut_call_is_an_incomplete_function_call_streamed_or_not(oai, how, cut):
    kw: dict[str, Any] = {"model": MODEL, "input": "Weather?", "tools": RTOOLS, "tool_choice": RCHOICES[how], "max_output_tokens": cut}
    r = oai.responses.create(**kw, extra_body={"seed": 3})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    _partial(call.arguments)
    assert r.output_text == ""
    # streamed: the same call in argument deltas, and the stream ends with response.incomplete
    with oai.responses.stream(**kw, extra_body={"seed": 3}) as stream:
        events = list(stream)
        with pytest.raises(RuntimeError, match="response.completed"):
            stream.get_final_response()  # the SDK's helper waits for response.completed, as with OpenAI's own cut streams
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    assert "response.output_text.delta" not in kinds
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    [item] = final.output
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "incomplete"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == item.arguments
    [done] = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete" and done.item.arguments == item.arguments
    _partial(item.arguments)
    assert oai.responses.retrieve(final.id).status == "incomplete"


def test_responses_cut_text_stream_ends_with_response_incomplete(oai):
    kw: dict[str, Any] = {"model": MODEL, "input": "Hello", "max_output_tokens": 3, "temperature": 0}
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        with pytest.raises(RuntimeError, match="response.completed"):
            stream.get_final_response()
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    # a stream the model ends by itself still ends with response.completed
    with oai.responses.stream(model=MODEL, input="Weather?", tools=RTOOLS, tool_choice="required", max_output_tokens=120) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output[0].arguments)


AGENTS_SCRIPT = """
import asyncio, json, sys
from openai import AsyncOpenAI
from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled

set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0), use_for_tracing=False)

@function_tool
def get_weather(unit: str, days: int) -> str:
    \"\"\"The weather forecast.\"\"\"
    return "sunny"

agent = Agent(name="w", instructions="Use the tool.", model="tiny", tools=[get_weather],
              model_settings=ModelSettings(tool_choice="required", max_tokens=16))

async def both():
    out = {}
    try:
        await Runner.run(agent, "Weather?")
        out["run"] = None
    except Exception as exc:
        out["run"] = type(exc).__name__
    try:
        streamed = Runner.run_streamed(agent, "Weather?")
        async for _ in streamed.stream_events():
            pass
        out["streamed"] = None
    except Exception as exc:
        out["streamed"] = type(exc).__name__
    return out

print(json.dumps(asyncio.run(both())))
"""


def test_openai_agents_streamed_run_raises_on_a_cut_response_as_a_run_does(served, backend, tmp_path):
    if backend != "embedded":
        pytest.skip("one backend is enough: the Responses stream is the same above the engine")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # openai-agents is `agents`, as loopwise's package is
    script = tmp_path / "run_agent.py"
    script.write_text(textwrap.dedent(AGENTS_SCRIPT))
    p = subprocess.run([sys.executable, str(script), served.url], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    if "No module named 'agents'" in p.stderr:
        pytest.skip("openai-agents is not installed")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["run"] is not None and out["streamed"] == out["run"], out


# ---- the parser and the streamer, without a server -------------------------------------------------

TWO = {"get_weather", "get_time"}


@pytest.mark.parametrize("parser", ["qwen25", "llama3"])
@pytest.mark.parametrize(
    ("produced", "names", "want"),
    [
        ("", {"get_weather"}, ("get_weather", "")),  # one tool possible: the call, nothing of its arguments yet
        ("", TWO, None),  # not yet known which tool: no call (and no text either)
        ('{"name": "get_', TWO, None),
        ('{"name": "get_w', TWO, ("get_weather", "")),
        ('{"name": "get_weather", "ARGS": {"unit": "cel', TWO, ("get_weather", '{"unit": "cel')),
        ('{"name": "get_weather", "ARGS": {"unit": "celsius", "days": 3}', TWO, ("get_weather", '{"unit": "celsius", "days": 3}')),
        ('{"name": "get_weather", "ARGS": {"unit": "}"}}END', TWO, ("get_weather", '{"unit": "}"}')),
    ],
)
def test_parse_cut_reads_a_forced_call_as_far_as_it_goes(parser, produced, names, want):
    from runtime.tool_parsers import get_parser

    p = get_parser(parser)
    assert p.forced is not None
    text = p.forced.prefix + produced.replace("ARGS", p.forced.args_key).replace("END", p.forced.suffix[:4])
    if not produced:
        text = p.forced.prefix[:3]  # cut inside the call's opening marker
    got = p.parse_cut(text, names)
    assert got.content is None
    assert [(c.name, c.arguments) for c in got.tool_calls] == ([want] if want else [])


@pytest.mark.parametrize("parser", ["qwen25", "llama3"])
@pytest.mark.parametrize("split", [1, 5, 13, 30, 1000])
def test_a_streamed_cut_call_is_the_same_call(parser, split):
    from runtime.tool_parsers import get_parser
    from runtime.tool_stream import ToolCallStreamer

    p = get_parser(parser)
    assert p.forced is not None
    text = p.forced.head("get_weather") + '{"unit": "fahr'
    s = ToolCallStreamer(p, TWO, forced_names=TWO)
    pieces = s.feed(text[:split]) + s.feed(text[split:]) + s.finish(cut=True)
    assert not [x for x in pieces if x[0] == "text"] and s.content() is None
    [call] = s.calls()
    assert (call.name, call.arguments) == ("get_weather", '{"unit": "fahr') == (p.parse_cut(text, TWO).tool_calls[0].name, call.arguments)
    assert "".join(x[2] for x in pieces if x[0] == "args") == call.arguments
    # an unforced stream cut the same way keeps its old behaviour: a started call stays a call, held text is text
    s = ToolCallStreamer(p, TWO)
    pieces = s.feed(text) + s.finish(cut=True)
    assert bool(s.calls()) == (parser == "qwen25")
