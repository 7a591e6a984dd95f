"""Tests for runtime.tool_parsers, using strings in the formats models really emit."""

import dataclasses
import json
import re

import pytest

from runtime.tool_parsers import (
    PARSERS,
    ParsedToolCall,
    ToolCallParser,
    UnknownToolParser,
    available_parsers,
    get_parser,
    new_call_id,
    parser_for_model,
)


def calls(result):
    """[(name, arguments-dict), ...] for exact comparison."""
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


# --- common ---------------------------------------------------------------


def test_new_call_id_format_and_uniqueness():
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_registry_names_and_aliases():
    assert available_parsers() == sorted(["hermes", "llama3", "mistral", "pythonic", "qwen", "qwen25"])
    assert PARSERS["hermes"] is PARSERS["qwen"] is PARSERS["qwen25"]
    for name in available_parsers():
        parser = get_parser(name)
        assert isinstance(parser, ToolCallParser)
        assert parser.name == PARSERS[name].name


def test_get_parser_unknown_name_lists_known_names():
    with pytest.raises(UnknownToolParser) as exc:
        get_parser("deepseekv3")
    assert isinstance(exc.value, KeyError) and isinstance(exc.value, ValueError)
    msg = str(exc.value)
    assert "deepseekv3" in msg
    for name in available_parsers():
        assert name in msg


@pytest.mark.parametrize(
    ("model_type", "template", "expected"),
    [
        ("llama", "{{- '<|python_tag|>' + tool_call.name }}<|start_header_id|>", "llama3"),
        ("llama", "<|start_header_id|>ipython<|end_header_id|>{{ tool }}", "llama3"),
        ("llama", "{% for m in messages %}<|user|>{{ m.content }}{% endfor %}", "qwen25"),
        ("mistral", "{{ '[TOOL_CALLS] [' }}{% for t in tool_calls %}", "mistral"),
        ("mistral", "[INST] {{ message['content'] }} [/INST]", "qwen25"),
        ("llama4", "{{- '<|python_start|>' }}", "pythonic"),
        ("qwen2", '<tool_call>\n{"name": ...}\n</tool_call>', "qwen25"),
        ("llama", None, "qwen25"),  # e.g. SmolLM2: no tool section in its template
        (None, None, "qwen25"),
    ],
)
def test_parser_for_model(model_type, template, expected):
    assert parser_for_model(model_type, template) == expected


def test_results_are_frozen():
    call = ParsedToolCall("f", "{}", new_call_id())
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.name = "g"


# --- qwen25 / hermes --------------------------------------------------------

QWEN = get_parser("qwen25")


def test_qwen_single_call():
    text = '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>'
    r = QWEN.parse(text)
    assert r.content is None
    assert calls(r) == [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})]
    assert re.fullmatch(r"call_[0-9a-f]{24}", r.tool_calls[0].id)


def test_qwen_multiple_calls_with_text_before():
    text = (
        "Let me check both cities.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
    )
    r = QWEN.parse(text)
    assert r.content == "Let me check both cities."
    assert calls(r) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})]
    assert r.tool_calls[0].id != r.tool_calls[1].id


def test_qwen_parameters_key_and_compact_whitespace():
    r = get_parser("hermes").parse('<tool_call>{"name":"f","parameters":{"x":1}}</tool_call>')
    assert calls(r) == [("f", {"x": 1})]


def test_qwen_no_call_content_unchanged():
    text = "The capital of France is Paris.\n\nIt has about 2 million people."
    r = QWEN.parse(text)
    assert r.content == text and r.tool_calls == []
    assert not QWEN.detect(text)


def test_qwen_malformed_markup_without_a_readable_head_kept_as_content():
    good = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    for bad in (
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",  # not JSON
        '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"\n</tool_call>',  # the name not first
        '<tool_call>\n{"name": "get_weather", "arguments": "city=Paris"\n</tool_call>',  # arguments not an object
    ):
        r = QWEN.parse("Hi " + bad + "\n" + good)
        assert r.content == "Hi " + bad
        assert calls(r) == [("get_time", {})]


def test_qwen_malformed_json_with_a_readable_head_is_a_call_with_the_models_arguments():
    # the JSON does not parse, but the call is known by its head: its arguments are the model's text, as streamed
    unclosed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
    good = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    r = QWEN.parse("Hi " + unclosed + "\n" + good)
    assert r.content == "Hi"
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("get_weather", '{"city": "Paris"\n'), ("get_time", "{}")]
    wrapper_unclosed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
    r = QWEN.parse(wrapper_unclosed)
    assert r.content is None and calls(r) == [("get_weather", {"city": "Paris"})]
    invalid = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call> Done.'
    r = QWEN.parse(invalid, tool_names={"get_weather"})
    assert r.content == "Done." and [(c.name, c.arguments) for c in r.tool_calls] == [("get_weather", '{"city": Paris}')]
    # an unknown tool stays content, readable head or not
    r = QWEN.parse(invalid, tool_names={"get_time"})
    assert r.content == invalid and r.tool_calls == []


def test_qwen_unclosed_final_block():
    r = QWEN.parse('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n')
    assert r.content == "Sure." and calls(r) == [("f", {"a": [1, 2]})]
    cut = 'Sure.\n<tool_call>\n{"name": "f", "argum'
    r = QWEN.parse(cut)
    assert r.content == cut and r.tool_calls == []


def test_qwen_unknown_tool_name_kept_as_content():
    unknown = '<tool_call>\n{"name": "delete_files", "arguments": {"path": "/"}}\n</tool_call>'
    known = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    r = QWEN.parse(unknown + "\n" + known, tool_names={"get_weather"})
    assert r.content == unknown
    assert calls(r) == [("get_weather", {"city": "Oslo"})]


def test_qwen_unicode_and_nested_arguments():
    args = {"city": "Zürich", "note": "天气 ☀️", "filters": {"days": [1, 2], "opts": {"hourly": True, "x": None}}}
    r = QWEN.parse(f"<tool_call>\n{json.dumps({'name': 'forecast', 'arguments': args}, ensure_ascii=False)}\n</tool_call>")
    assert calls(r) == [("forecast", args)]
    assert "Zürich" in r.tool_calls[0].arguments  # ensure_ascii=False


@pytest.mark.parametrize(
    ("text", "hold"),
    [("Hello <tool", 6), ("Hello", 5), ("", 0), ("a <", 2), ("x <tool_call>\n{", 2), ("a <b>", 5)],
)
def test_qwen_stream_hold_index(text, hold):
    assert QWEN.stream_hold_index(text) == hold


# --- llama3 -----------------------------------------------------------------

LLAMA = get_parser("llama3")


def test_llama3_python_tag_single_call():
    r = LLAMA.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco"}}')
    assert r.content is None
    assert calls(r) == [("get_weather", {"city": "San Francisco"})]


def test_llama3_bare_json_and_multiple_semicolon_calls():
    text = '{"name": "get_weather", "parameters": {"city": "Paris; France"}}; {"name": "get_time", "arguments": {"tz": "CET"}}'
    r = LLAMA.parse(text)
    assert r.content is None
    assert calls(r) == [("get_weather", {"city": "Paris; France"}), ("get_time", {"tz": "CET"})]


def test_llama3_text_before_python_tag_and_eom_trailer():
    r = LLAMA.parse('I will look that up.<|python_tag|>{"name": "search", "parameters": {"q": "llamas"}}<|eom_id|>')
    assert r.content == "I will look that up."
    assert calls(r) == [("search", {"q": "llamas"})]


def test_llama3_no_call_and_plain_json_answer_are_content():
    for text in ["Paris is the capital of France.", '{"name": "Bob", "age": 42}', 'Answer: {"name": "f", "parameters": {}}']:
        r = LLAMA.parse(text)
        assert r.content == text and r.tool_calls == []


def test_llama3_malformed_json_kept_as_content():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par'
    r = LLAMA.parse(text)
    assert r.content == text and r.tool_calls == []


def test_llama3_unknown_tool_name_kept_as_content():
    text = '{"name": "rm", "parameters": {"path": "/"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    r = LLAMA.parse(text, tool_names={"get_weather"})
    assert r.content == '{"name": "rm", "parameters": {"path": "/"}}'
    assert calls(r) == [("get_weather", {"city": "Rome"})]


def test_llama3_unicode_nested_and_stringified_arguments():
    r = LLAMA.parse('<|python_tag|>{"name": "book", "parameters": {"guest": {"name": "José", "tags": ["vip", "日本"]}}}')
    assert calls(r) == [("book", {"guest": {"name": "José", "tags": ["vip", "日本"]}})]
    r = LLAMA.parse('{"name": "f", "parameters": "{\\"a\\": 1}"}')
    assert calls(r) == [("f", {"a": 1})]


@pytest.mark.parametrize(
    ("text", "hold"),
    [("Hello <|python", 6), ("Hello", 5), ('{"name": "get', 0), ('  {"na', 2), ("ok <|python_tag|>{", 3)],
)
def test_llama3_stream_hold_index(text, hold):
    assert LLAMA.stream_hold_index(text) == hold


# --- pythonic ---------------------------------------------------------------

PY = get_parser("pythonic")


def test_pythonic_llama32_single_call():
    r = PY.parse("[get_weather(city='San Francisco', metric='celsius')]")
    assert r.content is None
    assert calls(r) == [("get_weather", {"city": "San Francisco", "metric": "celsius"})]


def test_pythonic_multiple_calls_with_text_before():
    r = PY.parse('Checking now. [get_weather(city="Paris", unit="c"), other(x=1, ok=True, v=None)]')
    assert r.content == "Checking now."
    assert calls(r) == [("get_weather", {"city": "Paris", "unit": "c"}), ("other", {"x": 1, "ok": True, "v": None})]


def test_pythonic_llama4_wrappers_and_json_literals():
    r = PY.parse('<|python_start|>[search(q="x", exact=true, page=null)]<|python_end|>')
    assert r.content is None
    assert calls(r) == [("search", {"q": "x", "exact": True, "page": None})]


def test_pythonic_no_call_content_unchanged():
    for text in ["See [1] and [link text](http://x.y).", "Use [print(x) for x in y] in Python"]:
        r = PY.parse(text)
        assert r.content == text and r.tool_calls == []


def test_pythonic_positional_or_non_literal_args_are_content():
    for text in ["[get_weather('Paris')]", "[get_weather(city=Paris)]", "[f(**kw)]", "[get_weather(city='Par"]:
        r = PY.parse(text)
        assert r.content == text and r.tool_calls == []


def test_pythonic_unknown_tool_name_kept_as_content():
    r = PY.parse("[rm(path='/'), get_weather(city='Rome')]", tool_names={"get_weather"})
    assert r.content == "[rm(path='/')]"
    assert calls(r) == [("get_weather", {"city": "Rome"})]


def test_pythonic_unicode_and_nested_arguments():
    r = PY.parse("[plan(trip={'to': 'München', 'stops': [1, (2, 3)]}, note='☕')]")
    assert calls(r) == [("plan", {"trip": {"to": "München", "stops": [1, [2, 3]]}, "note": "☕"})]


@pytest.mark.parametrize(
    ("text", "hold"),
    [("Hello [get_wea", 6), ("Hello [", 6), ("Hello", 5), ("See [1] here", 12), ("x <|python_st", 2), ("[f(a=1)", 0)],
)
def test_pythonic_stream_hold_index(text, hold):
    assert PY.stream_hold_index(text) == hold


# --- mistral ----------------------------------------------------------------

MISTRAL = get_parser("mistral")


def test_mistral_single_call():
    text = '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]'
    r = MISTRAL.parse(text)
    assert r.content is None
    assert calls(r) == [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]


def test_mistral_multiple_calls_with_ids_and_text_before():
    text = 'Sure![TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "Ab3dEf9hI"}, {"name": "b", "arguments": {}}]'
    r = MISTRAL.parse(text)
    assert r.content == "Sure!"
    assert calls(r) == [("a", {"x": 1}), ("b", {})]
    assert r.tool_calls[0].id.startswith("call_")


def test_mistral_newer_name_args_style():
    r = MISTRAL.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{"tz": "CET"}')
    assert calls(r) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert r.content is None


def test_mistral_no_call_and_malformed_kept_as_content():
    assert MISTRAL.parse("Just text.").content == "Just text."
    text = 'Hm [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}'
    r = MISTRAL.parse(text)
    assert r.content == text and r.tool_calls == []


def test_mistral_unknown_tool_name_kept_as_content():
    text = '[TOOL_CALLS] [{"name": "rm", "arguments": {"p": "/"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    r = MISTRAL.parse(text, tool_names={"get_weather"})
    assert r.content == '[TOOL_CALLS] [{"name": "rm", "arguments": {"p": "/"}}]'
    assert calls(r) == [("get_weather", {"city": "Rome"})]


def test_mistral_unicode_nested_arguments():
    r = MISTRAL.parse('[TOOL_CALLS] [{"name": "order", "arguments": {"items": [{"sku": "café", "qty": 2}], "meta": {"ü": "✓"}}}]')
    assert calls(r) == [("order", {"items": [{"sku": "café", "qty": 2}], "meta": {"ü": "✓"}})]


@pytest.mark.parametrize(("text", "hold"), [("Hello [TOOL_C", 6), ("Hello", 5), ("ok [TOOL_CALLS] [", 3)])
def test_mistral_stream_hold_index(text, hold):
    assert MISTRAL.stream_hold_index(text) == hold


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("qwen25", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
        ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}'),
        ("pythonic", "[f()]"),
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}]'),
    ],
)
def test_detect_each_format_and_not_plain_text(name, text):
    parser = get_parser(name)
    assert parser.detect(text)
    assert not parser.detect("The weather in Paris is sunny.")
    assert calls(parser.parse(text)) == [("f", {})]


def test_qwen25_argument_string_may_contain_the_end_tag():
    # what a grammar-forced call can legally produce: the closing tag inside a JSON string argument
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": ">6 * 3}}</tool_call>x("}}\n</tool_call>'
    r = get_parser("qwen25").parse(text, {"calculator"})
    assert calls(r) == [("calculator", {"expression": ">6 * 3}}</tool_call>x("})] and not (r.content or "").strip()
    # a real second call after a first one still splits at the first tag
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in get_parser("qwen25").parse(two).tool_calls] == ["a", "b"]
