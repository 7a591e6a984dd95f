"""Bodies real clients can send that the server answered with a 500 or a stalled event loop, each now a clear 400
(found by reading the wire code against what Python's JSON parser, jsonschema and chat templates do with them).

Every case runs against ``serve.py``'s app on a real port and checks the error envelope, then that the server still
answers an ordinary request.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from _client import MODEL, USER, assert_error, chat_body, post_chat

HUGE_INT = "1" * 5000  # Python's json refuses ints of more than 4,300 digits with a bare ValueError


def _post(server: Any, path: str, body: Any = None, content: bytes | None = None) -> httpx.Response:
    url = server.base_url + path
    if content is not None:
        return httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url, json=body, timeout=60)


def _still_serves(server: Any) -> None:
    r = post_chat(server, chat_body(max_tokens=2))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \xed\xa0\x80"}]}',  # a UTF-8-encoded lone surrogate
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": ' + HUGE_INT.encode() + b"}",
    ],
    ids=["raw-surrogate-bytes", "5000-digit-int"],
)
def test_json_that_python_reads_but_json_does_not_have_is_invalid_json(tiny_server: Any, raw: bytes) -> None:
    assert_error(post_chat(tiny_server, content=raw), 400, code="invalid_json", param=None)
    _still_serves(tiny_server)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}', "top_p"),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
            b'{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "number", "maximum": Infinity}}}}}]}',
            "tools[0].function.parameters.properties.x.maximum",
        ),
    ],
    ids=["nan", "minus-infinity", "infinity-in-a-tool-schema"],
)
def test_nan_and_infinity_are_400s_naming_the_field(tiny_server: Any, raw: bytes, param: str) -> None:
    """JSON has no NaN or Infinity (Python's parser takes them): a tool schema holding one was echoed in the Responses
    reply, which no JSON encoder could write (a 500 after the answer was generated)."""
    err = assert_error(post_chat(tiny_server, content=raw), 400, code="invalid_value", param=param)
    assert "finite" in err["message"], err
    if b"tools" in raw:  # the Responses API, which echoes its tools in the reply
        body = (
            b'{"model": "tiny", "input": "hi", "max_output_tokens": 2, "tools": [{"type": "function", "name": "f", '
            b'"parameters": {"type": "object", "properties": {"x": {"type": "number", "maximum": Infinity}}}}]}'
        )
        assert_error(_post(tiny_server, "/v1/responses", content=body), 400, code="invalid_value", param="tools[0].parameters.properties.x.maximum")
    _still_serves(tiny_server)


def test_a_null_body_is_told_it_must_be_an_object(tiny_server: Any) -> None:
    err = assert_error(post_chat(tiny_server, content=b"null"), 400, code="invalid_json", param=None)
    assert "object" in err["message"], err


def test_a_5000_digit_integer_inside_tool_call_arguments_is_a_400(tiny_server: Any) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"n": ' + HUGE_INT + "}"}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    body = chat_body(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, result])
    err = assert_error(post_chat(tiny_server, body), 400)
    assert err["param"] == "messages[1].tool_calls[0].function.arguments", err
    items = [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"n": ' + HUGE_INT + "}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    assert_error(_post(tiny_server, "/v1/responses", {"model": MODEL, "input": items}), 400, param="input[0].arguments")
    _still_serves(tiny_server)


@pytest.mark.parametrize("schema_uri", [5, True, [], {"a": 1}])
def test_a_json_schema_whose_schema_uri_is_not_a_string_is_a_400(tiny_server: Any, schema_uri: Any) -> None:
    params = {"$schema": schema_uri, "type": "object"}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    err = assert_error(post_chat(tiny_server, chat_body(tools=tools)), 400)
    assert err["param"] and err["param"].startswith("tools[0]"), err
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": params}}
    assert_error(post_chat(tiny_server, chat_body(response_format=fmt)), 400)
    rtools = [{"type": "function", "name": "f", "parameters": params}]
    assert_error(_post(tiny_server, "/v1/responses", {"model": MODEL, "input": "hi", "tools": rtools}), 400)
    _still_serves(tiny_server)


def test_stop_strings_are_bounded_on_every_api_that_takes_them(tiny_server: Any) -> None:
    long = "x" * 200_000  # the decode loop looked for every prefix of it after every token: seconds per token for all rows
    assert_error(post_chat(tiny_server, chat_body(stop=[long], max_tokens=4)), 400, param="stop")
    assert_error(_post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": long, "max_tokens": 4}), 400, param="stop")
    r = _post(tiny_server, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": USER, "stop_sequences": [long]})
    assert r.status_code == 400 and "stop" in r.text, r.text
    ok = post_chat(tiny_server, chat_body(stop=["y" * 1024, "\n\n"], max_tokens=4))  # at the limit: served
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "name": ["f"]}}, "tool_choice"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": 5}}, "tool_choice"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": ["f"]}]}}, "tool_choice"),
        ({"tool_choice": {"type": ["function"]}}, "tool_choice"),
        ({"input": [{"type": ["message"], "role": "user", "content": "hi"}]}, "input[0].type"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),
    ],
    ids=["name-a-list", "allowed-tools-a-number", "allowed-name-a-list", "type-a-list", "item-type-a-list", "no-input", "only-reasoning"],
)
def test_responses_with_odd_shapes_are_400s(tiny_server: Any, fields: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], **fields}
    assert_error(_post(tiny_server, "/v1/responses", body), 400, param=param)
    _still_serves(tiny_server)


def test_text_that_could_never_fit_is_refused_before_it_is_tokenized(tiny_server: Any) -> None:
    huge = "word " * 40_000  # 200,000 characters: more than the tiny model's 2,048 tokens could hold at 64 characters a token
    err = assert_error(_post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": huge, "max_tokens": 1}), 400, param="prompt")
    assert err["code"] == "context_length_exceeded", err
    r = _post(tiny_server, "/v1/embeddings", {"model": MODEL, "input": [huge]})
    assert r.status_code == 400 and "input" in r.text, r.text
    r = _post(tiny_server, "/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": huge}]})
    assert r.status_code == 400, r.text


def test_count_tokens_counts_what_the_message_request_is_charged(tiny_server: Any) -> None:
    body = {"model": MODEL, "messages": USER}
    r = _post(tiny_server, "/v1/messages/count_tokens", body)
    assert r.status_code == 200, r.text
    sent = _post(tiny_server, "/v1/messages", {**body, "max_tokens": 1})
    assert sent.status_code == 200, sent.text
    assert r.json()["input_tokens"] == sent.json()["usage"]["input_tokens"] > 0
