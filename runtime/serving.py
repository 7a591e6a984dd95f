"""The request path every generating API shares, between its wire translation and the engine.

:meth:`Gateway.run` takes an internal :class:`~runtime.gen_request.GenRequest` and the HTTP request,
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
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from runtime.adapters.names import AdapterNotFound, AdapterRef
from runtime.adapters.registry import AdapterRegistry
from runtime.admission import Admission
from runtime.agent_api import AgentHost, UnknownModel
from runtime.engine import EngineError, TokenLogprob
from runtime.errors import APIError, from_engine
from runtime.gen_request import GenRequest, NamedTool
from runtime.generation import ChoiceDone, ChoiceOut, Generation, StreamEvent, StreamFailed, TextDelta, ToolArgsDelta, ToolCallStart
from runtime.identity import ADMIN_OWNER, PUBLIC_OWNER, bind_caller, owner_of, session_of
from runtime.metrics import Metrics
from runtime.settings import AdmissionSettings
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
    session_id: str = ""  # the session the turns were recorded in
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.., when asked (``GenRequest.prompt_logprobs``)
    _completion_tokens: Callable[[], int] = lambda: 0
    _release: Callable[[], None] | None = None  # a stream's lease and quota slots: given back once, however it ends

    async def close(self) -> None:
        """End a stream: close its events (cancelling generation still running) and give its resources back. Idempotent;
        the HTTP layer calls it when the response is over, also when the client left before the events were read."""
        if self.events is not None and (aclose := getattr(self.events, "aclose", None)) is not None:
            await aclose()
        release, self._release = self._release, None
        if release is not None:
            release()

    @property
    def completion_tokens(self) -> int:
        if self.choices is not None:
            return sum(c.completion_tokens for c in self.choices)
        return self._completion_tokens()


class Gateway:
    def __init__(
        self,
        generation: Callable[[], Generation],
        route: Callable[[str, str, str | None, str], AdapterRef | None],
        registry: AdapterRegistry,
        metrics: Metrics,
        agents: AgentHost | None,
        *,
        admission: Admission | None = None,
    ) -> None:
        self._generation = generation
        self.admission = admission or Admission(AdmissionSettings(), unlimited_owners=(PUBLIC_OWNER, ADMIN_OWNER))
        self.route = route
        self.registry = registry
        self.metrics = metrics
        self.agents = agents

    async def run(self, request: Request, req: GenRequest, *, stream: bool, id_prefix: str) -> Outcome | None:
        """Serve ``req``; None when the client left before a non-streamed answer was ready (answer 499).

        Admission first (``runtime/admission.py``): a prompt that cannot fit is refused before templating, the
        caller's key takes ``n`` of its slots until the answer ends, and templating, tokenizing and the grammar
        run off the event loop within their deadlines."""
        owner = owner_of(request)
        svc = self._generation()
        if req.prompt_ids is None:
            self.admission.check_size(req.messages, req.tools, svc.engine.info.max_model_len)
        if self.agents is not None and (agent := self.agents.get(req.model)) is not None:
            return await self._agent(request, req, agent, stream=stream, id_prefix=id_prefix)
        session = req.session_id or session_of(request, req.user)
        leave = await self.admission.enter(owner, req.n)
        lease: AdapterRef | None = None
        adapter: str | None = None
        t0 = time.perf_counter()
        streaming = acquired = False
        try:
            lease = self._acquire(req.model, session, req.user, owner)
            adapter, acquired = (lease.name if lease is not None else None), True
            rid = request.state.request_id
            prep = await self.admission.prepare(svc.prepare, req, rid, session, adapter=adapter, id_prefix=id_prefix, owner=owner)
            await self._compile_grammar(prep, owner, svc)
            out = Outcome(prep.id, prep.created, req.model, prep.prompt_tokens, loopwise=prep.loopwise(), headers=prep.headers(), session_id=session)
            if stream:
                opened = await svc.open_streams(prep)
                out.prompt_logprobs = prep.prompt_logprobs
                streaming = True

                released = False

                def done() -> None:
                    nonlocal released
                    if not released:
                        released = True
                        svc.settle(prep)
                        self._release(lease, adapter, t0, prep.completion_tokens)
                        leave()

                out._release = done
                out.events = _release_after(self._count_failed(svc.events(prep, opened), adapter), done)
                out._completion_tokens = lambda: prep.completion_tokens
                return out
            choices = await unless_disconnected(request, svc.complete(prep))
        except EngineError as exc:
            err = from_engine(exc)
            if acquired:
                self._count_error(adapter, err.status)
            raise err from exc
        except APIError as exc:
            if acquired:  # an unknown model is not an adapter's error (and its name is the caller's text)
                self._count_error(adapter, exc.status)
            raise
        finally:
            if not streaming:
                if "prep" in locals():
                    svc.settle(prep)  # a failed or abandoned request's turn ids are given back
                if acquired:
                    self._release(lease, adapter, t0, prep.completion_tokens if "prep" in locals() else 0)
                leave()
        if choices is None:
            self._count_error(adapter, 499)
            return None
        out.choices = choices
        out.prompt_logprobs = prep.prompt_logprobs
        return out

    async def _compile_grammar(self, prep: Any, owner: str, svc: Generation) -> None:
        """An embedded engine's grammar, compiled in its killable worker within the admission deadline, for every choice."""
        grammar = prep.engine_reqs[0].sampling.grammar if prep.engine_reqs else None
        compile_fn = getattr(svc.engine, "compile_grammar", None)
        if grammar is None or compile_fn is None or grammar.compiled is not None:
            return
        compiled = dataclasses.replace(grammar, compiled=await self.admission.compile_grammar(compile_fn, grammar, owner))
        prep.engine_reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, grammar=compiled)) for r in prep.engine_reqs]

    # ---- what translations need from the model
    def engine(self) -> Any:
        return self._generation().engine

    def tokenizer(self) -> Any:
        return self._generation().tokenizer

    def vocab_size(self) -> int:
        return int(self._generation().engine.info.vocab_size)

    def count_prompt_tokens(self, req: GenRequest) -> int:
        """Tokens of the prompt ``req`` renders to (chat template and tools included)."""
        svc = self._generation()
        return len(svc.formatter.render_plain(req.messages, req.tools if req.tools_on else None).token_ids)

    # ---- adapters
    def _acquire(self, model: str, session: str, user: str | None, owner: str) -> AdapterRef | None:
        """The adapter version serving ``model`` (None = the base), acquired until the request ends."""
        try:
            return self.route(model, session, user, owner)
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

    def _count_error(self, adapter: str | None, status: int) -> None:
        self.metrics.adapter_errors.labels(adapter or "base", str(status)).inc()

    async def _count_failed(self, events: AsyncIterator[StreamEvent], adapter: str | None) -> AsyncIterator[StreamEvent]:
        """``events`` as they come; a choice that fails mid-stream (its answer already 200) counts as the adapter's 500."""
        async for event in events:
            if isinstance(event, StreamFailed):
                self._count_error(adapter, 500)
            yield event

    # ---- agents
    async def _agent(self, request: Request, req: GenRequest, agent: Any, *, stream: bool, id_prefix: str) -> Outcome | None:
        """Run a served agent as the model: its final answer is the reply (``loopwise`` has its trajectory).

        The client's tools join the agent's (a call to one ends the run with that call), ``tool_choice``
        ``required``/named and an output format are applied to the final answer, ``n > 1`` runs n agent runs.
        None when the client left before the runs ended: they are cancelled (their turn in flight is aborted; the
        task's code already running in a worker thread finishes there), as a plain request's generation is."""
        if req.prompt_ids is not None:
            raise APIError(400, f"{req.model!r} is an agent; agents answer chat-style APIs, not raw-prompt completions", param="model")
        options: dict[str, Any] = {}
        if req.tools_on:
            options["tools"] = req.tools
            choice = req.tool_choice
            options["tool_choice"] = {"name": choice.name} if isinstance(choice, NamedTool) else choice
        if req.output_format is not None:
            options["output_format"] = {"kind": req.output_format.kind, "schema": req.output_format.schema}
        session = req.session_id or session_of(request, req.user)
        rid = request.state.request_id

        async def one(i: int) -> Any:
            seed = None if req.seed is None else req.seed + i
            with bind_caller(request, req.user):  # who asked, for per-user agent memory
                return await agent.chat(req.messages, session_id=session, request_id=f"{rid}-{i}", options={**options, "seed": seed})

        leave = await self.admission.enter(owner_of(request), req.n)  # each agent run takes one of the key's slots
        try:
            answers = await unless_disconnected(request, _all(one(i) for i in range(req.n)))
        except UnknownModel as exc:
            raise APIError(404, f"agent {agent.name!r}: {exc}", param="model", code="model_not_found") from exc
        except ValueError as exc:  # e.g. a client tool named like one of the agent's
            raise APIError(400, str(exc), param="tools") from exc
        except EngineError as exc:
            raise from_engine(exc) from exc
        finally:
            leave()
        if answers is None:
            return None
        choices = []
        for i, answer in enumerate(answers):
            calls = [ParsedToolCall(name=c["name"], arguments=c["arguments"], id=c["id"]) for c in answer.tool_calls]
            choices.append(
                ChoiceOut(
                    index=i,
                    content=answer.content if answer.content or not calls else None,
                    tool_calls=calls,
                    finish_reason="tool_calls" if calls else answer.finish_reason,
                    text=answer.content,
                    completion_tokens=answer.completion_tokens,
                    ids={"trajectory_id": answer.loopwise.get("trajectory_id"), "turn_id": answer.loopwise.get("turn_id")},
                )
            )
        loopwise = dict(answers[0].loopwise)
        if req.n > 1:
            loopwise["choices"] = [{"index": c.index, **(c.ids or {})} for c in choices]
        out = Outcome(
            f"{id_prefix}{uuid.uuid4().hex[:24]}",
            int(time.time()),
            req.model,
            answers[0].prompt_tokens,
            loopwise=loopwise,
            headers={"X-Loopwise-Trajectory-Id": ",".join(str(a.loopwise.get("trajectory_id", "")) for a in answers)},
            session_id=session,
        )
        if not stream:
            out.choices = choices
            return out
        out.events = _replay(choices)
        out._completion_tokens = lambda: sum(c.completion_tokens for c in choices)
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


async def _release_after(body: AsyncIterator[T], release: Callable[[], None]) -> AsyncIterator[T]:
    """Iterate ``body``; run ``release`` when it ends, however it ends (finished, failed, or the client left)."""
    try:
        async for item in body:
            yield item
    finally:
        release()


async def _all(coros: Iterable[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` as a coroutine: cancelled as a task, its children are cancelled and nothing is left unretrieved
    (a bare gathering future that is cancelled logs "exception was never retrieved")."""
    return list(await asyncio.gather(*coros))


async def unless_disconnected(request: Request, coro: Awaitable[T]) -> T | None:
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
