"""The OpenAI-compatible surface of ``serve.py``'s app on a real port, driven with the ``openai`` SDK and raw httpx.

The tiny model is random: greedy decoding from it is deterministic but monotonous (mostly newlines),
so checks that need varied text use ``temperature=1`` with a ``seed``, which the server promises to
reproduce exactly. Constrained outputs (forced tool calls, ``response_format``) use bounded schemas
(enums, booleans, integers with a range) so that a random model always finishes them.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from _client import MODEL, USER, aclient, chat_body, client, metrics, post_chat, stream_chat, wait_for_metric

LIGHT = {
    "type": "object",
    "properties": {
        "room": {"type": "string", "enum": ["kitchen", "hall", "garage"]},
        "on": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["room", "on", "level"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "set_light", "description": "Switch a light.", "parameters": LIGHT}},
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast.", "parameters": WEATHER}},
]
SCHEMAS = {"set_light": LIGHT, "get_weather": WEATHER}
ANSWER = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 1, "maximum": 99},
        "grade": {"type": "string", "enum": ["a", "b", "c"]},
    },
    "required": ["ok", "score", "grade"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def oai(served) -> openai.OpenAI:
    """A client of the shared tiny server on each backend (``served`` is parametrized over embedded and sglang)."""
    return client(served)


# ---- non-streamed -------------------------------------------------------------------------------


@pytest.mark.seeded
def test_non_streamed_completion_shape(served, oai):
    before = time.time()
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert r.id.startswith("chatcmpl-") and len(r.id) > len("chatcmpl-")
    assert r.object == "chat.completion"
    assert isinstance(r.created, int) and before - 5 <= r.created <= time.time() + 5
    assert r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.message.tool_calls is None
    assert choice.logprobs is None
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    # the same request raw: exact JSON keys, nothing FastAPI-ish
    raw = post_chat(served, chat_body(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))
    assert raw.status_code == 200
    assert raw.headers["content-type"] == "application/json"
    body = raw.json()
    assert set(body) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage", "loopwise"}
    assert set(body["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
    assert body["choices"][0]["message"]["content"] == choice.message.content  # seeded: same text
    assert body["usage"] == {
        "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": 8,
        "total_tokens": r.usage.prompt_tokens + 8,
    }
    assert body["id"] != r.id


def test_finish_reason_stop_usage_is_consistent(oai):
    # a grammar-constrained output ends by itself, before max_tokens
    r = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens < 100
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_max_completion_tokens_is_honoured(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


# ---- streaming ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0, "seed": 11}, pytest.param({"temperature": 1.0, "seed": 11}, marks=pytest.mark.seeded)], ids=["greedy", "seeded"]
)
def test_stream_via_sdk_matches_non_streamed(oai, sampling):
    kw: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 24, "extra_body": {"ignore_eos": True}, **sampling}
    full = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    assert len(chunks) >= 3
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length"
    assert last.delta.content is None and last.delta.role is None and last.delta.tool_calls is None
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == full.choices[0].message.content
    assert len(streamed) > 0


@pytest.mark.seeded
def test_stream_raw_sse_with_include_usage(served):
    body = chat_body(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
    full = post_chat(served, body).json()
    sse = stream_chat(served, {**body, "stream_options": {"include_usage": True}})
    assert sse.status == 200
    assert sse.headers["content-type"].startswith("text/event-stream")
    assert sse.done, "stream must end with data: [DONE]"
    events = sse.events
    base_keys = {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    finish_chunks = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert all(set(e) == base_keys for e in events if e not in finish_chunks)
    assert all(set(e) == base_keys | {"loopwise"} for e in finish_chunks)  # the recorded ids ride on the finish chunk
    assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL for e in events)
    # every chunk has usage null except the final one, which has no choices
    assert all(e["usage"] is None for e in events[:-1])
    final = events[-1]
    assert final["choices"] == []
    assert final["usage"] == {
        "prompt_tokens": full["usage"]["prompt_tokens"],
        "completion_tokens": 20,
        "total_tokens": full["usage"]["prompt_tokens"] + 20,
    }
    choice_events = events[:-1]
    assert all(len(e["choices"]) == 1 for e in choice_events)
    assert choice_events[0]["choices"][0] == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    assert choice_events[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all(e["choices"][0]["finish_reason"] is None for e in choice_events[:-1])
    assert sse.content() == full["choices"][0]["message"]["content"]


def test_stream_without_include_usage_has_no_usage(served):
    sse = stream_chat(served, chat_body(max_tokens=4, temperature=0))
    assert sse.status == 200 and sse.done
    assert all("usage" not in e or e["usage"] is None for e in sse.events)
    assert all(e["choices"] for e in sse.events)  # no usage-only chunk


# ---- n ------------------------------------------------------------------------------------------


def test_n2_non_streamed(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, n=2, max_tokens=12, temperature=1.0, seed=21, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in r.choices)
    assert r.choices[0].message.content != r.choices[1].message.content  # each choice samples on its own
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24


@pytest.mark.seeded
def test_n2_streamed(served):
    body = chat_body(n=2, max_tokens=12, temperature=1.0, seed=21, ignore_eos=True)
    full = post_chat(served, body).json()
    sse = stream_chat(served, {**body, "stream_options": {"include_usage": True}})
    assert sse.status == 200 and sse.done
    per_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for e in sse.choice_events():
        assert len(e["choices"]) == 1
        per_index[e["choices"][0]["index"]].append(e["choices"][0])
    for i in (0, 1):
        seq = per_index[i]
        assert seq[0]["delta"] == {"role": "assistant", "content": ""}
        finishes = [c for c in seq if c["finish_reason"] is not None]
        assert finishes == [seq[-1]] and seq[-1]["finish_reason"] == "length" and seq[-1]["delta"] == {}
        assert sse.content(i) == full["choices"][i]["message"]["content"]
    assert sse.events[-1]["choices"] == [] and sse.events[-1]["usage"]["completion_tokens"] == 24


# ---- logprobs -----------------------------------------------------------------------------------


def _check_logprobs(content: list[Any], top_n: int) -> None:
    for item in content:
        assert isinstance(item.token, str)
        assert item.logprob <= 0
        assert isinstance(item.bytes, list) and all(0 <= b < 256 for b in item.bytes)
        if "\ufffd" not in item.token:  # a token that is part of a UTF-8 character decodes to U+FFFD on its own
            assert item.bytes == list(item.token.encode("utf-8"))
        assert len(item.top_logprobs) == top_n
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        assert len({(t.token, t.logprob) for t in item.top_logprobs}) == top_n


def test_logprobs_greedy(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    _check_logprobs(content, 3)
    for item in content:  # greedy: the chosen token is the most likely one
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)
        assert item.token == item.top_logprobs[0].token
    assert "".join(i.token for i in content) == choice.message.content


@pytest.mark.seeded
def test_logprobs_sampled_and_streamed(served, oai):
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 8,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True},
    }
    r = oai.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 10
    _check_logprobs(content, 3)
    for item in content:  # sampled: never more likely than the most likely token
        assert item.logprob <= item.top_logprobs[0].logprob + 1e-6
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in (c.choices[0].logprobs.content or [])]
    assert [(x.token, round(x.logprob, 4)) for x in streamed] == [(x.token, round(x.logprob, 4)) for x in content]


def test_no_logprobs_unless_asked(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0)
    assert r.choices[0].logprobs is None


# ---- seeds and stop strings ---------------------------------------------------------------------


@pytest.mark.seeded
def test_seed_reproducibility(oai):
    def run(seed: int) -> str:
        r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=32, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 32
        return r.choices[0].message.content

    a1, a2, b = run(1234), run(1234), run(98765)
    assert a1 == a2
    assert a1 != b


def _pick_stop(text: str) -> str:
    """A 3-character alphanumeric substring from the middle third of ``text`` that does not start it."""
    third = len(text) // 3
    for i in list(range(third, 2 * third)) + list(range(1, len(text))):
        cand = text[i : i + 3]
        if len(cand) == 3 and cand.isascii() and cand.isalnum() and text.find(cand) > 0:
            return cand
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.seeded
def test_stop_string(served, oai):
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 48,
        "temperature": 1.0,
        "seed": 77,
        "extra_body": {"ignore_eos": True},
    }
    text = oai.chat.completions.create(**kw).choices[0].message.content
    stop = _pick_stop(text)
    prefix = text[: text.find(stop)]
    r = oai.chat.completions.create(stop=stop, **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == prefix
    assert r.usage.completion_tokens < 48
    # a list of stops: the one that occurs first wins; streamed output is cut the same way
    r2 = oai.chat.completions.create(stop=["never-in-this-text", stop], **kw)
    assert (r2.choices[0].message.content, r2.choices[0].finish_reason) == (prefix, "stop")
    sse = stream_chat(served, chat_body(max_tokens=48, temperature=1.0, seed=77, ignore_eos=True, stop=[stop]))
    assert sse.content() == prefix
    assert sse.choice_events()[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_string_greedy(oai):
    # greedy output of the tiny model starts with a newline; stopping on it leaves nothing
    kw: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 16, "temperature": 0}
    text = oai.chat.completions.create(**kw).choices[0].message.content
    assert text
    r = oai.chat.completions.create(stop=text[0], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ""


# ---- tools --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tool_choice_required(oai, seed):
    r = oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=120, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert call.id and isinstance(call.id, str)
    assert call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.utf8_strings
def test_a_forced_call_with_a_length_bounded_argument_is_always_a_tool_call(oai):
    """pydantic's Field(max_length=40) in a function tool (openai-agents users write it): the random tiny model sampled raw
    control characters into the bounded string about one time in five, and the call came back as text."""
    params = {"type": "object", "properties": {"expr": {"type": "string", "maxLength": 40}}, "required": ["expr"]}
    tools = [{"type": "function", "function": {"name": "calc", "parameters": params}}]
    for seed in range(20):
        r = oai.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice="required", max_tokens=80, seed=seed, temperature=1.0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), params)


@pytest.mark.parametrize("name", ["set_light", "get_weather"])
def test_tool_choice_named(oai, name):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=120,
        seed=4,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])


def test_tool_choice_required_streamed(served, oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=120, seed=6, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas, "no tool_calls deltas"
    assert {d.index for d in deltas} == {0}
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name in SCHEMAS
    name = deltas[0].function.name
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not (c.choices[0].delta.content or "") for c in chunks)  # a forced call shows no content
    # the raw stream carries the same call shape
    sse = stream_chat(served, chat_body(tools=TOOLS, tool_choice="required", max_tokens=120, seed=6))
    raw_calls = [tc for e in sse.choice_events() for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert raw_calls and set(raw_calls[0]) == {"index", "id", "type", "function"}
    # the second request samples afresh (real SGLang on CPU ignores seeds), so it may call the other tool
    raw_name = raw_calls[0]["function"]["name"]
    assert raw_name in SCHEMAS
    jsonschema.validate(json.loads("".join(c["function"].get("arguments") or "" for c in raw_calls)), SCHEMAS[raw_name])


def test_tool_schema_with_defs_and_refs(oai):
    # pydantic-style schemas put shared definitions in $defs and point at them with $ref
    params = {
        "$defs": {"Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["unit", "days"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": params}}]
    r = oai.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice="required", max_tokens=120, seed=2)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "forecast"
    jsonschema.validate(json.loads(call.function.arguments), params)


def test_tool_choice_none_never_parses_calls(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=10, seed=1)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in {"stop", "length"}


def test_multi_turn_with_tool_result(oai):
    system = {"role": "system", "content": "You control the house."}
    first = {"role": "user", "content": "Turn on the kitchen light."}
    last = {"role": "user", "content": "Thanks, is it on now?"}
    call = {
        "id": "call_abc123",
        "type": "function",
        "function": {"name": "set_light", "arguments": json.dumps({"room": "kitchen", "on": True, "level": 7})},
    }

    def prompt_tokens(messages: list[dict[str, Any]], **kw: Any) -> int:
        r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0, **kw)
        assert r.choices[0].message.role == "assistant"
        return r.usage.prompt_tokens

    def convo(result: str) -> list[dict[str, Any]]:
        return [
            system,
            first,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_abc123", "content": result},
            last,
        ]

    with_tools = prompt_tokens(convo('{"ok": true}'), tools=TOOLS)
    without = prompt_tokens([system, first, last], tools=TOOLS)
    assert with_tools > without
    longer_result = prompt_tokens(convo('{"ok": true, "detail": "the kitchen light is on at level seven of ten"}'), tools=TOOLS)
    assert longer_result > with_tools  # the tool result's text is part of the prompt


# ---- response_format ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_response_format_json_schema(oai, seed):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=120,
        seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)


def test_response_format_json_schema_streamed(served):
    sse = stream_chat(
        served,
        chat_body(max_tokens=120, temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}),
    )
    assert sse.done
    jsonschema.validate(json.loads(sse.content()), ANSWER)
    assert sse.choice_events()[-1]["choices"][0]["finish_reason"] == "stop"


def test_response_format_json_object(oai):
    # greedy is deterministic and finishes; sampled output must parse whenever it finished on its own
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=300, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for seed in (1, 2):
        r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=300, seed=seed, response_format={"type": "json_object"})
        text = r.choices[0].message.content
        assert text.lstrip().startswith("{")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


# ---- concurrency and metrics --------------------------------------------------------------------


def _batch_counts(m: dict[str, float]) -> tuple[float, float]:
    return m.get('loopwise_batch_size_bucket{le="1.0"}', 0.0), m.get("loopwise_batch_size_count", 0.0)


def test_concurrent_requests_are_batched(tiny_server):
    before = metrics(tiny_server)
    ok_key = 'loopwise_requests_total{endpoint="/v1/chat/completions",status="200"}'

    async def main() -> list[Any]:
        async with aclient(tiny_server) as ac:
            return await asyncio.gather(
                *(
                    ac.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"request number {i} " + "word " * (i % 7)}],
                        max_tokens=16,
                        temperature=1.0,
                        seed=i,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(32)
                )
            )

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16 for r in results)
    assert len({r.id for r in results}) == 32

    after = metrics(tiny_server)
    le1_before, count_before = _batch_counts(before)
    le1_after, count_after = _batch_counts(after)
    assert count_after - count_before > le1_after - le1_before, "no decode step ran more than one row"
    assert after[ok_key] - before.get(ok_key, 0.0) >= 32
    assert after["loopwise_running_requests"] == 0
    assert after["loopwise_queue_depth"] == 0

    # batching does not mix rows up: a seeded request alone gives the text it got inside the batch
    single = client(tiny_server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "request number 5 " + "word " * 5}],
        max_tokens=16,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert single.choices[0].message.content == results[5].choices[0].message.content


# ---- models, health, metrics, request ids -------------------------------------------------------


def test_models_endpoints(tiny_server):
    oai = client(tiny_server)
    listed = oai.models.list()
    # the base model first, then the built-in agents (served as models too)
    assert [m.id for m in listed.data if m.owned_by != "loopwise-agent"] == [MODEL] and listed.data[0].id == MODEL
    assert {m.id for m in listed.data if m.owned_by == "loopwise-agent"} == {"calc-agent", "svr-agent", "kernel-agent"}
    raw = httpx.get(tiny_server.url + "/models", timeout=10).json()
    assert raw["object"] == "list"
    assert len(raw["data"]) == 4
    card = raw["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and isinstance(card["created"], int) and card["owned_by"]
    assert oai.models.retrieve(MODEL).id == MODEL
    assert httpx.get(tiny_server.url + f"/models/{MODEL}", timeout=10).json() == card
    r = httpx.get(tiny_server.url + "/models/nope", timeout=10)
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": r.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")


def test_health_ready_metrics(tiny_server):
    h = httpx.get(tiny_server.base_url + "/health", timeout=30)
    assert h.status_code == 200 and h.json() == {"status": "ok"}
    r = httpx.get(tiny_server.base_url + "/ready", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ready"
    # make sure at least one chat request was counted, then check every promised family
    assert post_chat(tiny_server, chat_body(max_tokens=2)).status_code == 200
    text = httpx.get(tiny_server.base_url + "/metrics", timeout=10).text
    for family, kind in [
        ("loopwise_requests_total", "counter"),
        ("loopwise_request_latency_seconds", "histogram"),
        ("loopwise_generation_tokens_per_second", "gauge"),
        ("loopwise_queue_depth", "gauge"),
        ("loopwise_batch_size", "histogram"),
        ("loopwise_running_requests", "gauge"),
    ]:
        assert f"# TYPE {family} {kind}" in text, family
    m = metrics(tiny_server)
    assert m['loopwise_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m['loopwise_request_latency_seconds_count{endpoint="/v1/chat/completions"}'] >= 1
    assert m["loopwise_generated_tokens_total"] >= 2
    assert m["loopwise_generation_tokens_per_second"] >= 0


def test_request_ids(tiny_server):
    r = post_chat(tiny_server, chat_body(max_tokens=1))
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    r2 = post_chat(tiny_server, chat_body(max_tokens=1))
    assert r2.headers["x-request-id"] != r.headers["x-request-id"]
    mine = "client-req-42"
    assert post_chat(tiny_server, chat_body(max_tokens=1), headers={"x-request-id": mine}).headers["x-request-id"] == mine
    err = post_chat(tiny_server, chat_body(model="nope"), headers={"x-request-id": "err-req-7"})
    assert err.status_code == 404 and err.headers["x-request-id"] == "err-req-7"
    assert httpx.get(tiny_server.base_url + "/health", headers={"x-request-id": "h-1"}, timeout=30).headers["x-request-id"] == "h-1"
    sse_headers = stream_chat(tiny_server, chat_body(max_tokens=1)).headers
    assert re.fullmatch(r"[0-9a-f]{32}", sse_headers["x-request-id"])


# ---- overload and cancellation (one batch slot, one queue slot) ---------------------------------


@pytest.fixture(scope="module")
def one_slot(start_server):
    # a process: its log is read for tracebacks, and a client's abrupt disconnect must cross a real process boundary
    return start_server("--max-batch-size", "1", "--max-queue", "1", process=True)


def _window_tokens(server: Any, messages: list[dict[str, Any]]) -> int:
    """The most completion tokens this prompt leaves in the 2048-token window."""
    r = post_chat(server, {"model": MODEL, "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return 2048 - r.json()["usage"]["prompt_tokens"]


def test_overload_returns_429(one_slot):
    body = chat_body(max_tokens=200, ignore_eos=True, temperature=0)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(http.post(one_slot.url + "/chat/completions", json=body) for _ in range(8)))

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 429}, codes
    rejected = [r for r in responses if r.status_code == 429]
    accepted = [r for r in responses if r.status_code == 200]
    assert rejected, "8 concurrent requests on one slot + one queue place: some must be rejected"
    assert len(accepted) >= 2  # the running one and the queued one
    for r in rejected:
        assert r.json() == {
            "error": {
                "message": r.json()["error"]["message"],
                "type": "rate_limit_error",
                "param": None,
                "code": "server_overloaded",
            }
        }
        assert int(r.headers["retry-after"]) >= 1
    for r in accepted:
        assert r.json()["usage"]["completion_tokens"] == 200
    m = metrics(one_slot)
    assert m['loopwise_requests_total{endpoint="/v1/chat/completions",status="429"}'] >= len(rejected)
    assert httpx.get(one_slot.base_url + "/health", timeout=30).status_code == 200
    assert one_slot.alive()


def test_overloaded_stream_is_rejected_before_any_event(one_slot):
    budget = _window_tokens(one_slot, USER)
    long_body = chat_body(max_tokens=budget, ignore_eos=True, temperature=0)

    async def main() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as http:
            busy = [asyncio.create_task(http.post(one_slot.url + "/chat/completions", json=long_body)) for _ in range(2)]
            deadline = time.monotonic() + 10
            while True:  # wait until one request decodes and one waits
                m = await asyncio.to_thread(metrics, one_slot)
                if m["loopwise_running_requests"] == 1 and m["loopwise_queue_depth"] == 1:
                    break
                assert time.monotonic() < deadline, m
                await asyncio.sleep(0.02)
            rejected = await http.post(one_slot.url + "/chat/completions", json=chat_body(max_tokens=5, stream=True))
            for t in busy:
                t.cancel()
            return rejected, [r for r in await asyncio.gather(*busy, return_exceptions=True) if isinstance(r, httpx.Response)]

    rejected, _ = asyncio.run(main())
    assert rejected.status_code == 429
    assert rejected.headers["content-type"].startswith("application/json")
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    assert int(rejected.headers["retry-after"]) >= 1
    wait_for_metric(one_slot, "loopwise_running_requests", 0, timeout=15)
    wait_for_metric(one_slot, "loopwise_queue_depth", 0, timeout=15)


def test_stream_disconnect_cancels_generation(one_slot):
    messages = [{"role": "user", "content": "Tell me a very long story."}]
    budget = _window_tokens(one_slot, messages)
    assert budget > 1500
    generated_before = metrics(one_slot)["loopwise_generated_tokens_total"]
    body = {"model": MODEL, "messages": messages, "max_tokens": budget, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", one_slot.url + "/chat/completions", json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 3:
                    break
    # the connection is closed; the batch slot must free up long before 2000 tokens could be generated
    t0 = time.monotonic()
    quick = post_chat(one_slot, chat_body(max_tokens=4, temperature=0), timeout=10)
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t0 < 5
    wait_for_metric(one_slot, "loopwise_running_requests", 0, timeout=5)
    generated = metrics(one_slot)["loopwise_generated_tokens_total"] - generated_before
    assert generated < budget / 2, f"{generated} tokens generated after the client left at token 3"
    assert httpx.get(one_slot.base_url + "/health", timeout=30).status_code == 200
    log = one_slot.log()
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]


def test_non_streamed_client_timeout_cancels_generation(one_slot):
    messages = [{"role": "user", "content": "Tell me an even longer story."}]
    budget = _window_tokens(one_slot, messages)
    generated_before = metrics(one_slot)["loopwise_generated_tokens_total"]
    # n=2 on one batch slot: the choices run one after the other, so finishing would take 2 x budget tokens
    body = {"model": MODEL, "messages": messages, "max_tokens": budget, "ignore_eos": True, "temperature": 0, "n": 2}
    with pytest.raises(httpx.TimeoutException):
        post_chat(one_slot, body, timeout=1.0)
    t0 = time.monotonic()
    wait_for_metric(one_slot, "loopwise_running_requests", 0, timeout=5)
    wait_for_metric(one_slot, "loopwise_queue_depth", 0, timeout=5)
    quick = post_chat(one_slot, chat_body(max_tokens=4, temperature=0), timeout=10)
    assert quick.status_code == 200
    assert time.monotonic() - t0 < 6
    generated = metrics(one_slot)["loopwise_generated_tokens_total"] - generated_before
    assert generated < budget, f"{generated} tokens generated for a request whose client left after 1 s"
    assert httpx.get(one_slot.base_url + "/health", timeout=30).status_code == 200
