"""``POST /v1/chat/completions``: OpenAI's Chat Completions wire format ↔ the one internal request.

:func:`to_internal` turns a validated :class:`ChatCompletionRequest` into a
:class:`~runtime.gen_request.GenRequest` (legacy ``functions``/``function_call`` become ``tools``/
``tool_choice``; ``role: "function"`` messages become tool results); the shared path
(``runtime/serving.py``) serves it; :func:`completion_body` and :func:`completion_stream` write the
answer back in OpenAI's shapes.

Streaming follows OpenAI exactly: a role delta first, content deltas, tool-call deltas by index (the
first carries ``id``, ``type`` and ``function.name``, later ones pieces of ``function.arguments`` as
they decode), a chunk with ``finish_reason`` and an empty delta (carrying ``loopwise`` ids), a usage
chunk when ``stream_options.include_usage``, then ``data: [DONE]``. An engine failure after the stream
has started is sent as one ``{"error": …}`` event.

Not here: generation, recording, adapter routing (``runtime/generation.py``, ``runtime/serving.py``), error
envelopes (``runtime/app.py``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from runtime.api.openai_schemas import ChatCompletionRequest, NamedToolChoice
from runtime.chat_format import to_plain
from runtime.gen_request import GenRequest, NamedTool, OutputFormat
from runtime.generation import ChoiceDone, StreamFailed, TextDelta, ToolArgsDelta, ToolCallStart
from runtime.http_body import json_body
from runtime.services import services
from runtime.serving import Outcome

router = APIRouter()


def to_internal(req: ChatCompletionRequest) -> GenRequest:
    fmt = req.response_format
    output_format = None
    if fmt is not None and fmt.type == "json_object":
        output_format = OutputFormat("json_object")
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None
        output_format = OutputFormat("json_schema", fmt.json_schema.schema_, fmt.json_schema.name)
    choice = req.tool_choice
    tool_choice = NamedTool(choice.function.name) if isinstance(choice, NamedToolChoice) else choice
    return GenRequest(
        model=req.model,
        messages=[to_plain(m, i) for i, m in enumerate(req.messages)],
        api="chat.completions",
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        output_format=output_format,
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        seed=req.seed,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias={int(k): b for k, b in (req.logit_bias or {}).items()},
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        user=req.user,
        tag=(req.metadata or {}).get("tag"),
    )


def completion_body(out: Outcome, legacy_functions: bool = False) -> dict[str, Any]:
    assert out.choices is not None
    choices = []
    for c in out.choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.content, "refusal": None}
        finish = c.finish_reason
        if c.tool_calls and legacy_functions:
            message["function_call"] = {"name": c.tool_calls[0].name, "arguments": c.tool_calls[0].arguments}
            finish = "function_call" if finish == "tool_calls" else finish
        elif c.tool_calls:
            message["tool_calls"] = [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}} for t in c.tool_calls]
        logprobs = {"content": c.logprobs, "refusal": None} if c.logprobs is not None else None
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
    prompt, completion = out.prompt_tokens, out.completion_tokens
    body: dict[str, Any] = {
        "id": out.id,
        "object": "chat.completion",
        "created": out.created,
        "model": out.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }
    if out.loopwise is not None:
        body["loopwise"] = out.loopwise
    return body


async def completion_stream(out: Outcome, n: int, include_usage: bool, legacy_functions: bool = False) -> AsyncIterator[str]:
    assert out.events is not None
    envelope = {"id": out.id, "object": "chat.completion.chunk", "created": out.created, "model": out.model, "system_fingerprint": None}

    def chunk(choice: dict[str, Any], **more: Any) -> str:
        body = {**envelope, "choices": [choice], **({"usage": None} if include_usage else {}), **more}
        return _sse(body)

    for i in range(n):
        yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
    async for ev in out.events:
        if isinstance(ev, TextDelta):
            lps = {"content": ev.logprobs, "refusal": None} if ev.logprobs is not None else None
            yield chunk({"index": ev.index, "delta": {"content": ev.text} if ev.text else {}, "logprobs": lps, "finish_reason": None})
        elif isinstance(ev, ToolCallStart):
            if legacy_functions:
                delta: dict[str, Any] = {"function_call": {"name": ev.name, "arguments": ""}}
            else:
                delta = {"tool_calls": [{"index": ev.call_index, "id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}]}
            yield chunk({"index": ev.index, "delta": delta, "logprobs": None, "finish_reason": None})
        elif isinstance(ev, ToolArgsDelta):
            if legacy_functions:
                delta = {"function_call": {"arguments": ev.delta}}
            else:
                delta = {"tool_calls": [{"index": ev.call_index, "function": {"arguments": ev.delta}}]}
            yield chunk({"index": ev.index, "delta": delta, "logprobs": None, "finish_reason": None})
        elif isinstance(ev, ChoiceDone):
            finish = ev.choice.finish_reason
            if legacy_functions and finish == "tool_calls":
                finish = "function_call"
            more = {"loopwise": out.loopwise} if out.loopwise is not None else {}
            yield chunk({"index": ev.index, "delta": {}, "logprobs": None, "finish_reason": finish}, **more)
        elif isinstance(ev, StreamFailed):
            yield _sse({"error": {"message": ev.message, "type": "server_error", "param": None, "code": "internal_error"}})
    if include_usage:
        p, c = out.prompt_tokens, out.completion_tokens
        yield _sse({**envelope, "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})
    yield "data: [DONE]\n\n"


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, req: Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]) -> Response:
    legacy = bool(req.functions)  # answered in the legacy form (function_call) too
    out = await services(request).gateway.run(request, to_internal(req), stream=req.stream, id_prefix="chatcmpl-")
    if out is None:
        return Response(status_code=499)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            completion_stream(out, req.n, include_usage, legacy),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **out.headers},
            background=BackgroundTask(out.close),  # releases the lease and the key's slots however the stream ended
        )
    return JSONResponse(completion_body(out, legacy), headers=out.headers)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
