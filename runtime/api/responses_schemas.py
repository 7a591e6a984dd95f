"""The OpenAI Responses request (``POST /v1/responses``) and its input items, validated into the internal vocabulary.

:class:`ResponsesRequest` validates the top-level fields (unknown ones are ignored, as OpenAI-compatible
servers do). Input items are read by :func:`items_to_messages`, which turns them into chat-template
messages: ``message`` items (``input_text``/``output_text``/``refusal`` parts; ``developer`` is a system
message), ``function_call`` items (joined to the assistant message before them, as one turn's calls),
``function_call_output`` items (tool results) and ``reasoning`` items (skipped: the model here does not
reason in a separate channel). :func:`function_tools` reads the flat function tools. Anything this
server cannot serve (images, files, hosted tools, ``item_reference``) is a 400 naming the item.

Not here: chaining and storing (``runtime/api/responses.py``, ``runtime/api/response_store.py``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, cast

from pydantic import Field, ValidationError, model_validator

from runtime.api.openai_schemas import FieldError, FunctionDef, _In, check_json_schema
from runtime.engine import InvalidRequest
from runtime.gen_request import NamedTool, OutputFormat, ToolChoice
from runtime.json_text import loads_json_text

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextFormat(_In):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema":
            if self.schema_ is None or self.name is None:
                raise FieldError("text.format", "text.format of type json_schema needs a name and a schema")
            check_json_schema(self.schema_)
        return self


class TextConfig(_In):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_In):
    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=200)
    store: bool | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # loopwise extension (extra_body), as in chat
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: Any = None

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.background:
            raise FieldError("background", "background responses are not supported by this server; send the request without background")
        if self.conversation is not None:
            raise FieldError("conversation", "conversations are not supported by this server; chain responses with previous_response_id")
        if self.metadata is not None and (len(self.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())):
            raise FieldError("metadata", "metadata holds at most 16 pairs, keys of at most 64 characters and values of at most 512")
        if isinstance(self.input, str) and not self.input and self.previous_response_id is None:
            raise FieldError("input", "input must not be empty")
        return self

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def output_format(self) -> OutputFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return OutputFormat("json_object")
        return OutputFormat("json_schema", fmt.schema_, fmt.name)


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Flat Responses function tools → chat-shaped tool dicts (the internal form)."""
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(f"tool type {kind!r} is not supported by this server; only function tools are", param=f"tools[{i}].type")
        spec = {k: tool[k] for k in ("name", "description", "strict") if tool.get(k) is not None}
        if tool.get("parameters") is not None:
            spec["parameters"] = tool["parameters"]
        try:
            fn = FunctionDef.model_validate(spec)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            raise InvalidRequest(f"Invalid value for 'tools[{i}].{where}': {msg}", param=f"tools[{i}].{where}") from None
        out.append({"type": "function", "function": fn.model_dump(exclude_none=True)})
    return out


def tool_choice_of(choice: Any, tools: list[dict[str, Any]]) -> tuple[ToolChoice, list[dict[str, Any]]]:
    """Responses ``tool_choice`` → the internal choice, and the tools it allows."""
    names = {t["function"]["name"] for t in tools}
    if choice is None or isinstance(choice, str):
        if choice in ("required",) and not tools:
            raise InvalidRequest("tool_choice requires tools", param="tool_choice")
        return cast(ToolChoice, choice), tools
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        return NamedTool(name), tools
    if kind == "allowed_tools":
        listed = choice.get("tools")
        listed = listed if isinstance(listed, list) else []
        allowed = {t.get("name") for t in listed if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)}
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required") or not allowed or not allowed <= names:
            raise InvalidRequest("tool_choice allowed_tools needs mode auto or required and function tools that are in tools", param="tool_choice")
        return mode, [t for t in tools if t["function"]["name"] in allowed]
    raise InvalidRequest(f"tool_choice of type {str(kind)[:64]!r} is not supported by this server", param="tool_choice")


# ---- input items ----------------------------------------------------------------------------------


def normalize_items(raw: str | list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """Input as a list of items, each with a ``type`` and an ``id`` (what ``input_items`` lists)."""
    if isinstance(raw, str):
        return [{"type": "message", "id": _id("msg_"), "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise InvalidRequest("each input item must be an object", param=f"{param}[{i}]")
        item = dict(item)
        kind = item.get("type") or ("message" if "role" in item else None)
        if not isinstance(kind, str):
            raise InvalidRequest("input item needs a type (message, function_call, function_call_output)", param=f"{param}[{i}].type")
        item["type"] = kind
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", _id({"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}.get(kind, "item_")))
        out.append(item)
    return out


def items_to_messages(items: list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """Normalized input items → chat-template messages (see the module docstring)."""
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        kind = item["type"]
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"message role must be user, assistant, system or developer, not {role!r}", param=f"{where}.role")
            msgs.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, str):
                raise InvalidRequest("a function_call item needs name, call_id and arguments (a JSON string)", param=where)
            try:
                parsed = loads_json_text(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"function_call arguments are not valid JSON: {exc.msg}", param=f"{where}.arguments") from exc
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
            if msgs and msgs[-1]["role"] == "assistant":  # the calls of one turn follow its message
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise InvalidRequest("a function_call_output item needs call_id", param=f"{where}.call_id")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequest(f"input items of type {kind!r} are not supported by this server", param=f"{where}.type")
    return msgs


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of content parts", param=param)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise InvalidRequest(f"{kind} content is not supported by this model", param=f"{param}[{j}]")
        else:
            raise InvalidRequest(f"content part of type {kind!r} is not supported", param=f"{param}[{j}]")
    return "".join(out)


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]
