"""Chat messages + tools → the exact prompt token ids the engine sees. The runtime's only templating step.

Models whose chat template has a tool section (it references ``tools``) get the tools and tool calls
through the template itself, Hugging Face style. Models without one (SmolLM2 among them) get tools
rendered the Hermes/Qwen2.5 way: a system block listing the function signatures in ``<tools>`` and
asking for ``<tool_call>{"name": …, "arguments": …}</tool_call>``; earlier assistant tool calls are
rendered back in that format and tool results as a user turn of ``<tool_response>`` blocks. The
``qwen25`` parser then reads the model's calls.

A final assistant message marked ``"prefix": True`` (Mistral's spelling; Anthropic's prefill) is
continued, not answered: the prompt ends with its text, without the end-of-turn token after it
(``continue_final_message``), and the reply is the continuation only.

Not here: validation of request fields (``runtime/api/openai_schemas.py``) or parsing of output (``tool_parsers``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from runtime.api.openai_schemas import (
    AssistantMessage,
    FunctionMessage,
    Message,
    RefusalPart,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolMessage,
    UnsupportedPart,
)
from runtime.engine import InvalidRequest
from runtime.json_text import loads_json_text
from runtime.tool_parsers import parser_for_model

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: tuple[int, ...]


class ChatFormatter:
    """Holds the tokenizer and the template's capabilities; ``render`` is a pure function of its inputs."""

    def __init__(self, tokenizer: Any, model_type: str | None = None, parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template
        if not template:
            raise ValueError("the tokenizer has no chat_template; loopwise needs one to serve chat")
        self.native_tools = "tools" in template
        self.parser_name = parser or (parser_for_model(model_type, template) if self.native_tools else "qwen25")

    def render(self, messages: list[Message], tools: list[Tool] | None) -> RenderedPrompt:
        plain = [to_plain(m, i) for i, m in enumerate(messages)]
        return self.render_plain(plain, [t.model_dump(exclude_none=True) for t in tools] if tools else None)

    def render_plain(self, plain: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool = True) -> RenderedPrompt:
        """Render chat-template dicts (tool call arguments as objects) and OpenAI tool dicts; a prefill is continued."""
        kwargs: dict[str, Any] = {}
        prefill = is_prefill(plain)
        if prefill:
            kwargs["continue_final_message"] = True
            add_generation_prompt = False
        if self.native_tools:
            if tools:
                kwargs["tools"] = tools
        else:
            plain = hermes_messages(plain, tools)
        if not plain:  # templates read messages[0]: an empty conversation failed inside one (a 500)
            raise InvalidRequest("the conversation is empty: send at least one message", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        except ValueError as exc:
            if not prefill:
                raise
            # transformers' check that the template kept the final message's text where the prompt can end
            raise InvalidRequest("this model's chat template cannot continue a final assistant message", param="messages") from exc
        except TemplateError as exc:
            # the template refused the conversation (its raise_exception: Llama 3.1 takes one tool call per turn, Mistral's
            # alternate user/assistant roles) or read a field the messages lack: the request's shape, not the server
            raise InvalidRequest(f"this model's chat template cannot render these messages: {exc}", param="messages") from exc
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return RenderedPrompt(text=text, token_ids=tuple(ids))


def is_prefill(plain: list[dict[str, Any]]) -> bool:
    """Whether the conversation ends with an assistant message marked ``prefix``: a reply to continue."""
    return bool(plain) and plain[-1]["role"] == "assistant" and plain[-1].get("prefix") is True


def text_of(content: Any, param: str) -> str:
    """Join text parts; reject media parts with a clear 400."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        if isinstance(part, UnsupportedPart):
            raise InvalidRequest(f"{part.type} content is not supported by this model", param=f"{param}[{j}]")
        if isinstance(part, RefusalPart):
            out.append(part.refusal)
            continue
        assert isinstance(part, TextPart)
        out.append(part.text)
    return "".join(out)


def to_plain(msg: Message, i: int) -> dict[str, Any]:
    """A validated message as a Hugging Face chat-template dict (tool call arguments as objects)."""
    if isinstance(msg, FunctionMessage):  # legacy function result: a tool result for the call named like it
        return {"role": "tool", "content": text_of(msg.content, f"messages[{i}].content"), "tool_call_id": legacy_call_id(msg.name)}
    role = "system" if isinstance(msg, SystemMessage) else msg.role
    d: dict[str, Any] = {"role": role, "content": text_of(msg.content, f"messages[{i}].content")}
    if isinstance(msg, AssistantMessage) and not d["content"] and msg.refusal:
        d["content"] = msg.refusal  # a refusal sent back as history is what the model said
    tool_calls = msg.tool_calls if isinstance(msg, AssistantMessage) else None
    if isinstance(msg, AssistantMessage) and msg.function_call is not None and not tool_calls:
        tool_calls = [ToolCall(id=legacy_call_id(msg.function_call.name), function=msg.function_call)]
    if tool_calls:
        calls = []
        for j, call in enumerate(tool_calls):
            try:
                args = loads_json_text(call.function.arguments) if call.function.arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise InvalidRequest(
                    f"tool call arguments are not valid JSON: {exc.msg}",
                    param=f"messages[{i}].tool_calls[{j}].function.arguments",
                ) from exc
            calls.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}})
        d["tool_calls"] = calls
    if isinstance(msg, ToolMessage):
        d["tool_call_id"] = msg.tool_call_id
    return d


def legacy_call_id(name: str) -> str:
    """The call id that pairs a legacy ``function_call`` with the ``role: "function"`` message answering it."""
    return f"call_{name}"


def hermes_messages(plain: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Rewrite messages for a template without a tool section (Hermes / Qwen2.5 conventions)."""
    out: list[dict[str, Any]] = []
    if tools:
        block = TOOLS_PREAMBLE + "\n".join(json.dumps(t) for t in tools) + TOOLS_POSTAMBLE
        if plain and plain[0]["role"] == "system":
            out.append({"role": "system", "content": plain[0]["content"] + "\n\n" + block})
            plain = plain[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in plain:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}) + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            content = (m["content"] + "\n" if m["content"] else "") + calls
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            block = "<tool_response>\n" + m["content"] + "\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("_tool", None)
    return out
