"""runtime/constraints.py (with real xgrammar matching), runtime/api/openai_schemas.py validation, runtime/errors.py mapping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr
from pydantic import ValidationError
from transformers import AutoTokenizer

from runtime.api.chat import to_internal
from runtime.api.openai_schemas import ChatCompletionRequest
from runtime.constraints import grammar_for, tool_call_ebnf
from runtime.engine import AdapterError, EngineClosed, EngineError, EngineOverloaded, Grammar, InvalidRequest
from runtime.errors import APIError, from_engine, from_validation, param_of

USER = [{"role": "user", "content": "hi"}]
F_PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
G_PARAMS = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": F_PARAMS}},
    {"type": "function", "function": {"name": "g", "parameters": G_PARAMS}},
]
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": USER, **fields})


# ---- grammar_for ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "auto"},
        {"tools": TOOLS, "tool_choice": "none"},
        {"response_format": {"type": "text"}},
    ],
    ids=["plain", "tools-default", "auto", "none", "text-format"],
)
def test_grammar_for_free_decoding(fields: dict[str, Any]) -> None:
    assert grammar_for(to_internal(chat(**fields)), "qwen25") is None


def test_grammar_for_json_object() -> None:
    assert grammar_for(to_internal(chat(response_format={"type": "json_object"})), "qwen25") == Grammar("json_object", "")


def test_grammar_for_json_schema_passes_the_schema_text() -> None:
    g = grammar_for(to_internal(chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": OK_SCHEMA}})), "qwen25")
    assert g is not None and g.kind == "json_schema"
    assert json.loads(g.spec) == OK_SCHEMA


def test_grammar_for_tool_choice_none_with_response_format_uses_the_format() -> None:
    g = grammar_for(to_internal(chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"})), "qwen25")
    assert g == Grammar("json_object", "")


def test_grammar_for_required_and_named_are_ebnf() -> None:
    req = grammar_for(to_internal(chat(tools=TOOLS, tool_choice="required")), "qwen25")
    named = grammar_for(to_internal(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}})), "qwen25")
    assert req == Grammar("ebnf", tool_call_ebnf({"f": F_PARAMS, "g": G_PARAMS}, "qwen25"))
    assert named == Grammar("ebnf", tool_call_ebnf({"g": G_PARAMS}, "qwen25"))


# ---- tool_call_ebnf with xgrammar ------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(tiny_model_path: Path) -> Any:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[2])
    return xgr.GrammarCompiler(info, max_threads=1)


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def accepts(compiler: Any, ebnf: str, text: str) -> bool:
    m = xgr.GrammarMatcher(compiler.compile_grammar(ebnf))
    return bool(m.accept_string(text)) and m.is_completed()


CALL_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def test_tool_call_ebnf_compiles() -> None:
    ebnf = tool_call_ebnf({"f": F_PARAMS, "g": G_PARAMS}, "qwen25")
    assert isinstance(ebnf, str) and "root ::=" in ebnf
    xgr.Grammar.from_ebnf(ebnf)  # raises on a malformed grammar


def test_tool_call_grammar_accepts_exactly_the_compact_call(compiler: Any) -> None:
    ebnf = tool_call_ebnf({"f": F_PARAMS, "g": G_PARAMS}, "qwen25")
    assert accepts(compiler, ebnf, CALL_F)
    assert accepts(compiler, ebnf, '<tool_call>\n{"name": "g", "arguments": {"q": "x y"}}\n</tool_call>')
    # compact means exactly ", " and ": " separators: no other spacing
    assert not accepts(compiler, ebnf, '<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>')
    assert not accepts(compiler, ebnf, '<tool_call>\n{"name": "f",  "arguments": {"a": 1}}\n</tool_call>')
    # the format's framing is required
    assert not accepts(compiler, ebnf, '{"name": "f", "arguments": {"a": 1}}')
    assert not accepts(compiler, ebnf, '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')


def test_tool_call_grammar_rejects_unknown_function_and_bad_arguments(compiler: Any) -> None:
    ebnf = tool_call_ebnf({"f": F_PARAMS, "g": G_PARAMS}, "qwen25")
    assert not accepts(compiler, ebnf, '<tool_call>\n{"name": "h", "arguments": {"a": 1}}\n</tool_call>')
    assert not accepts(compiler, ebnf, '<tool_call>\n{"name": "f", "arguments": {"a": "1"}}\n</tool_call>')  # a is an integer
    assert not accepts(compiler, ebnf, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')  # a is required
    assert not accepts(compiler, ebnf, '<tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n</tool_call>')  # g's args for f


def test_length_bounded_strings_admit_only_what_json_allows_raw(compiler: Any) -> None:
    """A ``maxLength`` argument (pydantic's ``Field(max_length=...)`` in a function tool): xgrammar 0.2.9's bounded-string
    rule admitted raw control characters, so a sampled tab made the call unparsable and it came back as text."""
    params = {"type": "object", "properties": {"expr": {"type": "string", "maxLength": 8}}, "required": ["expr"]}
    ebnf = tool_call_ebnf({"calc": params}, "qwen25")
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "%s"}}\n</tool_call>'
    assert accepts(compiler, ebnf, call % "2+3")
    assert not accepts(compiler, ebnf, call % "2\t+3") and not accepts(compiler, ebnf, call % "2\x01")
    assert not accepts(compiler, ebnf, call % "123456789")  # still at most 8 characters
    raw = xgr.Grammar.from_json_schema(json.dumps(params), any_whitespace=False)  # what xgrammar alone admits
    assert xgr.testing._is_grammar_accept_string(raw, '{"expr": "2\t+3"}')
    fields = {"tools": TOOLS, "tool_choice": "auto", "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": params}}}
    fmt = grammar_for(to_internal(chat(**fields)), "qwen25")  # tools or the format: the union grammar
    assert fmt is not None and not accepts(compiler, fmt.spec, '{"expr": "a\tb"}') and accepts(compiler, fmt.spec, '{"expr": "ab"}')


def test_named_choice_grammar_admits_only_that_function(compiler: Any) -> None:
    ebnf = tool_call_ebnf({"g": G_PARAMS}, "qwen25")
    assert accepts(compiler, ebnf, '<tool_call>\n{"name": "g", "arguments": {"q": "x"}}\n</tool_call>')
    assert not accepts(compiler, ebnf, CALL_F)


def test_tool_call_grammar_token_by_token_then_eos(compiler: Any, tok: Any) -> None:
    m = xgr.GrammarMatcher(compiler.compile_grammar(tool_call_ebnf({"f": F_PARAMS}, "qwen25")))
    for t in tok.encode(CALL_F, add_special_tokens=False):
        assert m.accept_token(t)
    assert not m.is_terminated()
    assert m.accept_token(2)  # eos once the call is complete
    assert m.is_terminated()


def test_hermes_aliases_share_the_format(compiler: Any) -> None:
    for name in ("hermes", "qwen"):
        assert accepts(compiler, tool_call_ebnf({"f": F_PARAMS}, name), CALL_F)


def test_llama3_format_uses_parameters_key(compiler: Any) -> None:
    ebnf = tool_call_ebnf({"f": F_PARAMS}, "llama3")
    assert accepts(compiler, ebnf, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}')
    assert not accepts(compiler, ebnf, '<|python_tag|>{"name": "f", "arguments": {"a": 1}}')


@pytest.mark.parametrize("parser", ["pythonic", "mistral", "nope"])
def test_unsupported_parser_for_forced_calls(parser: str) -> None:
    with pytest.raises(InvalidRequest) as ei:
        tool_call_ebnf({"f": F_PARAMS}, parser)
    assert ei.value.param == "tool_choice"
    assert repr(parser) in str(ei.value)


def test_grammar_for_required_with_unsupported_parser() -> None:
    with pytest.raises(InvalidRequest) as ei:
        grammar_for(to_internal(chat(tools=TOOLS, tool_choice="required")), "pythonic")
    assert ei.value.param == "tool_choice"


# ---- openai_schemas validation ---------------------------------------------------------------


def invalid(fields: dict[str, Any], messages: list[dict[str, Any]] | None = None) -> APIError:
    body = {"model": "tiny", "messages": USER if messages is None else messages, **fields}
    with pytest.raises(ValidationError) as ei:
        ChatCompletionRequest.model_validate(body)
    err = from_validation(ei.value)
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.code == "invalid_value"
    return err


def test_stop_list_over_four_rejected() -> None:
    err = invalid({"stop": ["a", "b", "c", "d", "e"]})
    assert err.param == "stop"
    assert "at most 4 stop sequences" in err.message
    assert chat(stop=["a", "b", "c", "d"]).stop == ["a", "b", "c", "d"]
    assert chat(stop="END").stop == "END"


def test_top_logprobs_requires_logprobs() -> None:
    err = invalid({"top_logprobs": 3})
    assert err.param == "top_logprobs"
    assert "top_logprobs requires logprobs" in err.message
    assert chat(top_logprobs=3, logprobs=True).top_logprobs == 3
    assert invalid({"top_logprobs": 21, "logprobs": True}).param == "top_logprobs"


def test_stream_options_require_stream() -> None:
    err = invalid({"stream_options": {"include_usage": True}})
    assert err.param == "stream_options"
    assert "stream_options is only allowed when stream is true" in err.message
    assert chat(stream=True, stream_options={"include_usage": True}).stream_options is not None


def test_tool_choice_required_or_named_needs_tools() -> None:
    err = invalid({"tool_choice": "required"})
    assert err.param == "tool_choice"
    assert "tool_choice requires tools" in err.message
    assert invalid({"tool_choice": {"type": "function", "function": {"name": "f"}}}).param == "tool_choice"
    err = invalid({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "zz"}}})
    assert err.param == "tool_choice"
    assert "'zz'" in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
    ],
)
def test_out_of_range_penalties_and_logit_bias_rejected(fields: dict[str, Any], param: str) -> None:
    assert invalid(fields).param == param


def test_zero_penalties_are_accepted() -> None:
    r = chat(presence_penalty=0, frequency_penalty=0.0)
    assert r.presence_penalty == 0 and r.frequency_penalty == 0


def test_invalid_json_schema_rejected_in_response_format_and_tools() -> None:
    err = invalid({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "nope"}}}})
    assert err.param == "response_format.json_schema.schema"
    assert "invalid JSON schema" in err.message
    err = invalid({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]})
    assert err.param == "tools[0].function.parameters"
    assert "invalid JSON schema" in err.message


def test_response_format_json_schema_needs_schema_object() -> None:
    err = invalid({"response_format": {"type": "json_schema"}})
    assert err.param == "response_format"


def test_auto_tools_with_an_output_format_admit_a_call_or_the_formatted_answer(compiler) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": OK_SCHEMA}}
    g = grammar_for(to_internal(chat(tools=TOOLS, response_format=fmt)), "qwen25")
    assert g is not None and g.kind == "ebnf"
    assert accepts(compiler, g.spec, CALL_F)
    assert accepts(compiler, g.spec, '{"ok": true}')
    assert not accepts(compiler, g.spec, "plain text")
    assert not accepts(compiler, g.spec, '{"ok": "yes"}')
    # a forced choice still decodes exactly one call, whatever the format
    forced = grammar_for(to_internal(chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})), "qwen25")
    assert forced == Grammar("ebnf", tool_call_ebnf({"f": F_PARAMS, "g": G_PARAMS}, "qwen25"))


def test_field_range_errors_name_the_field() -> None:
    assert invalid({"temperature": 3}).param == "temperature"
    assert invalid({"top_p": 0}).param == "top_p"
    assert invalid({"n": 17}).param == "n"
    assert invalid({"max_tokens": 0}).param == "max_tokens"
    assert invalid({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}).param == "tools[0].function.name"


def test_unknown_fields_are_ignored() -> None:
    assert chat(some_future_field={"x": 1}).model == "tiny"


def test_message_errors_name_the_message_field() -> None:
    err = invalid({}, messages=[{"role": "user", "content": "hi"}, {"role": "tool", "content": "r"}])
    assert err.param == "messages[1].tool_call_id"
    assert err.message == "'messages[1].tool_call_id' is a required property"
    err = invalid({}, messages=[{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
    assert err.param == "messages[1].role"
    err = invalid({}, messages=[])
    assert err.param == "messages"
    err = invalid({}, messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}])
    assert err.param == "messages[0].tool_calls[0].function.arguments"


def test_missing_model_is_required_property() -> None:
    with pytest.raises(ValidationError) as ei:
        ChatCompletionRequest.model_validate({"messages": USER})
    err = from_validation(ei.value)
    assert (err.param, err.message) == ("model", "'model' is a required property")


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("messages", 0, "tool", "tool_call_id"), "messages[0].tool_call_id"),
        (("messages", 2, "user", "content", "str"), "messages[2].content"),
        (("messages", 0, "user", "content", "list[tagged-union[TextPart,UnsupportedPart]]", 1, "text", "text"), "messages[0].content[1].text"),
        (("tools", 0, "function", "parameters"), "tools[0].function.parameters"),
        (("tool_choice", "literal['none','auto','required']"), "tool_choice"),
        (("temperature",), "temperature"),
        ((), None),
    ],
)
def test_param_of(loc: tuple[Any, ...], param: str | None) -> None:
    assert param_of(loc) == param


def test_from_engine_overloaded_is_429_with_retry_after() -> None:
    err = from_engine(EngineOverloaded("server overloaded: 3 requests waiting", retry_after=2.4))
    assert err.status == 429
    assert err.headers == {"Retry-After": "2"}
    assert err.body() == {
        "error": {"message": "server overloaded: 3 requests waiting", "type": "rate_limit_error", "param": None, "code": "server_overloaded"}
    }
    assert from_engine(EngineOverloaded("x", retry_after=0.1)).headers == {"Retry-After": "1"}  # never 0


def test_from_engine_invalid_request_is_400_with_param_and_code() -> None:
    err = from_engine(InvalidRequest("too long", param="messages", code="context_length_exceeded"))
    assert err.status == 400
    assert err.body() == {"error": {"message": "too long", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}
    assert from_engine(InvalidRequest("bad grammar", param="response_format")).code == "invalid_value"


def test_from_engine_closed_is_503() -> None:
    err = from_engine(EngineClosed("engine shut down at /secret/path"))
    assert err.status == 503
    assert err.type == "server_error"
    assert err.code == "engine_unavailable"
    assert "/secret/path" not in err.message


def test_from_engine_adapter_error_is_404() -> None:
    err = from_engine(AdapterError("adapter 'x' is not loaded"))
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")


def test_from_engine_generic_error_is_500_without_internals() -> None:
    err = from_engine(EngineError("CUDA error: device-side assert at /opt/model.py:42"))
    assert err.status == 500
    assert err.body() == {"error": {"message": "generation failed", "type": "server_error", "param": None, "code": "internal_error"}}
    assert "CUDA" not in str(err) and "model.py" not in json.dumps(err.body())
    assert err.headers == {}
