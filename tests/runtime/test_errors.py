"""Every error ``serve.py``'s app answers on a real port is OpenAI's envelope with the right status, ``param`` and ``code``.

``{"error": {"message", "type", "param", "code"}}``; 400 for invalid input (never FastAPI's 422),
401 for a missing or wrong key, 404 for an unknown model or route, 413 for an oversized body.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from _client import MODEL, USER, assert_error, chat_body, client, post_chat

BAD_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "not-a-type"}}}]
TOOL_F = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}}}}]


# ---- bodies that are not a JSON object ----------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny", "messages": [',
        b"{bad json}",
        b"",
        b"[1, 2]",
        b'"text"',
        b"null",
        b"42",
        b"\xff\xfe{}",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800 hi"}]}',
    ],
    ids=["truncated", "malformed", "empty", "array", "string", "null", "number", "not-utf8", "lone-surrogate"],
)
def test_body_is_not_a_json_object(tiny_server, raw):
    err = assert_error(post_chat(tiny_server, content=raw), 400, code="invalid_json", param=None)
    if raw == b"":
        assert "empty" in err["message"]


# ---- field validation (param names the field) ---------------------------------------------------


CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("empty-messages", {"messages": []}, "messages"),
    ("messages-not-a-list", {"messages": "hi"}, "messages"),
    ("unknown-role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("no-role", {"messages": [{"content": "x"}]}, "messages[0]"),
    ("no-content", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("tool-without-id", {"messages": [*USER, {"role": "tool", "content": "42"}]}, "messages[1].tool_call_id"),
    (
        "bad-tool-call-arguments",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}],
                },
                *USER,
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
    ("text-part-without-text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    ("invalid-tool-schema", {"tools": BAD_TOOL}, "tools[0].function.parameters"),
    ("bad-tool-name", {"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ("negative-max-tokens", {"max_tokens": -1}, "max_tokens"),
    ("zero-max-tokens", {"max_tokens": 0}, "max_tokens"),
    ("string-max-tokens", {"max_tokens": "abc"}, "max_tokens"),
    ("zero-max-completion-tokens", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("temperature-3", {"temperature": 3}, "temperature"),
    ("negative-temperature", {"temperature": -0.5}, "temperature"),
    ("top-p-0", {"top_p": 0}, "top_p"),
    ("n-0", {"n": 0}, "n"),
    ("n-too-big", {"n": 17}, "n"),
    ("top-logprobs-too-big", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("five-stops", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("seed-beyond-int64", {"seed": 2**70}, "seed"),
    ("seed-below-int64", {"seed": -(2**70)}, "seed"),
    ("missing-model", {"model": None}, "model"),
    ("bad-response-format-type", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("json-schema-without-schema", {"response_format": {"type": "json_schema"}}, "response_format"),
    (
        "invalid-response-schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "not-a-type"}}}},
        "response_format.json_schema.schema",
    ),
    # cross-field checks
    ("top-logprobs-without-logprobs", {"top_logprobs": 3}, "top_logprobs"),
    (
        "tool-choice-not-in-tools",
        {"tools": TOOL_F, "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),
    ("tool-choice-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("stream-options-without-stream", {"stream_options": {"include_usage": True}}, "stream_options"),
    # the grammar for a forced call cannot be built (an unresolvable $ref)
    (
        "unresolvable-tool-ref",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/missing"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        "unresolvable-response-ref",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}},
        "response_format",
    ),
]


@pytest.mark.parametrize(("fields", "param"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_request_names_the_param(tiny_server, fields, param):
    body = {k: v for k, v in chat_body(**fields).items() if v is not None}
    err = assert_error(post_chat(tiny_server, body), 400, param=param)
    assert err["code"] == "invalid_value"


def test_invalid_request_via_sdk_is_bad_request(tiny_server):
    with pytest.raises(openai.BadRequestError) as ei:
        client(tiny_server).chat.completions.create(model=MODEL, messages=USER, temperature=3)
    assert ei.value.status_code == 400
    assert ei.value.param == "temperature"
    assert ei.value.type == "invalid_request_error"


def test_unknown_model(tiny_server):
    err = assert_error(post_chat(tiny_server, chat_body(model="nope")), 404, code="model_not_found", param="model")
    assert "nope" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client(tiny_server).chat.completions.create(model="nope", messages=USER)


def test_image_content_is_not_supported(tiny_server):
    body = chat_body(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}},
                ],
            }
        ]
    )
    err = assert_error(post_chat(tiny_server, body), 400, param="messages[0].content[1]")
    assert "not supported" in err["message"]


def test_prompt_longer_than_the_window(tiny_server):
    body = chat_body(messages=[{"role": "user", "content": "hello " * 2500}])
    err = assert_error(post_chat(tiny_server, body), 400, code="context_length_exceeded", param="messages")
    assert "2048" in err["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_completion_beyond_the_window(tiny_server, field):
    err = assert_error(post_chat(tiny_server, chat_body(**{field: 2048})), 400, code="context_length_exceeded", param=field)
    assert "2048" in err["message"]
    # the same window holds a completion that fits
    prompt = post_chat(tiny_server, chat_body(max_tokens=1)).json()["usage"]["prompt_tokens"]
    assert post_chat(tiny_server, chat_body(**{field: 2048 - prompt, "stop": "\n", "temperature": 0})).status_code == 200


def test_streamed_request_errors_before_the_stream(tiny_server):
    r = post_chat(tiny_server, chat_body(stream=True, temperature=3))
    assert_error(r, 400, param="temperature")
    r = post_chat(tiny_server, chat_body(stream=True, max_tokens=5000))
    assert_error(r, 400, code="context_length_exceeded", param="max_tokens")


# ---- routes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/nope", 404),
        ("GET", "/v1/nope", 404),
        ("POST", "/v1/complete", 404),
        ("POST", "/v1/models", 405),
        ("GET", "/v1/chat/completions", 405),
    ],
)
def test_unknown_routes_and_methods(tiny_server, method, path, status):
    r = httpx.request(method, tiny_server.base_url + path, timeout=10)
    err = assert_error(r, status)
    assert err["code"] == ("unknown_route" if status == 404 else "method_not_allowed")
    assert f"{method} {path}" in err["message"] and "POST /v1/chat/completions" in err["message"]
    assert r.headers["x-request-id"]


def test_422_never_appears(tiny_server):
    bodies: list[Any] = [
        {},
        {"model": 1, "messages": 2},
        {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
        {"model": MODEL, "messages": USER, "tools": "x"},
        {"model": MODEL, "messages": USER, "tool_choice": 5},
        {"model": MODEL, "messages": USER, "stop": 3},
        {"model": MODEL, "messages": USER, "n": "two"},
        {"model": MODEL, "messages": USER, "stream": "maybe"},
        {"model": MODEL, "messages": USER, "response_format": "json"},
        {"model": MODEL, "messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]},
    ]
    for body in bodies:
        r = post_chat(tiny_server, body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert_error(r, 400)
    for method, path in [("GET", "/v1/models/"), ("DELETE", "/v1/models/tiny"), ("PUT", "/health"), ("POST", "/metrics")]:
        r = httpx.request(method, tiny_server.base_url + path, timeout=10)
        assert r.status_code != 422 and r.status_code < 500, (method, path, r.status_code)
        if r.status_code >= 400:
            assert_error(r, r.status_code)


def test_server_errors_do_not_leak_internals(tiny_model_path):
    """An engine that blows up (faked at the engine edge only) gives a 500 envelope without internals."""
    from fastapi.testclient import TestClient
    from structlog.testing import capture_logs

    from runtime.app import create_app
    from runtime.engines.embedded import EmbeddedEngine
    from runtime.settings import EngineSettings, ServerSettings

    class BrokenEngine(EmbeddedEngine):
        def stream(self, req):
            raise RuntimeError("secret-internal-detail at /etc/passwd")

    engine = BrokenEngine(tiny_model_path, model_id="tiny", dtype="float32")
    app = create_app(ServerSettings(), EngineSettings(), engine, "tiny")
    with TestClient(app) as tc, capture_logs():
        for stream in (False, True):
            r = tc.post("/v1/chat/completions", json={**chat_body(max_tokens=2), "stream": stream}, headers={"x-request-id": "rid-500"})
            err = assert_error(r, 500, type="server_error", code="internal_error")
            assert "secret" not in r.text and "Traceback" not in r.text and "passwd" not in r.text
            assert "rid-500" in err["message"]
        health = tc.get("/health")  # generating one token fails too: unhealthy, and still no internals
        assert_error(health, 503, type="server_error", code="unhealthy")
        assert "secret" not in health.text


# ---- body size ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_body_server(start_server):
    return start_server("--max-body-bytes", "2000")


def test_body_over_the_limit_is_413(small_body_server):
    small = chat_body(max_tokens=2)
    assert len(json.dumps(small)) < 2000
    assert post_chat(small_body_server, small).status_code == 200
    big = chat_body(max_tokens=2, messages=[{"role": "user", "content": "x" * 3000}])
    err = assert_error(post_chat(small_body_server, big), 413, code="request_too_large")
    assert "2000" in err["message"]

    # without a Content-Length (chunked), the limit holds while reading
    def chunks():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 500):
            yield data[i : i + 500]

    r = httpx.post(small_body_server.url + "/chat/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert "content-length" not in r.request.headers
    assert_error(r, 413, code="request_too_large")
    assert httpx.get(small_body_server.base_url + "/health", timeout=30).status_code == 200


# ---- API keys -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(start_server):
    return start_server("--api-key", "k1", "--api-key", "k2")


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer wrong"}, {"authorization": "k1"}, {"authorization": "Basic k1"}, {"authorization": "Bearer"}],
    ids=["none", "wrong", "no-scheme", "basic", "empty"],
)
def test_missing_or_wrong_key_is_401(keyed_server, headers):
    r = post_chat(keyed_server, chat_body(max_tokens=1), headers=headers)
    assert_error(r, 401, type="authentication_error", code="invalid_api_key", param=None)
    r = httpx.get(keyed_server.url + "/models", headers=headers, timeout=10)
    assert_error(r, 401, type="authentication_error", code="invalid_api_key", param=None)


def test_both_keys_work(keyed_server):
    for key in ("k1", "k2"):
        r = client(keyed_server, api_key=key).chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        assert r.choices[0].finish_reason in {"stop", "length"}
        assert client(keyed_server, api_key=key).models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError) as ei:
        client(keyed_server, api_key="k3").chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert ei.value.status_code == 401 and ei.value.code == "invalid_api_key"


def test_auth_comes_before_validation(keyed_server):
    # an invalid body without a key is a 401, not a 400: nothing about the request is looked at first
    assert_error(post_chat(keyed_server, content=b"{bad"), 401, type="authentication_error")
    assert_error(post_chat(keyed_server, content=b"{bad", headers={"authorization": "Bearer k2"}), 400, code="invalid_json")


def test_operational_endpoints_stay_open(keyed_server):
    assert httpx.get(keyed_server.base_url + "/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(keyed_server.base_url + "/ready", timeout=10).status_code == 200
    assert httpx.get(keyed_server.base_url + "/metrics", timeout=10).status_code == 200
