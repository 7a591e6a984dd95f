"""``POST /v1/messages``: Anthropic's Messages API as a thin translation over the one generation path.

Request: ``model``, ``max_tokens`` (required), ``messages`` (``user``/``assistant``, content a string
or blocks: ``text``, ``tool_use`` on the assistant side, ``tool_result`` on the user side), ``system``
(a string or text blocks), ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice``
(``auto``, ``any``, ``tool`` + ``name``, ``none``; ``disable_parallel_tool_use``), ``stop_sequences``,
``temperature``, ``top_p``, ``metadata.user_id`` (the session key when no ``X-Session-Id``), ``stream``.
The reply has ``content`` blocks (``text``, then one ``tool_use`` per call with ``input`` as an
object), ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence`` with ``stop_sequence``,
``tool_use``), ``usage`` and ``loopwise``. Streaming sends Anthropic's named events: ``message_start``,
per block ``content_block_start`` / ``content_block_delta`` (``text_delta``, or ``input_json_delta``
as the arguments decode) / ``content_block_stop``, then ``message_delta`` and ``message_stop``.
``POST /v1/messages/count_tokens`` counts the rendered prompt.

Errors use Anthropic's envelope (``{"type": "error", "error": {"type", "message"}}``; ``runtime/app.py``
picks it by path). Not served (a clear 400): images and documents, a final assistant message
(prefill), ``top_k``, extended thinking.

Not here: the generation path (``runtime/serving.py``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError, model_validator
from starlette.background import BackgroundTask

from runtime.engine import InvalidRequest
from runtime.errors import from_validation
from runtime.generation import ChoiceDone, ChoiceOut, GenRequest, NamedTool, StreamFailed, TextDelta, ToolArgsDelta, ToolCallStart
from runtime.http_body import read_json
from runtime.openai_schemas import FieldError, FunctionDef, _In
from runtime.serving import Gateway, Outcome


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

    @model_validator(mode="after")
    def _supported(self) -> MessagesRequest:
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
    if messages and messages[-1]["role"] == "assistant":
        raise InvalidRequest(
            "a final assistant message (prefill) is not supported by this server; end the conversation with a user message",
            param=f"messages[{len(req.messages) - 1}]",
        )
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
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_tokens,
        stop=tuple(req.stop_sequences or ()),
        user=req.user,
    )


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
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


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


def install_messages_routes(app: FastAPI, gateway: Gateway, max_body: int) -> None:
    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        body = await read_json(request, max_body)
        try:
            req = MessagesRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc) from None
        out = await gateway.run(request, to_internal(req), stream=req.stream, id_prefix="msg_")
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

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body = await read_json(request, max_body)
        try:
            req = MessagesRequest.model_validate({"max_tokens": 1, **body})
        except ValidationError as exc:
            raise from_validation(exc) from None
        return {"input_tokens": gateway.count_prompt_tokens(to_internal(req))}
