"""runtime/chat_format.py: messages + tools → the exact prompt text and token ids (tiny ChatML tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from runtime.api.openai_schemas import ChatCompletionRequest
from runtime.chat_format import ChatFormatter
from runtime.engine import InvalidRequest

DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def fmt(tok: Any) -> ChatFormatter:
    return ChatFormatter(tok)


def req(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": "tiny", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    return ChatCompletionRequest.model_validate(body)


def render_text(fmt: ChatFormatter, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    r = req(messages, tools)
    return fmt.render(r.messages, r.tools).text


def test_hermes_path_for_template_without_tools(fmt: ChatFormatter) -> None:
    assert fmt.native_tools is False
    assert fmt.parser_name == "qwen25"


def test_plain_chat_renders_chatml_with_default_system_prompt(fmt: ChatFormatter) -> None:
    text = render_text(fmt, [{"role": "user", "content": "What is 2+2?"}])
    assert text == DEFAULT_SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_multi_turn_with_system_message(fmt: ChatFormatter) -> None:
    text = render_text(
        fmt,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
        ],
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nbye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_developer_role_renders_as_system(fmt: ChatFormatter) -> None:
    text = render_text(fmt, [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "x"}])
    assert text == "<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_tools_without_system_message_get_their_own_system_block(fmt: ChatFormatter) -> None:
    text = render_text(fmt, [{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL, TIME_TOOL])
    assert text == ("<|im_start|>system\n" + TOOLS_BLOCK + "<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n")


def test_tools_appended_to_existing_system_message(fmt: ChatFormatter) -> None:
    text = render_text(
        fmt,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
    )
    assert text == ("<|im_start|>system\nBe brief.\n\n" + TOOLS_BLOCK + "<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n")
    # one JSON line per tool inside <tools>, each a faithful dump of the tool
    inner = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")
    assert [json.loads(line) for line in inner] == [WEATHER_TOOL, TIME_TOOL]


def test_assistant_tool_calls_and_merged_tool_responses(fmt: ChatFormatter) -> None:
    text = render_text(
        fmt,
        [
            {"role": "user", "content": "weather and time?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        ],
    )
    assert text == (
        DEFAULT_SYSTEM + "<|im_start|>user\nweather and time?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_assistant_content_precedes_its_tool_call(fmt: ChatFormatter) -> None:
    text = render_text(
        fmt,
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "u"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "r1"},
            {"role": "assistant", "content": "done"},
            {"role": "tool", "tool_call_id": "c9", "content": "late"},
        ],
    )
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
        '<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\ndone<|im_end|>\n"
        # a tool message after an assistant turn starts a new user turn (not merged across turns)
        "<|im_start|>user\n<tool_response>\nlate\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_text_content_parts_are_joined(fmt: ChatFormatter) -> None:
    text = render_text(
        fmt,
        [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
    )
    assert text == DEFAULT_SYSTEM + "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"


def test_image_part_is_rejected_with_param(fmt: ChatFormatter) -> None:
    r = req(
        [
            {"role": "system", "content": "S"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
        ]
    )
    with pytest.raises(InvalidRequest) as ei:
        fmt.render(r.messages, None)
    assert ei.value.param == "messages[1].content[1]"
    assert "image_url" in str(ei.value)


def test_invalid_prior_tool_call_arguments_are_rejected(fmt: ChatFormatter) -> None:
    r = req(
        [
            {"role": "user", "content": "u"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{not json"}},
                ],
            },
        ]
    )
    with pytest.raises(InvalidRequest) as ei:
        fmt.render(r.messages, None)
    assert ei.value.param == "messages[1].tool_calls[1].function.arguments"


def test_token_ids_are_the_encoded_text(fmt: ChatFormatter, tok: Any) -> None:
    r = req([{"role": "user", "content": "Paris weather 😀 東京"}], tools=[WEATHER_TOOL])
    out = fmt.render(r.messages, r.tools)
    assert isinstance(out.token_ids, tuple)
    assert list(out.token_ids) == tok.encode(out.text, add_special_tokens=False)
    # special tokens are single ids (1 = <|im_start|>, 2 = <|im_end|>), not split into bytes
    assert out.token_ids[0] == 1
    assert out.token_ids.count(1) == 3 and out.token_ids.count(2) == 2


def test_tokenizer_without_chat_template_is_refused(tiny_model_path: Path) -> None:
    t = AutoTokenizer.from_pretrained(tiny_model_path)
    t.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        ChatFormatter(t)


# ---- native tool templates -----------------------------------------------------------------

NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}"
    "({{ t['function']['parameters']['properties'] | list | join(',') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<|python_tag|>"
    "{{ c['function']['name'] }}:{{ c['function']['arguments']['city'] }}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture()
def native_tok(tiny_model_path: Path) -> Any:
    t = AutoTokenizer.from_pretrained(tiny_model_path)
    t.chat_template = NATIVE_TEMPLATE
    return t


def test_native_template_receives_tools_and_calls(native_tok: Any) -> None:
    f = ChatFormatter(native_tok, model_type="llama")
    assert f.native_tools is True
    assert f.parser_name == "llama3"  # parser_for_model saw <|python_tag|> in the template
    r = req(
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
            },
        ],
        tools=[WEATHER_TOOL],
    )
    out = f.render(r.messages, r.tools)
    # tools went to the template (no Hermes block), and arguments arrived as an object
    assert out.text == (
        "<|im_start|>system\nTOOLS: get_weather(city)<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n<|python_tag|>get_weather:Oslo<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert list(out.token_ids) == native_tok.encode(out.text, add_special_tokens=False)


def test_native_template_without_tools(native_tok: Any) -> None:
    f = ChatFormatter(native_tok)
    r = req([{"role": "user", "content": "hi"}])
    assert f.render(r.messages, None).text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_native_parser_defaults_to_qwen25_and_explicit_parser_wins(native_tok: Any) -> None:
    native_tok.chat_template = NATIVE_TEMPLATE.replace("<|python_tag|>", "")
    assert ChatFormatter(native_tok).parser_name == "qwen25"
    assert ChatFormatter(native_tok, parser="mistral").parser_name == "mistral"


# Llama 3.1's template: a turn with two tool calls (what a parallel call sends back as history) is refused by the template
LLAMA_LIKE_TEMPLATE = (
    "{% for m in messages %}{% if m['tool_calls'] is defined and m['tool_calls'] | length != 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if tools %}{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a template that reads messages[0]: an empty conversation fails inside it
FIRST_MESSAGE_TEMPLATE = "{{ messages[0]['role'] }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_a_template_refusing_the_conversation_is_a_400_naming_the_messages(tiny_model_path: Path) -> None:
    t = AutoTokenizer.from_pretrained(tiny_model_path)
    t.chat_template = LLAMA_LIKE_TEMPLATE
    f = ChatFormatter(t, model_type="llama")
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
        for i, c in enumerate(("Oslo", "Rome"))
    ]
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "cold"},
        {"role": "tool", "tool_call_id": "c1", "content": "warm"},
    ]
    r = req(messages, tools=[WEATHER_TOOL])
    with pytest.raises(InvalidRequest, match="single tool-calls") as info:
        f.render(r.messages, r.tools)
    assert info.value.param == "messages"


def test_an_empty_conversation_is_a_400_before_the_template_reads_it(tiny_model_path: Path) -> None:
    t = AutoTokenizer.from_pretrained(tiny_model_path)
    t.chat_template = FIRST_MESSAGE_TEMPLATE
    with pytest.raises(InvalidRequest, match="empty") as info:
        ChatFormatter(t).render_plain([], None)
    assert info.value.param == "messages"
