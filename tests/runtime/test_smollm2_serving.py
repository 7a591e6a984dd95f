"""The real SmolLM2-135M-Instruct behind ``serve.py``: greedy answers, streaming equals non-streaming, a forced tool call.

Marked ``slow``: it loads SmolLM2 converted before (in the model cache, or by the session's first start) and
decodes a 135M-parameter model on CPU.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from _client import client, stream_chat

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct"
# "What is the capital of France?" alone sits on a near tie for the first token in fp32 ("The" 25.33, "L" 25.24): any
# correct change of bf16 rounding (the lean runner's fused GEMM epilogues, closer to fp32 than transformers' own bf16
# forward) can flip its greedy answer into French. With "Answer in one sentence." the margin is 1.48, and fp32, bf16
# and the lean runner all answer "The capital of France is Paris."
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": WEATHER},
    }
]


@pytest.fixture(scope="module")
def smol(start_server, model_cache, first_start):
    """SmolLM2 from the model cache where it was converted before; else from the folder the session's first start on an
    empty cache converted (``first_start``, which ``test_first_start.py`` makes anyway): one conversion per session, not two."""
    from runtime.model_store import MARKER

    folder = model_cache / NAME
    if not (folder / MARKER).is_file():
        cache, _ = first_start("default", NAME)
        folder = cache / NAME
    return start_server(model=folder, name=NAME)


def test_greedy_answer_and_stream_match(smol):
    oai = client(smol)
    r = oai.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert r.model == NAME and choice.message.role == "assistant"
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop"  # the instruct model ends its short answer with <|im_end|>
    assert 0 < r.usage.completion_tokens < 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "<|im_end|>" not in choice.message.content

    sse = stream_chat(smol, {"model": NAME, "messages": QUESTION, "temperature": 0, "max_tokens": 24, "stream_options": {"include_usage": True}})
    assert sse.status == 200 and sse.done
    assert sse.content() == choice.message.content
    assert sse.choice_events()[-1]["choices"][0]["finish_reason"] == "stop"
    usage: dict[str, Any] = sse.events[-1]["usage"]
    assert usage == {
        "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": r.usage.completion_tokens,
        "total_tokens": r.usage.total_tokens,
    }


def test_forced_tool_call(smol):
    oai = client(smol)
    r = oai.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    assert args["city"] == "Paris"  # greedy SmolLM2 picks the city it was asked about
