"""``/v1/responses``: OpenAI's Responses API as a thin translation over the one generation path.

- ``POST /v1/responses``: ``input`` (a string or items), ``instructions`` (a system message, not
  inherited through ``previous_response_id``), flat function ``tools`` and ``tool_choice``,
  ``text.format`` (``json_object``/``json_schema``, the same constrained decoding as chat's
  ``response_format``), ``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs`` with
  ``include: ["message.output_text.logprobs"]``, ``metadata``, ``user``, ``store`` (default true),
  ``previous_response_id`` and ``stream``. The reply's ``output`` holds a ``message`` item and one
  ``function_call`` item per call; ``usage`` counts input and output tokens; ``loopwise`` carries
  the recorded ids.
- ``previous_response_id``: the stored response's context items and output come before the new
  input, so the model sees the whole conversation, and the turn continues the same recorded
  trajectory (the recorder's stitching rule matches the rebuilt messages); the session is the stored
  one unless the request names another. Only the key that stored a response can read, chain or delete it.
- ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.
- Streaming: ``response.created``, ``response.in_progress``, per item ``response.output_item.added``,
  (``response.content_part.added``, ``response.output_text.delta``…, ``.done``, ``response.content_part.done``)
  or ``response.function_call_arguments.delta``… (as the arguments decode) and ``.done``,
  ``response.output_item.done``, then ``response.completed``, or ``response.incomplete`` (status
  ``incomplete``) when ``max_output_tokens`` cut it, as OpenAI sends it (the openai SDK's
  ``get_final_response()`` then raises, and openai-agents raises as on a non-streamed cut response),
  or ``response.failed`` when the engine failed; each with a ``sequence_number``.
- A cut response's last item is ``incomplete``: a message, or a ``function_call`` whose
  ``arguments`` are what was generated (a forced call cut by the limit is still a call, never text).

Not here: the generation path (``runtime/serving.py``, ``runtime/generation.py``), item parsing
(``runtime/api/responses_schemas.py``), storage (``runtime/api/response_store.py``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from runtime.api.response_store import ResponseBackend, StoredResponse
from runtime.api.responses_schemas import ResponsesRequest, function_tools, items_to_messages, normalize_items, tool_choice_of
from runtime.engine import InvalidRequest
from runtime.errors import APIError
from runtime.gen_request import GenRequest, NamedTool
from runtime.generation import ChoiceDone, ChoiceOut, StreamFailed, TextDelta, ToolArgsDelta, ToolCallStart
from runtime.http_body import json_body
from runtime.identity import owner_of
from runtime.services import services
from runtime.serving import Gateway, Outcome

router = APIRouter()


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponsesAPI:
    def __init__(self, gateway: Gateway, store: ResponseBackend | None) -> None:
        self.gateway = gateway
        self.store = store

    # ---- request → internal
    async def build(self, request: Request, req: ResponsesRequest) -> tuple[GenRequest, list[dict[str, Any]], str | None]:
        """The internal request, the context items (chain + input, each with an id) and the chained session."""
        context: list[dict[str, Any]] = []
        session = None
        if req.previous_response_id is not None:
            prev = await self._get(request, req.previous_response_id, param="previous_response_id")
            context = [*prev.context, *prev.response.get("output", [])]
            session = prev.session_id
        context += normalize_items(req.input)
        messages = items_to_messages(context, param="input")
        if not messages:  # no input (or only reasoning items) and no earlier response: nothing to answer
            raise InvalidRequest("input is empty: send a string or at least one message item", param="input")
        if req.instructions:
            messages.insert(0, {"role": "system", "content": req.instructions})
        tools = function_tools(req.tools)
        choice, tools = tool_choice_of(req.tool_choice, tools)
        output_format = req.output_format()
        ireq = GenRequest(
            model=req.model,
            messages=messages,
            api="responses",
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            output_format=output_format,
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=req.max_output_tokens,
            max_tokens_param="max_output_tokens",
            seed=req.seed,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs or 0,
            user=req.user,
            messages_param="input",
            session_id=None if request.headers.get("x-session-id") else session,
        )
        return ireq, context, ireq.session_id

    async def _get(self, request: Request, response_id: str, param: str | None = None) -> StoredResponse:
        if self.store is None:
            raise APIError(404, f"Response with id '{response_id}' not found: this server stores no responses.", param=param, code="not_found")
        stored = await asyncio.to_thread(self.store.get, response_id, owner_of(request))
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")
        return stored

    # ---- internal → response object
    def response(
        self, req: ResponsesRequest, ireq: GenRequest, out: Outcome, output: list[dict[str, Any]], status: str, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        prompt, completion = out.prompt_tokens, out.completion_tokens
        choice = ireq.tool_choice
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text is not None and req.text.format is not None else {"type": "text"}
        )
        body: dict[str, Any] = {
            "id": out.id,
            "object": "response",
            "created_at": out.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": req.model,
            "output": output,
            "parallel_tool_calls": ireq.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt},
            "tool_choice": {"type": "function", "name": choice.name} if isinstance(choice, NamedTool) else (choice or "auto"),
            "tools": [{"type": "function", **t["function"]} for t in ireq.tools],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            },
            "user": req.user,
        }
        if out.loopwise is not None:
            body["loopwise"] = out.loopwise
        return body

    async def save(self, request: Request, req: ResponsesRequest, body: dict[str, Any], context: list[dict[str, Any]], session: str) -> None:
        if self.store is not None and req.store is not False:
            stored = StoredResponse(body["id"], owner_of(request), session, body, context)
            await asyncio.to_thread(self.store.put, stored)

    async def stream(
        self, request: Request, req: ResponsesRequest, ireq: GenRequest, out: Outcome, context: list[dict[str, Any]], session: str
    ) -> AsyncIterator[str]:
        assert out.events is not None
        items = _StreamedItems()
        yield items.event("response.created", response=self.response(req, ireq, out, [], "in_progress"))
        yield items.event("response.in_progress", response=self.response(req, ireq, out, [], "in_progress"))
        async for ev in out.events:
            if isinstance(ev, ChoiceDone):
                status = "incomplete" if ev.choice.finish_reason == "length" else "completed"
                for e in items.close(status):
                    yield e
                for item in items.output:
                    if item["type"] == "message" and not req.logprobs:
                        item["content"][0].pop("logprobs", None)
                body = self.response(req, ireq, out, items.output, status)
                await self.save(request, req, body, context, session)
                yield items.event(f"response.{status}", response=body)
            elif isinstance(ev, StreamFailed):
                for e in items.close():
                    yield e
                body = self.response(req, ireq, out, items.output, "failed", error={"code": "server_error", "message": ev.message})
                yield items.event("response.failed", response=body)
            else:
                for e in items.feed(ev):
                    yield e


class _StreamedItems:
    """A streamed response's output items as the choice's events build them, and its server-sent events, numbered in
    order (``sequence_number``). One item is open at a time: a message taking text, or a call taking its arguments."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None  # the open item (the last of ``output``)

    def event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def feed(self, ev: TextDelta | ToolCallStart | ToolArgsDelta) -> list[str]:
        """The events of a piece of the choice: text, a call's start, or a piece of its arguments."""
        if isinstance(ev, TextDelta):
            return self._text(ev)
        if isinstance(ev, ToolCallStart):
            return self._call(ev)
        if isinstance(ev, ToolArgsDelta):
            return self._arguments(ev)
        return []

    def _text(self, ev: TextDelta) -> list[str]:
        """A text delta: a message item (with its text part) opened first unless one is open, then the delta."""
        if not ev.text:
            return []
        events: list[str] = []
        item = self.current
        if item is None or item["type"] != "message":
            events = self.close()
            item = self._open({"type": "message", "id": _id("msg_"), "status": "in_progress", "role": "assistant", "content": []})
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1, content_index=0, part=part)
            )
            item["content"] = [dict(part)]
        item["content"][0]["text"] += ev.text
        if ev.logprobs:
            item["content"][0]["logprobs"] += ev.logprobs
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                delta=ev.text,
                logprobs=ev.logprobs or [],
            )
        )
        return events

    def _call(self, ev: ToolCallStart) -> list[str]:
        """A call's start: the open item closed, a ``function_call`` item opened."""
        events = self.close()
        item = self._open({"type": "function_call", "id": _id("fc_"), "call_id": ev.id, "name": ev.name, "arguments": "", "status": "in_progress"})
        events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        return events

    def _arguments(self, ev: ToolArgsDelta) -> list[str]:
        """A piece of the open call's arguments (none without an open call)."""
        item = self.current
        if item is None or item["type"] != "function_call":
            return []
        item["arguments"] += ev.delta
        return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=len(self.output) - 1, delta=ev.delta)]

    def _open(self, item: dict[str, Any]) -> dict[str, Any]:
        self.current = item
        self.output.append(item)
        return item

    def close(self, status: str = "completed") -> list[str]:
        """The open item's closing events, its status set; none when no item is open."""
        if self.current is None:
            return []
        item, i, events = self.current, len(self.output) - 1, []
        self.current = None
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=part["text"], logprobs=[])
            )
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part))
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done", item_id=item["id"], output_index=i, name=item["name"], arguments=item["arguments"]
                )
            )
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=i, item=item))
        return events


def output_items(choice: ChoiceOut, logprobs: bool) -> list[dict[str, Any]]:
    """A finished choice as Responses output items: the message (if any text), then one item per call."""
    items: list[dict[str, Any]] = []
    if choice.content:
        part: dict[str, Any] = {"type": "output_text", "text": choice.content, "annotations": []}
        if logprobs:
            part["logprobs"] = choice.logprobs or []
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        items.append({"type": "message", "id": _id("msg_"), "status": status, "role": "assistant", "content": [part]})
    for call in choice.tool_calls:
        items.append(
            {"type": "function_call", "id": _id("fc_"), "call_id": call.id, "name": call.name, "arguments": call.arguments, "status": "completed"}
        )
    if choice.finish_reason == "length" and items:
        items[-1]["status"] = "incomplete"  # the item the limit cut (a message is incomplete already)
    return items


def _api(request: Request) -> ResponsesAPI:
    s = services(request)
    return ResponsesAPI(s.gateway, s.responses)


@router.post("/v1/responses")
async def create_response(request: Request, req: Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest))]) -> Response:
    api = _api(request)
    ireq, context, session = await api.build(request, req)
    out = await api.gateway.run(request, ireq, stream=req.stream, id_prefix="resp_")
    if out is None:
        return Response(status_code=499)
    session = out.session_id
    if req.stream:
        return StreamingResponse(
            api.stream(request, req, ireq, out, context, session),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **out.headers},
            background=BackgroundTask(out.close),  # releases the lease and the key's slots however the stream ended
        )
    assert out.choices is not None
    choice = out.choices[0]
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    resp = api.response(req, ireq, out, output_items(choice, req.logprobs), status)
    await api.save(request, req, resp, context, session)
    return JSONResponse(resp, headers=out.headers)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return (await _api(request)._get(request, response_id)).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    api = _api(request)
    await api._get(request, response_id)
    assert api.store is not None
    await asyncio.to_thread(api.store.delete, response_id, owner_of(request))
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request) -> dict[str, Any]:
    stored = await _api(request)._get(request, response_id)
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be asc or desc", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = -1
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be an integer from 1 to 100", param="limit")
    items = stored.context if order == "asc" else stored.context[::-1]
    after = q.get("after")
    if after is not None:
        ids = [it.get("id") for it in items]
        if after not in ids:
            raise APIError(400, f"no input item with id {after!r} in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
