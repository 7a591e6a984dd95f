"""Invalid ``<tool_call>`` markup under ``tool_choice: "auto"`` (docs/serving.md, "Tool calls"), pinned on chat
completions and the Responses API, streamed and not, in process (``create_app`` around a scripted engine that streams
token by token; everything above the engine is real).

The rule (``runtime/tool_parsers.py``): a block whose head is readable, ``{"name": "<one of the tools>", "arguments":
{``, is a call whatever follows, with the model's own text of the arguments object (up to where it closes; never
closed, up to the next tag or the end), because that is what a stream has already sent by the time the JSON turns out
invalid; a block whose head is not readable stays content, verbatim (never dropped). A streamed answer and a
non-streamed one agree, chunked however the tokens come.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from runtime.tool_parsers import get_parser
from runtime.tool_stream import ToolCallStreamer
from tests.runtime._inproc import InProc, scripted_app

USER = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
RTOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]

# model output -> (content, [(name, arguments)])
CASES: dict[str, tuple[str, str | None, list[tuple[str, str]]]] = {
    "not JSON at all": (
        "Let me see. <tool_call>\nget_weather(city='Paris')\n</tool_call>",
        "Let me see. <tool_call>\nget_weather(city='Paris')\n</tool_call>",
        [],
    ),
    "name not first": (
        '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"\n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"\n</tool_call>',
        [],
    ),
    "an unknown tool": (
        '<tool_call>\n{"name": "delete_files", "arguments": {"path": /}}\n</tool_call>',
        '<tool_call>\n{"name": "delete_files", "arguments": {"path": /}}\n</tool_call>',
        [],
    ),
    "invalid arguments": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        None,
        [("get_weather", '{"city": Paris}')],
    ),
    "arguments never closed": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        None,
        [("get_weather", '{"city": "Paris"\n')],
    ),
    "the wrapper's brace missing": (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        "Checking.",
        [("get_weather", '{"city": "Paris"}')],
    ),
    "junk after the arguments": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}} oops</tool_call>',
        "}} oops</tool_call>",
        [("get_weather", '{"city": "Paris"}')],
    ),
}
IDS = list(CASES)


def _stripped(content: str | None) -> str | None:
    return content.strip() or None if content is not None else None


@pytest.mark.parametrize("case", IDS)
@pytest.mark.parametrize("chunk", [0, 1, 3])
def test_the_stream_and_the_whole_output_are_read_the_same(case, chunk):
    text, content, calls = CASES[case]
    parser = get_parser("qwen25")
    whole = parser.parse(text, {"get_weather"})
    if whole.tool_calls:
        assert (whole.content, [(c.name, c.arguments) for c in whole.tool_calls]) == (content, calls)
    else:  # no call: the output is the content, as generated (runtime/generation.py keeps the raw text)
        assert (whole.content, calls) == (text.strip(), [])
    streamer = ToolCallStreamer(parser, {"get_weather"})
    pieces = [text] if chunk == 0 else [text[i : i + chunk] for i in range(0, len(text), chunk)]
    sent: list[tuple[Any, ...]] = []
    for piece in pieces:
        sent += streamer.feed(piece)
    sent += streamer.finish()
    streamed_calls = [(c.name, c.arguments) for c in streamer.calls()]
    assert streamed_calls == calls
    assert _stripped(streamer.content()) == _stripped(content if calls else text)
    # the deltas sent are the calls' arguments (nothing is sent that the final answer does not hold)
    for k, (_, arguments) in enumerate(calls):
        assert "".join(p[2] for p in sent if p[0] == "args" and p[1] == k) == arguments


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def serve(tokenizer, tmp_path):
    made: list[InProc] = []

    def make(script: list[str]) -> InProc:
        app, engine, store = scripted_app(tokenizer, script, tmp_path)
        srv = InProc(app)
        srv.engine, srv.store = engine, store  # type: ignore[attr-defined]
        made.append(srv)
        return srv

    yield make
    for s in made:
        s.close()


def sdk(srv: InProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key="x", http_client=srv.client, max_retries=0)


@pytest.mark.parametrize("case", IDS)
def test_chat_completions_streamed_and_not(serve, case):
    text, content, calls = CASES[case]
    srv = serve([text, text])
    c = sdk(srv)
    answer = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS)
    whole = answer.choices[0]
    got_calls = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    assert got_calls == calls
    assert whole.finish_reason == ("tool_calls" if calls else "stop")
    assert whole.message.content == (content if calls else text)  # no call: the text verbatim, markup and all
    streamed_content = ""
    streamed: dict[int, list[str]] = {}
    finish = None
    for chunk in c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, stream=True):
        for choice in chunk.choices:
            streamed_content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = streamed.setdefault(tc.index, ["", ""])
                entry[0] += (tc.function.name or "") if tc.function else ""
                entry[1] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    assert [tuple(v) for _, v in sorted(streamed.items())] == calls
    assert _stripped(streamed_content) == _stripped(whole.message.content)
    assert finish == whole.finish_reason
    # the recorded turn holds the same calls
    [turn] = srv.store.get_trajectory(answer.model_extra["loopwise"]["trajectory_id"]).turns
    assert [(x.name, x.arguments) for x in turn.tool_calls] == calls


@pytest.mark.parametrize("case", IDS)
def test_responses_streamed_and_not(serve, case):
    text, content, calls = CASES[case]
    srv = serve([text, text])
    c = sdk(srv)
    whole = c.responses.create(model="tiny", input="weather?", tools=RTOOLS)
    items = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    assert items == calls
    assert _stripped(whole.output_text) == _stripped(content if calls else text)
    with c.responses.stream(model="tiny", input="weather?", tools=RTOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == calls
    for k, (_, arguments) in enumerate(calls):
        item_id = [i.id for i in final.output if i.type == "function_call"][k]
        assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == item_id) == arguments
    assert _stripped(final.output_text) == _stripped(whole.output_text)
    if calls:  # the SDK hands the arguments over as sent; parsing them is the caller's (they may not be JSON)
        arguments = next(i.arguments for i in final.output if i.type == "function_call")
        with pytest.raises(json.JSONDecodeError) if case in ("invalid arguments", "arguments never closed") else contextlib.nullcontext():
            json.loads(arguments)
