"""The request path every generating API shares, between its wire translation and the engine.

:meth:`Gateway.run` takes an internal :class:`~runtime.generation.GenRequest` and the HTTP request,
and does what must not differ between Chat Completions, Responses, Messages and Completions: the
session key (``X-Session-Id``, else ``user``), served agents (a ``model`` naming an agent runs the
agent), adapter routing (base, ``family@N``, alias, A/B arm, the session's pinned version) with a
lease held until the response ends, preparation, generation or streaming, client disconnects (a
non-streamed request is cancelled; the route answers 499), and per-adapter metrics.

The result is an :class:`Outcome`: the choices, or a stream of API-neutral events, with the ids and
usage every wire format reports. The API modules only translate.

Not here: wire formats, authentication (``runtime/app.py``'s middleware), the generation itself
(``runtime/generation.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from runtime.adapters import AdapterNotFound, AdapterRef, AdapterRegistry
from runtime.agent_api import AgentHost, UnknownModel
from runtime.engine import EngineError
from runtime.errors import APIError, from_engine
from runtime.generation import ChoiceDone, ChoiceOut, Generation, GenRequest, StreamEvent, TextDelta, ToolArgsDelta, ToolCallStart
from runtime.identity import bind_caller
from runtime.metrics import Metrics
from runtime.store_routes import session_of
from runtime.tool_parsers import ParsedToolCall

log = logging.getLogger(__name__)
T = TypeVar("T")

AGENT_STREAM_PIECE = 16  # characters per streamed content event of an agent's final answer


@dataclass
class Outcome:
    """What a generating request produced, before any wire format."""

    id: str
    created: int
    model: str
    prompt_tokens: int
    choices: list[ChoiceOut] | None = None  # a non-streamed request
    events: AsyncIterator[StreamEvent] | None = None  # a streamed one
    loopwise: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    _completion_tokens: Callable[[], int] = lambda: 0

    @property
    def completion_tokens(self) -> int:
        if self.choices is not None:
            return sum(c.completion_tokens for c in self.choices)
        return self._completion_tokens()


class Gateway:
    def __init__(
        self,
        generation: Callable[[], Generation],
        route: Callable[[str, str, str | None], AdapterRef | None],
        registry: AdapterRegistry,
        metrics: Metrics,
        agents: AgentHost | None,
    ) -> None:
        self._generation = generation
        self.route = route
        self.registry = registry
        self.metrics = metrics
        self.agents = agents

    async def run(self, request: Request, req: GenRequest, *, stream: bool, id_prefix: str) -> Outcome | None:
        """Serve ``req``; None when the client left before a non-streamed answer was ready (answer 499)."""
        if self.agents is not None and (agent := self.agents.get(req.model)) is not None:
            return await self._agent(request, req, agent, stream=stream, id_prefix=id_prefix)
        session = session_of(request, req.user)
        lease = self._acquire(req.model, session, req.user)
        adapter = lease.name if lease is not None else None
        svc = self._generation()
        t0 = time.perf_counter()
        streaming = False
        try:
            prep = svc.prepare(req, request.state.request_id, session, adapter=adapter, id_prefix=id_prefix)
            out = Outcome(prep.id, prep.created, req.model, prep.prompt_tokens, loopwise=prep.loopwise(), headers=prep.headers())
            if stream:
                opened = await svc.open_streams(prep)
                streaming = True
                out.events = _release_after(svc.events(prep, opened), lambda: self._release(lease, adapter, t0, prep.completion_tokens))
                out._completion_tokens = lambda: prep.completion_tokens
                return out
            choices = await _unless_disconnected(request, svc.complete(prep))
        except EngineError as exc:
            raise from_engine(exc) from exc
        finally:
            if not streaming:
                self._release(lease, adapter, t0, prep.completion_tokens if "prep" in locals() else 0)
        if choices is None:
            return None
        out.choices = choices
        return out

    # ---- adapters
    def _acquire(self, model: str, session: str, user: str | None) -> AdapterRef | None:
        """The adapter version serving ``model`` (None = the base), acquired until the request ends."""
        try:
            return self.route(model, session, user)
        except AdapterNotFound as exc:
            raise APIError(
                404, f"The model `{model}` does not exist or you do not have access to it.", param="model", code="model_not_found"
            ) from exc

    def _release(self, lease: AdapterRef | None, adapter: str | None, t0: float, completion_tokens: int) -> None:
        if lease is not None:
            self.registry.release(lease)
        self.metrics.adapter_requests.labels(adapter or "base").inc()
        self.metrics.adapter_latency.labels(adapter or "base").observe(time.perf_counter() - t0)
        if completion_tokens:
            self.metrics.adapter_tokens.labels(adapter or "base").inc(completion_tokens)

    # ---- agents
    async def _agent(self, request: Request, req: GenRequest, agent: Any, *, stream: bool, id_prefix: str) -> Outcome:
        """Run a served agent as the model: its final answer is the reply (``loopwise`` has its trajectory)."""
        if req.tools:
            raise _not_for_agent("tools", "passing tools")
        if req.n != 1:
            raise _not_for_agent("n", "n > 1")
        if req.output_format is not None:
            raise _not_for_agent("response_format", "response_format")
        for i, m in enumerate(req.messages):
            if m["role"] == "tool" or m.get("tool_calls"):
                raise APIError(400, "agents keep their own tool history; send user and assistant text only", param=f"{req.messages_param}[{i}]")
        try:
            with bind_caller(request, req.user):  # who asked, for per-user agent memory
                answer = await agent.chat(
                    req.messages, session_id=session_of(request, req.user), request_id=request.state.request_id, options={"seed": req.seed}
                )
        except UnknownModel as exc:
            raise APIError(404, f"agent {agent.name!r}: {exc}", param="model", code="model_not_found") from exc
        except EngineError as exc:
            raise from_engine(exc) from exc
        calls = [ParsedToolCall(name=c["name"], arguments=c["arguments"], id=c["id"]) for c in getattr(answer, "tool_calls", None) or []]
        choice = ChoiceOut(
            index=0,
            content=answer.content if answer.content or not calls else None,
            tool_calls=calls,
            finish_reason="tool_calls" if calls else answer.finish_reason,
            text=answer.content,
            completion_tokens=answer.completion_tokens,
            ids={"trajectory_id": answer.loopwise.get("trajectory_id"), "turn_id": answer.loopwise.get("turn_id")},
        )
        out = Outcome(
            f"{id_prefix}{uuid.uuid4().hex[:24]}",
            int(time.time()),
            req.model,
            answer.prompt_tokens,
            loopwise=answer.loopwise,
            headers={"X-Loopwise-Trajectory-Id": str(answer.loopwise.get("trajectory_id", ""))},
        )
        if not stream:
            out.choices = [choice]
            return out
        out.events = _replay([choice])
        out._completion_tokens = lambda: choice.completion_tokens
        return out


async def _replay(choices: list[ChoiceOut]) -> AsyncIterator[StreamEvent]:
    """Finished choices as stream events (an agent's answer, sent in pieces)."""
    for c in choices:
        text = c.content or ""
        for k in range(0, len(text), AGENT_STREAM_PIECE):
            yield TextDelta(c.index, text[k : k + AGENT_STREAM_PIECE])
        for k, call in enumerate(c.tool_calls):
            yield ToolCallStart(c.index, k, call.id, call.name)
            yield ToolArgsDelta(c.index, k, call.arguments)
    for c in choices:
        yield ChoiceDone(c.index, c)


def _not_for_agent(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported for agents (agents run their own tools and sampling)", param=param, code="unsupported_for_agent")


async def _release_after(body: AsyncIterator[T], release: Callable[[], None]) -> AsyncIterator[T]:
    """Iterate ``body``; run ``release`` when it ends, however it ends (finished, failed, or the client left)."""
    try:
        async for item in body:
            yield item
    finally:
        release()


async def _unless_disconnected(request: Request, coro: Awaitable[T]) -> T | None:
    """Await ``coro``; if the client goes away first, cancel it (which cancels its generation).

    The disconnect is awaited with ``request.receive()`` (once the body is read, the next message is
    ``http.disconnect`` when the client goes away).
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and not watcher.cancelled() and watcher.exception() is None:
            log.info("client disconnected; cancelling generation")
            task.cancel()
            return None
        return await task
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
