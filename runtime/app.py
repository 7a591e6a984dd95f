"""The FastAPI app factory: the app's parts, its routers, auth, body limits, request ids, and the one error handler.

``create_app(server_settings, engine_settings, engine, model_id)`` builds the parts once into one
``runtime.services.Services`` on ``app.state.services`` (no module globals) and includes the module-level routers; the
lifespan starts and stops the engine and the background work. The routers, in the order they are matched:

- ``runtime/admin/``: ``POST /v1/feedback`` and the admin store API (``store``), adapters, aliases and A/B experiments
  (``adapters``), agents and their runs (``agents``), the learner's state (``learner``), memory (``memory``),
  ``GET /admin/traffic`` (``traffic``); the console page ``GET /console`` (``runtime/console/``)
- ``runtime/api/``: the generating APIs, each a thin translation over one request path (``runtime/serving.py``):
  ``POST /v1/chat/completions`` (``chat``), ``/v1/responses`` (``responses``), ``/v1/messages`` (``messages``,
  Anthropic's format and error envelope), ``/v1/completions`` (``completions``), ``POST /v1/embeddings``
  (``embeddings``); the admin's replays (``runtime/admin/replay.py``); ``GET /v1/models`` (``models``)
- ``GET /health`` (a one-token generate), ``GET /ready``, ``GET /metrics`` (``runtime/health.py``; Prometheus: the
  ``endpoint`` label is the route's template, so ids in paths never grow the label set)

Every error leaves as OpenAI's envelope (``runtime/errors.py``): validation failures are 400 with
``param`` (never FastAPI's 422), a bad or missing key 401, an unknown model 404, an oversized body 413,
overload 429 with ``Retry-After``, and a 500 carries only the request id (the traceback is logged).
An unknown route is a 404 naming it and the endpoints that exist. ``--cors-origin`` adds CORS
(outermost, so a browser's preflight is answered before the key check). The key is read from
``Authorization: Bearer`` or ``X-Api-Key`` (Anthropic's SDK).

Not here: what those routes do (their modules), which adapter serves a model name (``runtime/adapters/routing.py``),
process startup and the composition (``serve.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import structlog
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import runtime.admin.adapters
import runtime.admin.agents
import runtime.admin.learner
import runtime.admin.memory
import runtime.admin.replay
import runtime.admin.store
import runtime.admin.traffic
import runtime.api.chat
import runtime.api.completions
import runtime.api.embeddings
import runtime.api.messages
import runtime.api.models
import runtime.api.responses
import runtime.console.routes
import runtime.health
from runtime.adapters.experiments import Experiments, evaluate_forever
from runtime.adapters.names import AdapterRef
from runtime.adapters.registry import AdapterRegistry
from runtime.adapters.routing import ModelRouter
from runtime.adapters.sync import RegistrySync, StoreListener
from runtime.adapters.validation import adapter_validator, base_shapes_of
from runtime.admin.learner import LearnerCollector
from runtime.admin.store import prune_forever
from runtime.admission import Admission, RateLimiter
from runtime.agent_api import AgentHost, LocalRuntimeClient
from runtime.api.response_store import ResponseBackend, ResponseStore
from runtime.chat_format import ChatFormatter
from runtime.engine import Embedder, Engine, EngineError
from runtime.errors import APIError, from_engine, human_message
from runtime.generation import Generation
from runtime.identity import ADMIN_OWNER, PUBLIC_OWNER, KeyRing, bearer_token, owner_of_token, set_owner
from runtime.metrics import Metrics, ReplicaCollector
from runtime.recorder import Recorder
from runtime.services import MemoryBackend, Services
from runtime.serving import Gateway
from runtime.settings import AdapterSettings, AdmissionSettings, EngineSettings, FeedbackSettings, RecorderSettings, ServerSettings
from runtime.throttle import Throttle, Throttled
from runtime.traffic import TrafficHistory

log = logging.getLogger(__name__)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
# in the order they are matched (an unknown route's 404 lists the /v1 endpoints in this order too). Their routes go onto
# the app's router as they are: FastAPI's include_router keeps an included router as one lazy route, which the
# unknown-route message and the metrics' route templates (both read app.routes) could not see into
ROUTERS: tuple[APIRouter, ...] = (
    runtime.admin.store.router,
    runtime.admin.adapters.router,
    runtime.admin.agents.router,
    runtime.admin.learner.router,
    runtime.admin.memory.router,
    runtime.admin.traffic.router,
    runtime.console.routes.router,
    runtime.api.chat.router,
    runtime.api.responses.router,
    runtime.api.messages.router,
    runtime.api.completions.router,
    runtime.api.embeddings.router,
    runtime.admin.replay.router,
    runtime.api.models.router,
    runtime.health.router,
)


def create_app(
    server: ServerSettings,
    engine_settings: EngineSettings,
    engine: Engine,
    model_id: str,
    *,
    metrics: Metrics | None = None,
    recorder: Recorder | None = None,
    recorder_settings: RecorderSettings | None = None,
    feedback_settings: FeedbackSettings | None = None,
    admission_settings: AdmissionSettings | None = None,
    adapter_settings: AdapterSettings | None = None,
    agents: AgentHost | None = None,
    learner_enabled: bool = False,
    memory: MemoryBackend | None = None,
    learner_families: Collection[str] = (),
    embedder: Embedder | None = None,
    response_store: ResponseBackend | None = None,
) -> FastAPI:
    metrics = metrics or Metrics(engine.stats)
    admission = Admission(
        admission_settings or AdmissionSettings(), unlimited_owners=(PUBLIC_OWNER, ADMIN_OWNER), on_throttled=metrics.throttled_requests.inc
    )
    metrics.throttled_keys.set_function(admission.throttle.throttled_keys)
    recorder_settings = recorder_settings or RecorderSettings(record=recorder is not None)
    adapter_settings = adapter_settings or AdapterSettings()
    feedback_settings = feedback_settings or FeedbackSettings()
    registry = AdapterRegistry(
        max_loaded=adapter_settings.max_loaded_adapters,
        load_fn=lambda ref: engine.load_adapter(ref.name, ref.path),
        unload_fn=engine.unload_adapter,
    )
    experiments = Experiments(recorder.store, registry) if recorder is not None else None  # type: ignore[arg-type]
    adapter_root = adapter_settings.adapter_root or server.data_dir / "adapters"
    validated = adapter_validator(lambda: base_shapes_of(engine.model), adapter_root, adapter_settings.max_lora_rank)  # type: ignore[attr-defined]
    listener, sync = _store_sync(recorder, registry, experiments, validated)
    lifespan = _lifespan(engine_settings, server, recorder_settings, sync, listener)
    app = FastAPI(title="loopwise", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.ready = False
    _install_error_handlers(app)
    metrics.registry.register(LearnerCollector(server.data_dir / "learner"))
    if callable(replica_status := getattr(engine, "status", None)):  # replicas of an external engine
        metrics.registry.register(ReplicaCollector(replica_status))
    route = ModelRouter(registry, experiments, model_id, learner_families)
    app.state.services = Services(
        model_id=model_id,
        created=int(time.time()),
        admin_key=server.admin_key,
        max_body=server.max_body_bytes,
        engine=engine,
        metrics=metrics,
        admission=admission,
        registry=registry,
        experiments=experiments,
        router=route,
        validated=validated,
        gateway=Gateway(lambda: app.state.generation, route, registry, metrics, agents, admission=admission),
        unrecorded=Gateway(lambda: app.state.generation_unrecorded, route, registry, metrics, None, admission=admission),
        recorder=recorder,
        # by default a file of this runtime's, opened on the first stored response; deletes reach it too
        responses=response_store if response_store is not None else ResponseStore(server.data_dir / "responses.db"),
        feedback=feedback_settings,
        feedback_limiter=RateLimiter(feedback_settings.per_minute),
        agents=agents,
        memory=memory,
        traffic=TrafficHistory(metrics),
        learner_root=server.data_dir / "learner",
        learner_enabled=learner_enabled,
        learner_families=learner_families,
        embedder=embedder,
    )
    for router in ROUTERS:  # the routes themselves, not include_router's one lazy route per router (see ROUTERS)
        app.router.routes.extend(router.routes)
    _add_middleware(app, server, metrics, admission.throttle)
    return app


def _store_sync(
    recorder: Recorder | None, registry: AdapterRegistry, experiments: Experiments | None, validated: Callable[[AdapterRef], Awaitable[AdapterRef]]
) -> tuple[StoreListener | None, RegistrySync | None]:
    """The registry's changes go to the store (the listener) and come back from it (the sync: at start-up, so a restart
    serves what was served; on a store several runtimes share, also the others' changes while serving); (None, None)
    without a store."""
    if recorder is None:
        return None, None
    listener = registry.listener = StoreListener(recorder.store)
    return listener, RegistrySync(recorder.store, registry, experiments, validated, listener)


def _add_middleware(app: FastAPI, server: ServerSettings, metrics: Metrics, throttle: Throttle) -> None:
    # /v1 takes API keys only: the admin key opens /admin and is not an API key (runtime/identity.py)
    keys = KeyRing(server.api_keys, server.admin_key)
    app.add_middleware(_RequestContext, keys=keys, metrics=metrics, routes=app.router.routes, throttle=throttle)
    if server.cors_origins:  # outermost: a browser's preflight is answered before authentication
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "X-Loopwise-Trajectory-Id", "X-Loopwise-Turn-Id"],
            max_age=600,
        )


def _lifespan(
    engine_settings: EngineSettings,
    server: ServerSettings,
    recorder_settings: RecorderSettings,
    sync: RegistrySync | None,
    listener: StoreListener | None,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Startup (the engine, the generation path, the agents' client, the background work) and shutdown, in reverse."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        s: Services = app.state.services
        engine, recorder = s.engine, s.recorder
        await engine.start()
        tokenizer = getattr(engine, "tokenizer", None)
        model_type = getattr(getattr(getattr(engine, "model", None), "config", None), "model_type", None)
        formatter = ChatFormatter(tokenizer, model_type=model_type, parser=server.tool_call_parser)
        max_tokens = engine_settings.default_max_tokens
        app.state.generation = Generation(engine, formatter, s.model_id, max_tokens, s.metrics, recorder=recorder)
        app.state.generation_unrecorded = Generation(engine, formatter, s.model_id, max_tokens, s.metrics)
        if s.agents is not None:
            client = LocalRuntimeClient(engine, formatter, s.registry, recorder, s.model_id, route=s.router, metrics=s.metrics, admission=s.admission)
            s.agents.bind(client)
        background: list[asyncio.Task[None]] = [asyncio.create_task(s.traffic.run())]
        if recorder is not None:
            recorder.start()
            if recorder_settings.retention_days:
                background.append(asyncio.create_task(prune_forever(recorder, recorder_settings.retention_days)))
        if sync is not None:
            shared = getattr(sync.store, "shared", False)
            try:
                await sync.sync_once()  # serve what was served before a restart, and what the other runtimes serve, from the first request on
            except Exception:
                log.exception("restoring the adapters and aliases from the store failed" + ("; retrying in the background" if shared else ""))
            if shared:
                background.append(asyncio.create_task(sync.run_forever(recorder_settings.store_sync_s)))
        if s.experiments is not None:
            background.append(asyncio.create_task(evaluate_forever(s.experiments)))
        freeze_heap()
        app.state.ready = True
        log.info(
            "serving model %s (tool-call parser %s, recording %s)",
            s.model_id,
            formatter.parser_name,
            recorder_settings.durability if recorder else "off",
        )
        try:
            yield
        finally:
            app.state.ready = False
            for task in background:
                task.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(s.registry.settled(), 10.0)  # an evicted adapter's unload, still under way
            await engine.close()
            s.responses.close()
            s.admission.close()
            if listener is not None:
                await asyncio.to_thread(listener.close)  # registry changes still on their way to the store
            if recorder is not None:
                await asyncio.to_thread(recorder.close)  # writes everything still queued

    return lifespan


def freeze_heap() -> None:
    """Move everything alive into CPython's permanent generation (``gc.freeze``), as vLLM does after its warm-up and
    SGLang's ``freeze_gc``: the ~450k objects torch, transformers and the app leave behind made each full collection
    ~250 ms of CPU with the GIL held, a stall of every stream, the engine's steps and the event loop at once (up to
    1.4 s beside busy engine processes on 2 cores). Only the young generations are collected first (a full collection
    here is itself 0.3 s, paid by every server start): what startup left as cyclic garbage in the oldest generation
    stays (1,812 small lists and dicts, no tensor, for SmolLM2). Objects made later are collected as before; frozen
    ones are still freed by reference counting."""
    started = time.perf_counter()
    gc.collect(1)
    gc.freeze()
    log.info("froze %d objects out of the garbage collector's reach in %.3f s", gc.get_freeze_count(), time.perf_counter() - started)


class _RequestContext:
    """Request id, API-key check on ``/v1/``, the key's throttle (``runtime/throttle.py``: counted here, where every
    status is known, and refused here, before the body is read), the error envelope for anything unhandled, request metrics.

    A pure ASGI middleware: Starlette's ``@app.middleware("http")`` (BaseHTTPMiddleware) re-wraps every
    request and response body in extra tasks and streams, which cost measurable latency per request.
    """

    def __init__(self, app: ASGIApp, keys: KeyRing, metrics: Metrics, routes: list[BaseRoute], throttle: Throttle) -> None:
        self.app, self.keys, self.metrics, self.routes, self.throttle = app, keys, metrics, routes, throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        rid = request.headers.get("x-request-id") or ""
        if not _REQUEST_ID.fullmatch(rid):  # a client's id is kept for log correlation only when it is a plain short id
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        endpoint = scope["path"]
        t0 = time.perf_counter()
        status = 500
        started = False

        entered: str | None = None  # the owner whose request the throttle let in

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                MutableHeaders(scope=message)["x-request-id"] = rid
                if entered is not None and (wait := self.throttle.delay(entered, status)):
                    await asyncio.sleep(wait)  # a throttled key's refused request holds its one slot a while
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                if endpoint.startswith("/v1/"):
                    owner = _check_auth(request, self.keys)
                    set_owner(scope, owner)
                    try:
                        self.throttle.enter(owner)
                    except Throttled as exc:
                        await exc.tarpit()
                        raise
                    entered = owner
                await self.app(scope, receive, send_with_id)
            except APIError as exc:
                if started:
                    raise
                await _error_response(exc, endpoint)(scope, receive, send_with_id)
            except EngineError as exc:  # e.g. a request a translation found invalid (InvalidRequest)
                if started:
                    raise
                await _error_response(from_engine(exc), endpoint)(scope, receive, send_with_id)
            except Exception:
                log.exception("unhandled error in %s %s", scope["method"], endpoint)
                if started:
                    raise
                error = APIError(
                    500, f"The server had an error processing your request (request id {rid}).", type="server_error", code="internal_error"
                )
                await _error_response(error, endpoint)(scope, receive, send_with_id)
            finally:
                if entered is not None:
                    self.throttle.leave(entered, status)
        # the route's template, not the raw path: ids in paths (and unknown paths) must not grow the label set without bound
        label = _CONVERTER.sub("}", getattr(scope.get("route"), "path", None) or _route_template(self.routes, scope))
        self.metrics.requests.labels(label, str(status)).inc()
        if status < 400:
            self.metrics.latency.labels(label).observe(time.perf_counter() - t0)


_CONVERTER = re.compile(r":[a-z]+}")  # "/v1/models/{model:path}" is labelled "/v1/models/{model}"


def _route_template(routes: list[BaseRoute], scope: Scope) -> str:
    """The path template of the route ``scope`` would match (for a request refused before routing), else ``unmatched``."""
    for route in routes:
        if route.matches(scope)[0] != Match.NONE and isinstance(path := getattr(route, "path", None), str):
            return path
    return "unmatched"


def _check_auth(request: Request, keys: KeyRing) -> str:
    """The owner of a ``/v1`` request, or a 401 (constant-time key checks; the admin key is not an API key)."""
    if keys.open:
        return PUBLIC_OWNER
    token = bearer_token(request)
    if not token:
        raise APIError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' (or 'X-Api-Key: <key>').",
            type="authentication_error",
            code="invalid_api_key",
        )
    if not keys.is_api_key(token):
        if keys.is_admin_key(token):
            raise APIError(
                401,
                "The admin key is not an API key: use it on /admin only, and an API key on /v1.",
                type="authentication_error",
                code="invalid_api_key",
            )
        raise APIError(401, "Incorrect API key provided.", type="authentication_error", code="invalid_api_key")
    return owner_of_token(token)


def _error_response(exc: APIError, path: str = "") -> JSONResponse:
    """The error in OpenAI's envelope, or Anthropic's on ``/v1/messages`` (clients parse their own)."""
    body = exc.anthropic_body() if path.startswith("/v1/messages") else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = tuple(x for x in err.get("loc", ()) if x != "body")
        error = APIError(400, human_message(str(err.get("msg"))), param=".".join(map(str, loc)) or None, code="invalid_value")
        return _error_response(error, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405) and exc.detail in ("Not Found", "Method Not Allowed"):
            return _error_response(unknown_route(request, app, exc.status_code), request.url.path)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind, code=code), request.url.path)


def unknown_route(request: Request, app: FastAPI, status: int = 404) -> APIError:
    """A 404 that names the route asked for and the API endpoints this server has (clients show the message)."""
    endpoints = []
    for route in app.routes:
        path = getattr(route, "path", "")
        if path.startswith("/v1/") and not path.startswith("/v1/agents/"):
            endpoints += [f"{m} {path}" for m in sorted(getattr(route, "methods", None) or ()) if m != "HEAD"]
    asked = f"{request.method} {request.url.path}"
    if status == 405:
        message = f"Method not allowed: {asked}. This server serves {', '.join(endpoints)}."
        return APIError(405, message, code="method_not_allowed")
    message = f"Unknown route {asked}: this server has no such endpoint. It serves {', '.join(endpoints)}."
    return APIError(404, message, code="unknown_route")
