"""litellm's first calls against the sweep's server (``openai/<model>`` with ``api_base``, its way to an
OpenAI-compatible server): ``completion`` plain and streamed, with a tool (round trip), ``embedding``, and ``responses``.

``bench/client_sweep.py`` sets ``LITELLM_LOCAL_MODEL_COST_MAP`` (no network here). Nothing is retried.
"""

from __future__ import annotations

import json
from typing import Any

import litellm
from _common import KEY, MODEL, URL, WEATHER_PROMPT, ModelSide, main

MODEL_NAME = f"openai/{MODEL}"
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


def completion(messages: list[Any], **kw: Any) -> Any:
    return litellm.completion(model=MODEL_NAME, api_base=URL, api_key=KEY, messages=messages, **kw)


def chat() -> str:
    return completion([{"role": "user", "content": "Say hello in one sentence."}]).choices[0].message.content or ""


def stream() -> str:
    chunks = completion([{"role": "user", "content": "Count from 1 to 5."}], stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def tools() -> str:
    messages: list[Any] = [{"role": "user", "content": WEATHER_PROMPT}]
    r = completion(messages, tools=TOOLS)
    msg = r.choices[0].message
    if not msg.tool_calls:
        raise ModelSide(f"no tool call (finish_reason {r.choices[0].finish_reason}): {msg.content!r}")
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22 C"}]
    r2 = completion(messages, tools=TOOLS)
    return f"{call.function.name}({args}) -> {r2.choices[0].message.content!r}"


def embedding() -> str:
    e = litellm.embedding(model=MODEL_NAME, api_base=URL, api_key=KEY, input=["hello world", "goodbye"])
    return f"{len(e.data)} vectors of {len(e.data[0]['embedding'])}"


def responses() -> str:
    r = litellm.responses(model=MODEL_NAME, api_base=URL, api_key=KEY, input="Say hello in one sentence.")
    return f"{r.status}: {r.output!r}"


main(
    "litellm", ("litellm", "openai"), [("completion", chat), ("stream", stream), ("tools", tools), ("embedding", embedding), ("responses", responses)]
)
