"""``POST /v1/messages``: Anthropic's Messages API as a thin translation over the one generation path.

Request: ``model``, ``max_tokens`` (required), ``messages`` (``user``/``assistant``, content a string
or blocks: ``text``, ``tool_use`` on the assistant side, ``tool_result`` on the user side), ``system``
(a string or text blocks), ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice``
(``auto``, ``any``, ``tool`` + ``name``, ``none``; ``disable_parallel_tool_use``), ``stop_sequences``,
``temperature``, ``top_p``, ``metadata.user_id`` (the session key when no ``X-Session-Id``), ``stream``,
``output_config.format`` (``{"type": "json_schema", "schema": …}``; also the structured-outputs beta's
top-level ``output_format``): the reply text is decoded under the schema's grammar, as chat's
``response_format`` is (``output_config.effort`` is accepted and has no effect).

Prefill: a final assistant message (a string or text blocks) is continued, not answered. The prompt is
the chat template up to the start of the assistant turn plus that text, without the end-of-turn token
(``chat_format``: the message is marked ``"prefix": True``), so the recorded turn's context is those
exact tokens; the reply's ``content`` is the continuation only, as at Anthropic. As at Anthropic, a
prefill ending in whitespace is a 400, and an empty final assistant message asks for an ordinary reply.
A prefill cannot be honoured, and is a 400, with a forced tool (``tool_choice`` ``any``/``tool``) or an
output format (their grammar decodes the whole reply, which would then not start where the prefill
ends), with ``tool_use`` blocks, or for a served agent (it runs its own turns).

The reply has ``content`` blocks (``text``, then one ``tool_use`` per call with ``input`` as an
object; a forced call that ``max_tokens`` cut has the longest prefix of its arguments that closes into an
object, ``{"city": "Par`` → ``{"city": "Par"}``, while its stream's ``input_json_delta`` events carry the
raw text as produced, as Anthropic streams it), ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence`` with ``stop_sequence``,
``tool_use``), ``usage`` and ``loopwise``. Streaming sends Anthropic's named events: ``message_start``,
per block ``content_block_start`` / ``content_block_delta`` (``text_delta``, or ``input_json_delta``
as the arguments decode) / ``content_block_stop``, then ``message_delta`` and ``message_stop``.
``POST /v1/messages/count_tokens`` counts the rendered prompt.

Errors use Anthropic's envelope (``{"type": "error", "error": {"type", "message"}}``; ``runtime/app.py``
picks it by path), which has no ``param``: a grammar error (which the engine files under chat's
``response_format``) names the field this client sent, ``output_config.format``/``output_format`` or ``tool_choice``.
Not served (a clear 400): images and documents, ``top_k``, extended thinking, an
output format type other than ``json_schema``.

Not here: the generation path (``runtime/serving.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError, model_validator
from starlette.background import BackgroundTask

from runtime.api.openai_schemas import FieldError, FunctionDef, _In, check_json_schema, stop_problem
from runtime.chat_format import is_prefill
from runtime.engine import InvalidRequest
from runtime.errors import APIError
from runtime.gen_request import GenRequest, NamedTool, OutputFormat
from runtime.generation import ChoiceDone, ChoiceOut, StreamFailed, TextDelta, ToolArgsDelta, ToolCallStart
from runtime.http_body import json_body
from runtime.json_text import MAX_DEPTH, loads_json_text
from runtime.services import services
from runtime.serving import Outcome

router = APIRouter()


class AnthropicTool(_In):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None

    @model_validator(mode="after")
    def _function_only(self) -> AnthropicTool:
        if self.type not in (None, "custom"):
            raise ValueError(f"tool type {self.type!r} is not supported by this server; only custom tools with an input_schema are")
        return self


class AnthropicToolChoice(_In):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicOutputFormat(_In):
    type: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class AnthropicOutputConfig(_In):
    format: AnthropicOutputFormat | None = None


class MessagesRequest(_In):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: AnthropicToolChoice | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicOutputFormat | None = None  # the structured-outputs beta's spelling of output_config.format

    @model_validator(mode="after")
    def _supported(self) -> MessagesRequest:
        self._check_format()
        if (problem := stop_problem(self.stop_sequences, most=16)) is not None:
            raise FieldError("stop_sequences", problem)
        if self.top_k is not None:
            raise FieldError("top_k", "top_k is not supported by this server; use top_p")
        if self.thinking is not None and self.thinking.get("type") == "enabled":
            raise FieldError("thinking", "extended thinking is not supported by this model")
        if self.tool_choice is not None and self.tool_choice.type == "tool":
            if not self.tools or self.tool_choice.name not in {t.name for t in self.tools}:
                raise FieldError("tool_choice", f"tool_choice names tool {self.tool_choice.name!r}, which is not in tools")
        if self.tool_choice is not None and self.tool_choice.type == "any" and not self.tools:
            raise FieldError("tool_choice", "tool_choice any requires tools")
        return self

    def _format(self) -> tuple[AnthropicOutputFormat | None, str]:
        """The output format asked for, and the field that asked."""
        fmt = self.output_config.format if self.output_config is not None else None
        if self.output_format is None:
            return fmt, "output_config.format"
        if fmt is not None:
            raise FieldError("output_format", "output_format and output_config.format cannot both be set; use output_config.format")
        return self.output_format, "output_format"

    def _check_format(self) -> None:
        """Anthropic's envelope has no ``param``, so each message names its field."""
        fmt, where = self._format()
        if fmt is None:
            return
        if fmt.type != "json_schema":
            raise FieldError(f"{where}.type", f"{where}.type {fmt.type!r} is not supported by this server; the only type is json_schema")
        if fmt.schema_ is None:
            raise FieldError(f"{where}.schema", f"{where} of type json_schema needs a schema")
        try:
            check_json_schema(fmt.schema_)
        except ValueError as exc:
            raise FieldError(f"{where}.schema", f"{where}.schema: {exc}") from None

    def structured(self) -> tuple[OutputFormat | None, str]:
        """The reply's decoding constraint (None: free text), and the field that asked for it."""
        fmt, where = self._format()
        return (OutputFormat("json_schema", fmt.schema_) if fmt is not None else None), where

    @property
    def user(self) -> str | None:
        uid = (self.metadata or {}).get("user_id")
        return uid if isinstance(uid, str) and uid else None


def to_internal(req: MessagesRequest) -> GenRequest:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _blocks_text(req.system, "system")})
    for i, m in enumerate(req.messages):
        messages += _message(m, f"messages[{i}]")
    output_format, format_param = req.structured()
    if messages and messages[-1]["role"] == "assistant":
        _prefill(req, messages, format_param if output_format is not None else None)
    tools = []
    for i, t in enumerate(req.tools or []):
        try:
            fn = FunctionDef.model_validate({"name": t.name, "description": t.description, "parameters": t.input_schema})
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            raise InvalidRequest(err["msg"].removeprefix("Value error, "), param=f"tools[{i}]") from None
        tools.append({"type": "function", "function": fn.model_dump(exclude_none=True)})
    tc = req.tool_choice
    choice: Any = None
    if tc is not None:
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or NamedTool(str(tc.name))
    return GenRequest(
        model=req.model,
        messages=messages,
        api="messages",
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=not (tc is not None and tc.disable_parallel_tool_use),
        output_format=output_format,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_tokens,
        stop=tuple(req.stop_sequences or ()),
        user=req.user,
    )


def _prefill(req: MessagesRequest, messages: list[dict[str, Any]], format_param: str | None) -> None:
    """Mark the final assistant message as the start of the reply (``chat_format`` continues it), or drop it when empty.

    ``format_param``: the field that asked for an output format, if one did. What cannot be honoured is a 400."""
    at = f"messages[{len(req.messages) - 1}]"
    last = messages[-1]
    if last.get("tool_calls"):
        raise InvalidRequest("a final assistant message (prefill) can hold only text; a tool_use needs a tool_result after it", param=f"{at}.content")
    text = last["content"]
    if not text:
        messages.pop()  # an empty final assistant message: an ordinary reply
        return
    if text != text.rstrip():
        raise InvalidRequest("final assistant content cannot end with trailing whitespace", param=f"{at}.content")
    if req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        raise InvalidRequest(
            f"a final assistant message (prefill) cannot be combined with tool_choice {req.tool_choice.type}: the forced call is the whole reply",
            param="tool_choice",
        )
    if format_param is not None:
        raise InvalidRequest(
            f"a final assistant message (prefill) cannot be combined with {format_param}: the format constrains the whole reply",
            param=format_param,
        )
    last["prefix"] = True


def _message(m: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise InvalidRequest("each message needs role user or assistant", param=f"{where}.role")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of content blocks", param=f"{where}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise InvalidRequest("a tool_use block needs id, name and an input object", param=at)
            calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequest("a tool_result block needs tool_use_id", param=at)
            text = _blocks_text(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind in ("image", "document"):
            raise InvalidRequest(f"{kind} content is not supported by this model", param=at)
        else:
            raise InvalidRequest(f"content block of type {kind!r} is not supported in a {role} message", param=at)
    out = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _blocks_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("expected a string or a list of text blocks", param=param)
    out = []
    for j, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            out.append(block["text"])
        else:
            kind = block.get("type") if isinstance(block, dict) else None
            raise InvalidRequest(f"content block of type {kind!r} is not supported here", param=f"{param}[{j}]")
    return "".join(out)


def _stop_reason(choice: ChoiceOut) -> tuple[str, str | None]:
    if choice.finish_reason == "tool_calls":
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.matched_stop, str):
        return "stop_sequence", choice.matched_stop
    return "end_turn", None


def message_body(out: Outcome) -> dict[str, Any]:
    assert out.choices is not None
    choice = out.choices[0]
    content: list[dict[str, Any]] = []
    if choice.content:
        content.append({"type": "text", "text": choice.content})
    for call in choice.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)})
    reason, seq = _stop_reason(choice)
    body: dict[str, Any] = {
        "id": out.id,
        "type": "message",
        "role": "assistant",
        "model": out.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": {"input_tokens": out.prompt_tokens, "output_tokens": out.completion_tokens},
    }
    if out.loopwise is not None:
        body["loopwise"] = out.loopwise
    return body


def _input(arguments: str) -> dict[str, Any]:
    """A call's ``input`` object: its arguments, or for a call the token limit cut, the longest prefix that closes into one.

    Anthropic's ``tool_use.input`` must be an object, so a cut call's partial JSON (``{"city": "Par``) is read as far
    as it goes: open strings and containers closed (``{"city": "Par"}``), a key without its value, a half literal or
    half escape left out. The text itself is what a stream's ``input_json_delta`` events carry."""
    try:
        value = loads_json_text(arguments) if arguments.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        value = partial_object(arguments)
    return value if isinstance(value, dict) else {}


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_START = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?)?")  # what a number can begin with
_LITERALS = ("true", "false", "null")
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")


def partial_object(text: str) -> dict[str, Any]:
    """The object parsed from the longest prefix of ``text`` that open strings and containers close into valid JSON.

    ``{"a": [1, "x`` → ``{"a": [1, "x"]}``; ``{"a": tr`` → ``{}``; anything but an object → ``{}``. One pass over the
    text (no recursion; nesting past ``MAX_DEPTH`` ends it there), then ``json.loads`` of the closed prefix."""
    text = text.lstrip()
    for end, suffix in reversed(_closable_prefixes(text)[-8:]):  # longest first; shorter where one still fails (a lone surrogate)
        try:
            value = json.loads(text[:end] + suffix)
            json.dumps(value, ensure_ascii=False).encode()
        except (ValueError, RecursionError):
            continue
        return value if isinstance(value, dict) else {}
    return {}


def _closable_prefixes(text: str) -> list[tuple[int, str]]:
    """``(end, suffix)`` for each prefix ``text[:end]`` of an object that ``suffix`` (a quote, the open containers'
    closers) makes valid JSON, shortest first; the scan stops where the text stops being JSON."""
    out: list[tuple[int, str]] = []
    if not text.startswith("{"):
        return out
    stack: list[str] = []  # the closers of the open containers
    fresh = False  # just after an opening bracket: its closer may follow at once
    phase = "value"  # what comes next: value, key, colon, after (a complete value: ',' or a closer)
    string: str | None = None  # inside a string: "key" or "value"
    escape = 0  # inside an escape: characters still to come (-1: the one after the backslash)
    scalar = ""  # a number or literal being read

    def closers() -> str:
        return "".join(reversed(stack))

    for i, c in enumerate(text):
        if string is not None:
            if escape == -1:
                if c not in _ESCAPES and c != "u":
                    return out
                escape = 4 if c == "u" else 0
            elif escape > 0:
                if c not in _HEX:
                    return out
                escape -= 1
            elif c == "\\":
                escape = -1
            elif c == '"':
                phase, string = ("colon" if string == "key" else "after"), None
                if phase == "after":
                    out.append((i + 1, closers()))
                continue
            if string == "value" and escape == 0:
                out.append((i + 1, '"' + closers()))
            continue
        if scalar:
            if c.isalnum() or c in ".+-":
                scalar += c
                if scalar in _LITERALS or _NUMBER.fullmatch(scalar):
                    out.append((i + 1, closers()))
                elif not any(lit.startswith(scalar) for lit in _LITERALS) and not _NUMBER_START.fullmatch(scalar):
                    return out
                continue
            if not (scalar in _LITERALS or _NUMBER.fullmatch(scalar)):
                return out
            scalar, phase = "", "after"
        if c in " \t\r\n":
            continue
        if not stack and i > 0:
            return out  # the object ended: what follows is not part of it
        opened, fresh = fresh, False
        if phase == "value" and c in "{[":
            if len(stack) >= MAX_DEPTH:
                return out
            stack.append("}" if c == "{" else "]")
            phase, fresh = ("key" if c == "{" else "value"), True
            out.append((i + 1, closers()))
        elif phase == "value" and c == '"':
            string = "value"
            out.append((i + 1, '"' + closers()))
        elif phase == "value" and c in "-0123456789tfn":
            scalar = c
            if c.isdigit():
                out.append((i + 1, closers()))
        elif phase == "key" and c == '"':
            string = "key"
        elif phase == "colon" and c == ":":
            phase = "value"
        elif phase == "after" and c == ",":
            phase = "key" if stack[-1] == "}" else "value"
        elif c in "}]" and stack and c == stack[-1] and (phase == "after" or opened):
            stack.pop()
            phase = "after"
            out.append((i + 1, closers()))
        else:
            return out
    return out


async def message_stream(out: Outcome) -> AsyncIterator[str]:
    assert out.events is not None

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"

    start: dict[str, Any] = {
        "id": out.id,
        "type": "message",
        "role": "assistant",
        "model": out.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": out.prompt_tokens, "output_tokens": 0},
    }
    yield event("message_start", message=start)
    index = -1
    open_kind: str | None = None
    async for ev in out.events:
        if isinstance(ev, TextDelta):
            if not ev.text:
                continue
            if open_kind != "text":
                if open_kind is not None:
                    yield event("content_block_stop", index=index)
                index += 1
                open_kind = "text"
                yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": ev.text})
        elif isinstance(ev, ToolCallStart):
            if open_kind is not None:
                yield event("content_block_stop", index=index)
            index += 1
            open_kind = "tool_use"
            yield event("content_block_start", index=index, content_block={"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        elif isinstance(ev, ToolArgsDelta):
            yield event("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": ev.delta})
        elif isinstance(ev, ChoiceDone):
            if open_kind is not None:
                yield event("content_block_stop", index=index)
                open_kind = None
            reason, seq = _stop_reason(ev.choice)
            more = {"loopwise": out.loopwise} if out.loopwise is not None else {}
            yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq}, usage={"output_tokens": out.completion_tokens}, **more)
            yield event("message_stop")
        elif isinstance(ev, StreamFailed):
            yield event("error", error={"type": "api_error", "message": ev.message})


def _in_anthropic_terms(exc: APIError, field: str) -> APIError:
    """An error about the decoding grammar in terms of the field this client sent.

    The engine and admission name chat's ``response_format`` (in ``param``, which Anthropic's envelope does not
    carry, or in the message); here the grammar comes from ``output_config.format`` (or ``output_format``), else from
    the forced tool (``tool_choice``), and the message names that field."""
    if exc.param != "response_format":
        return exc
    message = exc.message.replace("response_format / tool_choice", field).replace("response_format", field)
    if field not in message:
        message = f"{field}: {message}"
    return APIError(exc.status, message, type=exc.type, param=field, code=exc.code, headers=exc.headers)


@router.post("/v1/messages")
async def create_message(request: Request, req: Annotated[MessagesRequest, Depends(json_body(MessagesRequest))]) -> Response:
    gateway = services(request).gateway
    ireq = to_internal(req)
    if is_prefill(ireq.messages) and gateway.agents is not None and gateway.agents.get(req.model) is not None:
        raise InvalidRequest(
            f"{req.model!r} is an agent, which runs its own turns; a final assistant message (prefill) is not supported for it",
            param=f"messages[{len(req.messages) - 1}]",
        )
    try:
        out = await gateway.run(request, ireq, stream=req.stream, id_prefix="msg_")
    except APIError as exc:
        raise _in_anthropic_terms(exc, req.structured()[1] if ireq.output_format is not None else "tool_choice") from exc
    if out is None:
        return Response(status_code=499)
    if req.stream:
        return StreamingResponse(
            message_stream(out),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **out.headers},
            background=BackgroundTask(out.close),  # releases the lease and the key's slots however the stream ended
        )
    return JSONResponse(message_body(out), headers=out.headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, req: Annotated[MessagesRequest, Depends(json_body(MessagesRequest, {"max_tokens": 1}))]) -> dict[str, Any]:
    """The prompt's tokens, templated and tokenized as ``/v1/messages`` would (off the event loop, size-checked first)."""
    gateway = services(request).gateway
    ireq = to_internal(req)
    gateway.admission.check_size(ireq.messages, ireq.tools, gateway.engine().info.max_model_len)
    return {"input_tokens": await gateway.admission.prepare(gateway.count_prompt_tokens, ireq)}
