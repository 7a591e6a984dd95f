"""The contract between the runtime and served agents, in both directions, without importing ``agents``.

Agents (``agents/``) reach the model through :class:`RuntimeClient`: render chat messages to the exact
token ids the engine sees, parse tool calls out of generated text, generate token-in/token-out under a
model name (base, alias, ``family@N``; the alias resolves to one version per call, acquired and released
around it, like a chat request), record turns and attach rewards. :class:`LocalRuntimeClient` is the
in-process implementation over the engine, the chat formatter, the adapter registry and the recorder; a reward
on a run that read a memory copilot's memory, and that run's memory tag (the trajectory meta keys
``MEMORY_SCOPE``, ``MEMORY_VERSION``, ``MEMORY_REWRITE``), credit the rewrite that wrote it (``runtime/memory_credit.py``).

The runtime reaches agents through :class:`AgentHost`: ``serve.py`` builds one (``agents.host``) and
hands it to ``create_app``; the app binds it to a client once the engine is up, lists its agents in
``GET /v1/models``, sends chat requests whose ``model`` names an agent to :meth:`ServedAgent.chat`,
and exposes ``POST /v1/agents/{name}/runs`` and ``/admin/agents``.

Not here: the agent loop, stop policies or tools (``agents/``, ``tools/``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from learner.records import Reward, Trajectory, Turn
from runtime.adapters.names import AdapterNotFound, AdapterRef, parse_model_name
from runtime.adapters.registry import AdapterRegistry
from runtime.admission import Admission
from runtime.chat_format import ChatFormatter, RenderedPrompt
from runtime.engine import Engine, GenerateRequest, GenerateResult, Grammar, SamplingParams, StreamChunk
from runtime.identity import current_caller
from runtime.memory_credit import MEMORY_REWRITE, MEMORY_SCOPE, MEMORY_VERSION, after_rewards, after_tag
from runtime.metrics import Metrics
from runtime.recorder import ANONYMOUS, Recorder
from runtime.tool_parsers import ParseResult, get_parser


class UnknownModel(LookupError):
    """The model name is neither the base, a loaded adapter version nor an alias."""


class RunConflict(Exception):
    """An agent run's request conflicts with recorded state (e.g. a re-rollout whose replay does not match): HTTP 409."""

    code = "conflict"
    param: str | None = None


class RunNotFound(LookupError):
    """An agent run names a recorded record that does not exist (e.g. a branch's backbone): HTTP 404."""

    code = "not_found"
    param: str | None = None


@dataclass(frozen=True)
class Lease:
    """One model name resolved to the version serving it, held until released (drains before unload)."""

    adapter: str | None  # the adapter version (``family@N``); None = the base model
    ref: Any = None


@dataclass
class AgentAnswer:
    """What a served agent answers to a chat request: the final text plus loopwise's ids."""

    content: str
    finish_reason: str  # OpenAI's: "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    loopwise: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # calls to the client's tools (id, name, arguments)


class RuntimeClient(Protocol):
    model_id: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Any
    recording: bool

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool = True) -> RenderedPrompt: ...
    def parse_tool_calls(self, text: str, tool_names: set[str]) -> ParseResult: ...
    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, adapter: str | None, request_id: str) -> GenerateResult: ...
    def stream(self, input_ids: Sequence[int], sampling: SamplingParams, adapter: str | None, request_id: str) -> AsyncIterator[StreamChunk]: ...
    def acquire(self, model: str, session_id: str = ANONYMOUS) -> Lease: ...
    def release(self, lease: Lease) -> None: ...
    async def record(self, turns: list[Turn]) -> None: ...
    async def reward(self, reward: Reward) -> None: ...
    async def annotate(self, trajectory_id: str, meta: dict[str, Any]) -> None: ...
    async def constraint(self, tools: list[dict[str, Any]], tool_choice: Any, output_format: dict[str, Any] | None) -> Grammar | None: ...
    async def trajectory(self, trajectory_id: str) -> Trajectory | None: ...


class ServedAgent(Protocol):
    name: str

    def card(self) -> dict[str, Any]: ...
    async def chat(self, messages: list[dict[str, Any]], *, session_id: str, request_id: str, options: dict[str, Any]) -> AgentAnswer: ...
    async def run(self, body: dict[str, Any], *, session_id: str, request_id: str, admin: bool = False) -> dict[str, Any]:
        """One run; ``admin``: the request came through the admin API (branches and unbounded task options allowed)."""
        ...

    async def variants(self, body: dict[str, Any]) -> dict[str, Any]:
        """RODS's synthesis (admin API): validated variants of one task problem; ValueError for a bad body."""
        ...


class AgentHost(Protocol):
    def bind(self, client: RuntimeClient) -> None: ...
    def get(self, name: str) -> ServedAgent | None: ...
    def names(self) -> list[str]: ...
    def describe(self) -> list[dict[str, Any]]: ...
    def create(self, config: dict[str, Any]) -> dict[str, Any]: ...  # raises ValueError with a clear message
    def delete(self, name: str) -> bool: ...


class LocalRuntimeClient:
    """:class:`RuntimeClient` over this process's engine, formatter, adapter registry and recorder."""

    def __init__(
        self,
        engine: Engine,
        formatter: ChatFormatter,
        registry: AdapterRegistry,
        recorder: Recorder | None,
        model_id: str,
        route: Callable[[str, str, str | None, str], AdapterRef | None] | None = None,
        metrics: Metrics | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.admission = admission  # the app's: clients' constraints are built and compiled as chat requests' are
        self.engine = engine
        self.metrics = metrics  # per-adapter requests, tokens and latency of agent model calls, as for chat requests
        self.route = route  # the app's model → version routing (A/B arms, session pins); raises AdapterNotFound
        self.formatter = formatter
        self.registry = registry
        self.recorder = recorder
        self.model_id = model_id
        self.tokenizer = formatter.tokenizer
        self.max_model_len = engine.info.max_model_len
        self.eos_token_ids = tuple(engine.info.eos_token_ids)
        self.recording = recorder is not None
        self._parser = get_parser(formatter.parser_name)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool = True) -> RenderedPrompt:
        return self.formatter.render_plain(messages, tools, add_generation_prompt)

    def parse_tool_calls(self, text: str, tool_names: set[str]) -> ParseResult:
        return self._parser.parse(text, tool_names)

    def acquire(self, model: str, session_id: str = ANONYMOUS) -> Lease:
        """The version serving ``model`` for this session now, held until :meth:`release`.

        With the app's router, an alias is routed exactly like a chat request (an A/B experiment's arm for
        the session, or the version the session started on, the session being the bound caller's); without it,
        the alias's current target.
        """
        try:
            if self.route is not None:
                caller = current_caller()
                ref = self.route(model, session_id, caller.user, caller.owner)
            else:
                kind, target = parse_model_name(model, self.model_id)
                ref = None if kind == "base" else self.registry.acquire(str(target))
        except AdapterNotFound as exc:
            raise UnknownModel(f"the model `{model}` does not exist") from exc
        return Lease(None) if ref is None else Lease(ref.name, ref)

    def release(self, lease: Lease) -> None:
        if lease.ref is not None:
            self.registry.release(lease.ref)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, adapter: str | None, request_id: str) -> GenerateResult:
        """One generation on ``adapter``, a version the caller holds a lease on (None = the base)."""
        t0 = time.perf_counter()
        result = await self.engine.generate(GenerateRequest(request_id=request_id, input_ids=tuple(input_ids), sampling=sampling, adapter=adapter))
        self._count(adapter, len(result.output_ids), t0)
        return result

    async def stream(self, input_ids: Sequence[int], sampling: SamplingParams, adapter: str | None, request_id: str) -> AsyncIterator[StreamChunk]:
        """Token chunks of one generation on a leased ``adapter``; closing the iterator cancels it."""
        t0, n = time.perf_counter(), 0
        chunks = self.engine.stream(GenerateRequest(request_id=request_id, input_ids=tuple(input_ids), sampling=sampling, adapter=adapter))
        try:
            async for chunk in chunks:
                n += len(chunk.token_ids)
                yield chunk
        finally:
            if (aclose := getattr(chunks, "aclose", None)) is not None:
                await aclose()  # cancels the generation when the caller stopped early
            self._count(adapter, n, t0)

    def _count(self, adapter: str | None, tokens: int, t0: float) -> None:
        if self.metrics is not None:
            label = adapter or "base"
            self.metrics.adapter_requests.labels(label).inc()
            self.metrics.adapter_tokens.labels(label).inc(tokens)
            self.metrics.adapter_latency.labels(label).observe(time.perf_counter() - t0)

    async def record(self, turns: list[Turn]) -> None:
        """Record ``turns`` as the current caller's (``runtime/identity.py``): an agent's turns belong to whoever ran it."""
        if self.recorder is not None and turns:
            owner = current_caller().owner
            await self.recorder.record([t if t.owner == owner else t.model_copy(update={"owner": owner}) for t in turns])

    async def reward(self, reward: Reward) -> None:
        """Attach ``reward`` (the runtime's own: a verifier, a self-check) to the current caller's turn or trajectory,
        once its target is committed (the recorder writes in the background)."""
        if self.recorder is None:
            return
        await self.recorder.flush()
        owner = current_caller().owner
        mine = reward if reward.owner == owner else reward.model_copy(update={"owner": owner})
        saved, _ = await self.recorder.call(self.recorder.store.add_reward, mine)
        await after_rewards(self.recorder, [saved])  # a run that read a copilot's memory credits its rewrite (runtime/memory_credit.py)

    async def constraint(self, tools: list[dict[str, Any]], tool_choice: Any, output_format: dict[str, Any] | None) -> Grammar | None:
        """The decoding constraint of a request's ``tool_choice`` (``"required"`` or ``{"name": ...}``: exactly one call to
        one of ``tools``) or ``output_format`` (``{"kind": "json_object" | "json_schema", "schema": ...}``), as chat requests
        get it: built on the admission's preparation pool and, with the app's admission, compiled as a chat request's is
        (in the engine's killable grammar worker within the deadline, the caller's key penalised for a grammar bomb), so a
        client's schema never compiles on the event loop."""
        from runtime.constraints import grammar_for
        from runtime.gen_request import GenRequest, NamedTool, OutputFormat

        choice = NamedTool(tool_choice["name"]) if isinstance(tool_choice, dict) else tool_choice
        fmt = OutputFormat(output_format["kind"], output_format.get("schema")) if output_format else None
        req = GenRequest(model=self.model_id, messages=[], api="agent", tools=tools, tool_choice=choice, output_format=fmt)
        if self.admission is None:
            return grammar_for(req, self.formatter.parser_name)
        grammar = await self.admission.prepare(grammar_for, req, self.formatter.parser_name)
        compile_fn = getattr(self.engine, "compile_grammar", None)
        if grammar is None or compile_fn is None:
            return grammar
        compiled = await self.admission.compile_grammar(compile_fn, grammar, current_caller().owner)
        return dataclasses.replace(grammar, compiled=compiled)

    async def annotate(self, trajectory_id: str, meta: dict[str, Any]) -> None:
        if self.recorder is None:
            return
        await self.recorder.flush()
        await self.recorder.call(self.recorder.store.set_trajectory_meta, trajectory_id, meta)
        if MEMORY_REWRITE in meta:  # the run's memory tag: the rewards it already has credit the rewrite behind it
            await after_tag(self.recorder, trajectory_id)

    async def trajectory(self, trajectory_id: str) -> Trajectory | None:
        """A recorded trajectory as the store holds it (a branch's backbone); None when unknown or not recording."""
        if self.recorder is None:
            return None
        if self.recorder.is_pending(trajectory_id):
            await self.recorder.flush()
        return await self.recorder.call(self.recorder.store.get_trajectory, trajectory_id)


__all__ = [
    "ANONYMOUS",
    "MEMORY_REWRITE",
    "MEMORY_SCOPE",
    "MEMORY_VERSION",
    "AgentAnswer",
    "AgentHost",
    "Lease",
    "LocalRuntimeClient",
    "RuntimeClient",
    "ServedAgent",
    "StreamChunk",
    "UnknownModel",
]
