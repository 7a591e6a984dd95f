"""The openai Python SDK's first calls against the sweep's server: chat, a streamed chat, a function tool round trip,
``chat.completions.parse`` with a Pydantic model, the Responses API (plain and streamed) and embeddings.

Run by ``bench/client_sweep.py`` (see ``_common.py`` for the environment and the records). Nothing is retried: the
client is built with ``max_retries=0``.
"""

from __future__ import annotations

import json
from typing import Any

from _common import KEY, MODEL, URL, WEATHER_PROMPT, ModelSide, main
from openai import OpenAI
from pydantic import BaseModel

client = OpenAI(base_url=URL, api_key=KEY, max_retries=0)
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


class Person(BaseModel):
    name: str
    age: int


def chat() -> str:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello in one sentence."}])
    return r.choices[0].message.content or ""


def chat_stream() -> str:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 5."}], stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def tools() -> str:
    messages: list[Any] = [{"role": "user", "content": WEATHER_PROMPT}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    msg = r.choices[0].message
    if not msg.tool_calls:
        raise ModelSide(f"no tool call (finish_reason {r.choices[0].finish_reason}): {msg.content!r}")
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22 C"}]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    return f"{call.function.name}({args}) -> {r2.choices[0].message.content!r}"


def structured() -> str:
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Extract the person: John Smith is 42 years old."}], response_format=Person
    )
    parsed = r.choices[0].message.parsed
    if parsed is None:
        raise ModelSide(f"no parsed object: {r.choices[0].message.content!r}")
    return repr(parsed)


def responses() -> str:
    return client.responses.create(model=MODEL, input="Say hello in one sentence.").output_text


def responses_stream() -> str:
    with client.responses.stream(model=MODEL, input="Count from 1 to 5.") as stream:
        events = list(stream)
        if events and events[-1].type == "response.incomplete":  # get_final_response() raises on it, as against OpenAI
            raise ModelSide(f"the reply was cut at the length limit: {events[-1].response.incomplete_details}")
        final = stream.get_final_response()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return f"{final.status}: {text}"


def embeddings() -> str:
    e = client.embeddings.create(model=MODEL, input=["hello world", "goodbye"])
    return f"{len(e.data)} vectors of {len(e.data[0].embedding)}"


main(
    "openai",
    ("openai", "pydantic"),
    [
        ("chat", chat),
        ("chat_stream", chat_stream),
        ("tools", tools),
        ("structured", structured),
        ("responses", responses),
        ("responses_stream", responses_stream),
        ("embeddings", embeddings),
    ],
)
