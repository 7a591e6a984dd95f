"""Anthropic Messages prefill (a final assistant message the reply continues), ``output_config.format``
(structured output) and a forced tool call cut by ``max_tokens``, with the real ``anthropic`` SDK against
``serve.py``'s app on a real port, on each backend.

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


# ---- a forced tool call cut by max_tokens -----------------------------------------------------------

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
FORCED: dict[str, Any] = {"tools": [{"name": "w", "input_schema": CITY}], "tool_choice": {"type": "tool", "name": "w"}}
CUTS = [12, 40, 48]  # the tiny model spends ~24 tokens on `<tool_call>\n{"name": "w", "arguments": `: before the arguments, and in them


def produced_arguments(output_text: str) -> str:
    """The arguments text the model produced, from the recorded output (Hermes: ``{"name": …, "arguments": <here>``)."""
    head = '"arguments": '
    return output_text[output_text.index(head) + len(head) :] if head in output_text else ""


def _closed(text: str) -> str:
    """``text`` with its open string and containers closed (a naive scan: valid only where ``text`` is a JSON prefix)."""
    closers, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]" and closers:
            closers.pop()
    return text + ('"' if in_string else "") + "".join(reversed(closers))


def longest_object_prefix(text: str) -> dict[str, Any]:
    """Brute force: the object of the longest prefix of ``text`` that closes into valid JSON ({} if none)."""
    for end in range(len(text), -1, -1):
        try:
            value = json.loads(_closed(text[:end]))
            json.dumps(value, ensure_ascii=False).encode()
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def test_prefix_routine_of_these_tests():
    assert longest_object_prefix('{"city": "Pa') == {"city": "Pa"}
    assert longest_object_prefix('{"city": "P\\') == {"city": "P"}
    assert longest_object_prefix('{"city": "P", "da') == {"city": "P"}
    assert longest_object_prefix('{"city": "P", "days": 1') == {"city": "P", "days": 1}
    assert longest_object_prefix('{"city": "P", "days": 12}}') == {"city": "P", "days": 12}
    assert longest_object_prefix("") == longest_object_prefix('{"ci') == {}


@pytest.mark.parametrize("cut", CUTS)
def test_cut_forced_tool_call_carries_the_input_produced(srv, cut):
    m = claude(srv).messages.create(model=MODEL, max_tokens=cut, messages=[USER], **FORCED)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == cut
    [block] = m.content
    assert block.type == "tool_use" and block.name == "w" and block.id
    produced = produced_arguments(turn_of(srv, m)["output_text"])
    assert isinstance(block.input, dict) and block.input == longest_object_prefix(produced), produced
    if cut >= 40:
        assert produced.startswith('{"city": "') and "city" in block.input, produced  # the cut is inside the arguments


@pytest.mark.parametrize("cut", CUTS)
def test_cut_forced_tool_call_streamed_sends_the_text_produced(srv, cut):
    with claude(srv).messages.stream(model=MODEL, max_tokens=cut, messages=[USER], **FORCED) as s:
        events = list(s)
        final = s.get_final_message()
        headers = s.response.headers
    produced = produced_arguments(turn_of(srv, headers=headers)["output_text"])
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(b.type, b.name, b.input) for b in starts] == [("tool_use", "w", {})]
    sent = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert sent == produced  # the raw partial JSON, as Anthropic streams it
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == cut
    [block] = final.content
    assert block.type == "tool_use" and block.name == "w"
    # the SDK parses the deltas itself (jiter, which drops an open string): what it keeps is in the server's parse
    full = longest_object_prefix(produced)
    assert isinstance(block.input, dict) and all(full.get(k) == v for k, v in block.input.items()), (block.input, full)
    if cut >= 40:
        assert produced.startswith('{"city": "'), produced


# ---- errors name output_config.format -------------------------------------------------------------

UNBUILDABLE = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}  # a valid JSON Schema no grammar can be built from


@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_a_schema_no_grammar_can_be_built_from_names_the_field_sent(srv, field, with_tools):
    # without tools, on vLLM and SGLang the schema is compiled by the engine: its refusal comes back the same way
    fmt = {"type": "json_schema", "schema": UNBUILDABLE}
    body: dict[str, Any] = {"output_config": {"format": fmt}} if field == "output_config" else {"output_format": fmt}
    if with_tools:
        body["tools"] = FORCED["tools"]  # tool_choice auto with a format: the union grammar is built before the engine
    named = "output_config.format" if field == "output_config" else "output_format"
    message = assert_anthropic_400(post(srv, messages=[USER], **body), named)
    assert "response_format" not in message
    with pytest.raises(anthropic.BadRequestError) as ei:  # the SDK's structured-output call, streamed
        kw = body if field == "output_config" else {"extra_body": body}  # the SDK takes only a type as output_format
        with claude(srv).messages.stream(model=MODEL, max_tokens=8, messages=[USER], **kw) as s:
            list(s)
    assert named in ei.value.message and "response_format" not in ei.value.message


@pytest.mark.parametrize(
    ("engine", "status", "body"),
    [
        # SGLang 0.5.21: the scheduler aborts the request (a ValueError → 400 when not streamed) ...
        ("sglang", 400, {"error": {"message": "Failed to compile json grammar: Invalid reference: #/$defs/missing"}}),
        ("sglang", 400, {"error": {"message": "Grammar preprocessing timed out: req.grammar_key=('json', '{}')"}}),
        # ... vLLM 0.32: the request's structured_outputs fail validation
        (
            "vllm",
            400,
            {"error": {"message": "Failed to transform json schema into a grammar: bad ref", "type": "BadRequestError", "param": None, "code": 400}},
        ),
        ("vllm", 400, {"error": {"message": "Grammar error: unknown ref", "type": "BadRequestError", "param": None, "code": 400}}),
        ("vllm", 400, {"error": {"message": "The provided JSON schema contains features not supported by xgrammar.", "code": 400}}),
    ],
)
def test_an_engines_refusal_of_the_schema_is_an_anthropic_400_on_the_field_sent(engine, status, body):
    from runtime.api.messages import _in_anthropic_terms
    from runtime.engine import InvalidRequest
    from runtime.engines import sglang, vllm
    from runtime.errors import from_engine

    err = (vllm if engine == "vllm" else sglang).translate_error(status, body)
    assert isinstance(err, InvalidRequest) and err.param == "response_format"  # as the embedded engine names its own
    api = _in_anthropic_terms(from_engine(err), "output_config.format")
    assert api.status == 400 and api.param == "output_config.format"
    assert api.message.startswith("the output_config.format grammar was refused by ") and body["error"]["message"] in api.message
    if engine == "sglang":  # streamed, SGLang ends the request with an abort finish instead (loopwise's decoder raises it)
        finish = {"type": "abort", "message": body["error"]["message"], "status_code": 400, "err_type": "BadRequestError"}
        with pytest.raises(InvalidRequest) as ei:
            sglang._finish(finish)
        assert ei.value.param == "response_format"


def test_grammar_timeout_names_the_field_sent():
    from runtime.api.messages import _in_anthropic_terms
    from runtime.errors import APIError

    timeout = APIError(400, "the response_format / tool_choice grammar did not compile within 5 s; simplify it", param="response_format")
    assert _in_anthropic_terms(timeout, "output_config.format").message.startswith("the output_config.format grammar did not compile")
    assert _in_anthropic_terms(timeout, "tool_choice").message.startswith("the tool_choice grammar did not compile")
    other = APIError(400, "messages too long", param="messages")
    assert _in_anthropic_terms(other, "output_config.format") is other
