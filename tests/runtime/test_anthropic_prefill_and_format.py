"""Anthropic Messages prefill (a final assistant message the reply continues) and ``output_config.format``
(structured output), with the real ``anthropic`` SDK against ``serve.py``'s app on a real port, on each backend.

The turns are read back through the admin API: a prefill's context is the template up to the assistant turn plus
the prefill's tokens, with no end-of-turn token, and a formatted reply is recorded with its grammar.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import pytest
from pydantic import BaseModel
from transformers import AutoTokenizer

MODEL = "tiny"
ADMIN = "admin-secret"
USER = {"role": "user", "content": "What is the answer?"}
PREFILL = "The answer is forty"
ANSWER = {  # a finite grammar: the tiny random model always completes it within a few tokens
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "grade": {"type": "string", "enum": ["a", "b", "c"]}},
    "required": ["ok", "grade"],
    "additionalProperties": False,
}


class Answer(BaseModel):
    ok: bool
    grade: Literal["a", "b", "c"]


@pytest.fixture(scope="module")
def srv(start_backend_server: Any) -> Any:
    return start_backend_server("--admin-key", ADMIN)


@pytest.fixture(scope="module")
def tok(tiny_model_path: Any) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def claude(server: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


def turn_of(server: Any, message: Any = None, headers: Any = None) -> dict[str, Any]:
    """The recorded turn of a reply (its ``loopwise`` ids), or of a stream (its ``X-Loopwise-*`` headers)."""
    if headers is not None:
        ids = {"trajectory_id": headers["x-loopwise-trajectory-id"], "turn_id": headers["x-loopwise-turn-id"]}
    else:
        ids = message.model_extra["loopwise"]
    r = httpx.get(f"{server.base_url}/admin/trajectories/{ids['trajectory_id']}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert r.status_code == 200, r.text
    [turn] = [t for t in r.json()["turns"] if t["turn_id"] == ids["turn_id"]]
    return turn


def post(server: Any, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/messages", json={"model": MODEL, "max_tokens": 8, **body}, timeout=60)


def assert_anthropic_400(r: httpx.Response, *words: str) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    for w in words:
        assert w in body["error"]["message"], body
    return str(body["error"]["message"])


# ---- prefill --------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [PREFILL, [{"type": "text", "text": "The answer "}, {"type": "text", "text": "is forty"}]])
def test_prefill_is_continued_and_recorded_with_the_exact_prompt(srv, tok, content):
    m = claude(srv).messages.create(
        model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[USER, {"role": "assistant", "content": content}]
    )
    text = m.content[0].text if m.content else ""
    assert not text.startswith(PREFILL)  # only the continuation comes back
    turn = turn_of(srv, m)
    want = tok.apply_chat_template([USER, {"role": "assistant", "content": PREFILL}], tokenize=False, continue_final_message=True)
    assert turn["context_ids"] == tok.encode(want, add_special_tokens=False)
    assert tok.decode(turn["context_ids"]).endswith("<|im_start|>assistant\n" + PREFILL)  # the prefill's tokens end the context
    assert turn["context_ids"][-1] != tok.convert_tokens_to_ids("<|im_end|>")
    assert m.usage.input_tokens == len(turn["context_ids"])
    assert turn["output_text"] == text and tok.decode(turn["output_ids"], skip_special_tokens=True) == text
    assert turn["messages"][-1] == {"role": "assistant", "content": PREFILL, "prefix": True}
    count = claude(srv).messages.count_tokens(model=MODEL, messages=[USER, {"role": "assistant", "content": content}])
    assert count.input_tokens == len(turn["context_ids"])


def test_prefill_streamed_sends_only_the_continuation(srv):
    with claude(srv).messages.stream(
        model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[USER, {"role": "assistant", "content": PREFILL}]
    ) as s:
        text = "".join(s.text_stream)
        headers = s.response.headers
    assert not text.startswith(PREFILL)
    assert turn_of(srv, headers=headers)["output_text"] == text


def test_empty_final_assistant_message_is_an_ordinary_reply(srv, tok):
    m = claude(srv).messages.create(model=MODEL, max_tokens=4, messages=[USER, {"role": "assistant", "content": ""}])
    plain = tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    assert turn_of(srv, m)["context_ids"] == tok.encode(plain, add_special_tokens=False)


@pytest.mark.parametrize("prefill", ["The answer is ", "The answer\n", " "])
def test_prefill_with_trailing_whitespace_is_refused(srv, prefill):
    with pytest.raises(anthropic.BadRequestError) as ei:
        claude(srv).messages.create(model=MODEL, max_tokens=8, messages=[USER, {"role": "assistant", "content": prefill}])
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    assert "final assistant content cannot end with trailing whitespace" in ei.value.message


def test_prefill_that_cannot_be_honoured_is_refused(srv):
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    prefilled = [USER, {"role": "assistant", "content": PREFILL}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        assert_anthropic_400(post(srv, messages=prefilled, tools=tools, tool_choice=choice), "prefill", "tool_choice")
    formatted = post(srv, messages=prefilled, output_config={"format": {"type": "json_schema", "schema": ANSWER}})
    assert_anthropic_400(formatted, "prefill", "output_config.format")
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    assert_anthropic_400(post(srv, messages=[USER, {"role": "assistant", "content": [use]}], tools=tools), "prefill", "tool_result")
    # tools with tool_choice auto are fine: the model continues the text and may still call a tool
    assert post(srv, messages=prefilled, tools=tools).status_code == 200


# ---- output_config.format -------------------------------------------------------------------------


def test_output_config_json_schema_constrains_the_reply_and_is_recorded(srv):
    m = claude(srv).messages.create(model=MODEL, max_tokens=64, messages=[USER], output_config={"format": {"type": "json_schema", "schema": ANSWER}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), ANSWER)
    grammar = turn_of(srv, m)["sampling"]["grammar"]
    assert grammar is not None and grammar["kind"] == "json_schema" and json.loads(grammar["spec"]) == ANSWER


def test_sdk_parse_with_a_pydantic_model(srv):
    m = claude(srv).messages.parse(model=MODEL, max_tokens=64, messages=[USER], output_format=Answer)
    assert isinstance(m.parsed_output, Answer)


def test_beta_top_level_output_format_is_honoured(srv):
    r = post(srv, max_tokens=64, messages=[USER], output_format={"type": "json_schema", "schema": ANSWER})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["content"][0]["text"]), ANSWER)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"output_config": {"format": {"type": "regex", "schema": ANSWER}}}, ("output_config.format.type", "'regex'", "json_schema")),
        ({"output_config": {"format": {"type": "json_schema"}}}, ("output_config.format", "needs a schema")),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, ("output_config.format.schema",)),
        ({"output_format": {"type": "text", "schema": {}}}, ("output_format.type",)),
        (
            {"output_format": {"type": "json_schema", "schema": ANSWER}, "output_config": {"format": {"type": "json_schema", "schema": ANSWER}}},
            ("output_format", "output_config.format"),
        ),
    ],
)
def test_unusable_output_format_is_refused(srv, body, words):
    assert_anthropic_400(post(srv, messages=[USER], **body), *words)
