"""Chat-completions surface details, in process (``create_app`` around a scripted engine; everything above the engine is real).

Legacy ``functions``/``function_call`` and ``role: "function"``, refusal parts, error messages written
for people, the 404 of an unknown route, CORS, and tool-call arguments streamed as they decode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.runtime._inproc import InProc, scripted_app

USER = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def serve(tokenizer, tmp_path):
    made: list[InProc] = []

    def make(script, **server):
        app, engine, store = scripted_app(tokenizer, script, tmp_path, **server)
        srv = InProc(app)
        srv.engine, srv.store = engine, store
        made.append(srv)
        return srv

    yield make
    for s in made:
        s.close()


def sdk(srv: InProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key="x", http_client=srv.client, max_retries=0)


def test_legacy_functions_are_mapped_to_tools_and_answered_as_function_call(serve):
    srv = serve([CALL, "It is sunny."])
    body = {"model": "tiny", "messages": USER, "functions": [{"name": "get_weather", "parameters": WEATHER}]}
    r = srv.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"]["name"] == "get_weather"
    assert json.loads(choice["message"]["function_call"]["arguments"]) == {"city": "Paris", "days": [1, 2]}
    assert "tool_calls" not in choice["message"] or choice["message"]["tool_calls"] is None
    # the prompt listed the function as a tool
    assert "get_weather" in srv.engine.tok.decode(srv.engine.calls[0].input_ids)
    # the function's result comes back as role "function" and is rendered as a tool response
    follow = {
        **body,
        "messages": [
            *USER,
            {"role": "assistant", "content": None, "function_call": choice["message"]["function_call"]},
            {"role": "function", "name": "get_weather", "content": "22C"},
        ],
    }
    r2 = srv.client.post("/v1/chat/completions", json=follow)
    assert r2.status_code == 200, r2.text
    prompt = srv.engine.tok.decode(srv.engine.calls[1].input_ids)
    assert "<tool_response>\n22C\n</tool_response>" in prompt
    # and the follow-up continued the same recorded trajectory
    assert r2.json()["loopwise"]["trajectory_id"] == r.json()["loopwise"]["trajectory_id"]


def test_forced_legacy_function_call_and_mixing_forms(serve):
    srv = serve([CALL])
    fns = [{"name": "get_weather", "parameters": WEATHER}]
    r = srv.client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "functions": fns, "function_call": {"name": "get_weather"}})
    assert r.status_code == 200 and srv.engine.calls[0].sampling.grammar is not None
    both = {"model": "tiny", "messages": USER, "functions": fns, "tools": [{"type": "function", "function": fns[0]}]}
    err = srv.client.post("/v1/chat/completions", json=both).json()["error"]
    assert err["param"] == "functions" and "not both" in err["message"] and not err["message"].startswith("Value error")
    err = srv.client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "function_call": "auto"}).json()["error"]
    assert err["param"] == "function_call" and err["message"] == "function_call requires functions"


def test_refusal_parts_and_refusal_field_are_accepted_as_history(serve):
    srv = serve(["ok", "ok"])
    msgs = [
        *USER,
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot help with that."}]},
        {"role": "user", "content": "why?"},
    ]
    assert srv.client.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs}).status_code == 200
    msgs[1] = {"role": "assistant", "content": None, "refusal": "I cannot help with that."}
    assert srv.client.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs}).status_code == 200
    for call in srv.engine.calls:
        assert "I cannot help with that." in srv.engine.tok.decode(call.input_ids)


def test_cross_field_errors_have_no_library_prefix(serve):
    srv = serve([])
    r = srv.client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "top_logprobs": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["message"] == "top_logprobs requires logprobs to be true" and err["param"] == "top_logprobs"
    r = srv.client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "response_format": {"type": "json_schema"}})
    assert "Value error" not in r.text and "json_schema" in r.json()["error"]["message"]


def test_unknown_route_names_the_route_and_the_endpoints(serve):
    srv = serve([])
    r = srv.client.post("/v1/chat/completion", json={})
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "unknown_route"
    assert "POST /v1/chat/completion" in err["message"] and "POST /v1/chat/completions" in err["message"] and "GET /v1/models" in err["message"]
    with pytest.raises(openai.NotFoundError) as ei:
        sdk(srv).post("/nonexistent", cast_to=object, body={})
    assert "/v1/nonexistent" in str(ei.value)
    r = srv.client.get("/v1/chat/completions")  # a known path with the wrong method
    assert r.status_code == 405 and "GET /v1/chat/completions" in r.json()["error"]["message"]


def test_cors_preflight_and_headers(serve):
    srv = serve(["hello"], cors_origins=("https://app.example",), api_keys=("k",))
    pre = srv.client.options(
        "/v1/chat/completions",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code == 200, pre.text  # answered before authentication
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = srv.client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": USER}, headers={"Origin": "https://app.example", "Authorization": "Bearer k"}
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-loopwise-trajectory-id" in r.headers["access-control-expose-headers"].lower()
    other = srv.client.options("/v1/chat/completions", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


def test_no_cors_headers_without_the_flag(serve):
    srv = serve(["hello"])
    r = srv.client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER}, headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_tool_call_arguments_stream_in_pieces(serve):
    srv = serve([CALL])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    stream = sdk(srv).chat.completions.create(model="tiny", messages=USER, tools=tools, stream=True)
    pieces: list[str] = []
    names = []
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names.append((tc.index, tc.id, tc.function.name))
                if tc.function and tc.function.arguments:
                    pieces.append(tc.function.arguments)
            last = c.finish_reason or None
    assert [n[2] for n in names] == ["get_weather"] and names[0][1].startswith("call_")
    assert len(pieces) > 3  # one delta per decoded token of the arguments, not one per call
    assert json.loads("".join(pieces)) == {"city": "Paris", "days": [1, 2]}
    assert last == "tool_calls"
    # the recorded call has the same arguments the client assembled
    turns = srv.store.get_trajectory(chunk.model_extra["loopwise"]["trajectory_id"]).turns
    assert turns[0].tool_calls[0].arguments == "".join(pieces) and turns[0].tool_calls[0].id == names[0][1]
