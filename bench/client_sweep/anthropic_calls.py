"""Anthropic's Python SDK's first calls against the sweep's server (its base URL without ``/v1``): a message, a streamed
message, a tool round trip, ``messages.parse`` with a Pydantic ``output_format``, a prefill, and ``count_tokens``.

``max_tokens=1024`` as Anthropic's own examples write it. Run by ``bench/client_sweep.py``; nothing is retried.
"""

from __future__ import annotations

from typing import Any

import anthropic
from _common import BASE, KEY, MODEL, WEATHER_PROMPT, ModelSide, main
from pydantic import BaseModel

client = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0)
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


class Person(BaseModel):
    name: str
    age: int


def message() -> str:
    m = client.messages.create(model=MODEL, max_tokens=1024, messages=[{"role": "user", "content": "Say hello in one sentence."}])
    return f"{m.stop_reason}: {m.content[0].text if m.content and m.content[0].type == 'text' else m.content}"


def stream() -> str:
    with client.messages.stream(model=MODEL, max_tokens=1024, messages=[{"role": "user", "content": "Count from 1 to 5."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    return f"{final.stop_reason}: {text}"


def tools() -> str:
    messages: list[Any] = [{"role": "user", "content": WEATHER_PROMPT}]
    m = client.messages.create(model=MODEL, max_tokens=1024, tools=TOOLS, messages=messages)
    uses = [b for b in m.content if b.type == "tool_use"]
    if not uses:
        raise ModelSide(f"no tool_use (stop_reason {m.stop_reason}): {m.content!r}")
    messages += [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 22 C"}]},
    ]
    m2 = client.messages.create(model=MODEL, max_tokens=1024, tools=TOOLS, messages=messages)
    return f"{uses[0].name}({uses[0].input}) -> {m2.stop_reason}: {m2.content!r}"


def structured() -> str:
    m = client.messages.parse(
        model=MODEL, max_tokens=1024, output_format=Person, messages=[{"role": "user", "content": "Extract the person: John Smith is 42 years old."}]
    )
    if m.parsed_output is None:
        raise ModelSide(f"no parsed output (stop_reason {m.stop_reason}): {m.content!r}")
    return repr(m.parsed_output)


def prefill() -> str:
    m = client.messages.create(
        model=MODEL,
        max_tokens=1024,
        messages=[{"role": "user", "content": "List three colors as a JSON array."}, {"role": "assistant", "content": '["'}],
    )
    return f"{m.stop_reason}: {m.content!r}"


def count_tokens() -> str:
    return str(client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hello there"}]).input_tokens)


main(
    "anthropic",
    ("anthropic", "pydantic"),
    [("message", message), ("stream", stream), ("tools", tools), ("structured", structured), ("prefill", prefill), ("count_tokens", count_tokens)],
)
