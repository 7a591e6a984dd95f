"""The FastAPI app factory: routes, auth, body limits, request ids, and the one error handler.

``create_app(server_settings, engine_settings, engine, model_id)`` builds everything on ``app.state``
(no module globals); the lifespan starts and stops the engine. Routes:

- the generating APIs, each a thin translation over one request path (``serving``, ``generation``):
  ``POST /v1/chat/completions`` (``serving_chat``), ``/v1/responses`` (``serving_responses``),
  ``/v1/messages`` (``serving_messages``, Anthropic's format and error envelope), ``/v1/completions``
  (``serving_completions``); ``POST /v1/embeddings`` (``serving_embeddings``)
- ``GET /v1/models``, ``GET /v1/models/{id}``
- ``GET /health`` (a one-token generate), ``GET /ready``, ``GET /metrics`` (Prometheus; the ``endpoint``
  label is the route's template, so ids in paths never grow the label set)
- ``GET /admin/traffic`` (``runtime/traffic.py``) and the console page ``GET /console`` (``runtime/console.py``)
- installed from their own modules: ``POST /v1/feedback`` and the admin store API (``store_routes``), adapters,
  aliases and A/B experiments (``adapter_routes``), agents and their runs (``agent_routes``), memory
  (``memory_routes``) and the learner's state (``learner_routes``)

Every error leaves as OpenAI's envelope (``runtime/errors.py``): validation failures are 400 with
``param`` (never FastAPI's 422), a bad or missing key 401, an unknown model 404, an oversized body 413,
overload 429 with ``Retry-After``, and a 500 carries only the request id (the traceback is logged).
An unknown route is a 404 naming it and the endpoints that exist. ``--cors-origin`` adds CORS
(outermost, so a browser's preflight is answered before the key check). The key is read from
``Authorization: Bearer`` or ``X-Api-Key`` (Anthropic's SDK).

Not here: what those routes do (their modules), process startup and the composition (``serve.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.adapter_names import AdapterNotFound, AdapterRef, parse_model_name
from runtime.adapter_registry import AdapterRegistry
from runtime.adapter_routes import adapter_validator, evaluate_forever, install_adapter_routes
from runtime.adapter_validation import base_shapes_of
from runtime.admission import Admission
from runtime.agent_api import AgentHost, LocalRuntimeClient
from runtime.agent_routes import install_agent_routes
from runtime.chat_format import ChatFormatter
from runtime.console import install_console_routes
from runtime.engine import Embedder, Engine, EngineError
from runtime.errors import APIError, from_engine, human_message
from runtime.experiments import Experiments
from runtime.generation import Generation
from runtime.identity import ADMIN_OWNER, PUBLIC_OWNER, KeyRing, bearer_token, owner_of_token, set_owner
from runtime.learner_routes import LearnerCollector, install_learner_routes
from runtime.memory_routes import MemoryBackend, install_memory_routes
from runtime.metrics import Metrics, ReplicaCollector
from runtime.recorder import ANONYMOUS, Recorder
from runtime.registry_sync import RegistrySync, StoreListener
from runtime.replay_routes import install_replay_routes
from runtime.response_store import ResponseBackend, ResponseStore
from runtime.serving import Gateway
from runtime.serving_chat import install_chat_routes
from runtime.serving_completions import install_completions_routes
from runtime.serving_embeddings import install_embeddings_routes
from runtime.serving_messages import install_messages_routes
from runtime.serving_responses import install_responses_routes
from runtime.settings import AdapterSettings, AdmissionSettings, EngineSettings, FeedbackSettings, RecorderSettings, ServerSettings
from runtime.store_routes import install_store_routes, prune_forever
from runtime.traffic import TrafficHistory, install_traffic_routes

log = logging.getLogger(__name__)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


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
    admission = Admission(admission_settings or AdmissionSettings(), unlimited_owners=(PUBLIC_OWNER, ADMIN_OWNER))
    recorder_settings = recorder_settings or RecorderSettings(record=recorder is not None)
    adapter_settings = adapter_settings or AdapterSettings()
    registry = AdapterRegistry(
        max_loaded=adapter_settings.max_loaded_adapters,
        load_fn=lambda ref: engine.load_adapter(ref.name, ref.path),
        unload_fn=engine.unload_adapter,
    )
    experiments = Experiments(recorder.store, registry) if recorder is not None else None  # type: ignore[arg-type]
    adapter_root = adapter_settings.adapter_root or server.data_dir / "adapters"
    listener: StoreListener | None = None
    sync: RegistrySync | None = None
    if recorder is not None and getattr(recorder.store, "shared", False):  # several runtimes on one store agree through it
        listener = registry.listener = StoreListener(recorder.store)
        validated = adapter_validator(lambda: base_shapes_of(engine.model), adapter_root, adapter_settings.max_lora_rank)  # type: ignore[attr-defined]
        sync = RegistrySync(recorder.store, registry, experiments, validated)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        tokenizer = getattr(engine, "tokenizer", None)
        model_type = getattr(getattr(getattr(engine, "model", None), "config", None), "model_type", None)
        formatter = ChatFormatter(tokenizer, model_type=model_type, parser=server.tool_call_parser)
        app.state.generation = Generation(engine, formatter, model_id, engine_settings.default_max_tokens, metrics, recorder=recorder)
        app.state.generation_unrecorded = Generation(engine, formatter, model_id, engine_settings.default_max_tokens, metrics)
        if agents is not None:
            agents.bind(LocalRuntimeClient(engine, formatter, registry, recorder, model_id, route=_route, metrics=metrics))
        background: list[asyncio.Task[None]] = [asyncio.create_task(traffic.run())]
        if recorder is not None:
            recorder.start()
            if recorder_settings.retention_days:
                background.append(asyncio.create_task(prune_forever(recorder, recorder_settings.retention_days)))
        if sync is not None:
            try:
                await sync.sync_once()  # serve what the other runtimes serve from the first request on
            except Exception:
                log.exception("the first sync with the shared store failed; retrying in the background")
            background.append(asyncio.create_task(sync.run_forever(recorder_settings.store_sync_s)))
        if experiments is not None:
            background.append(asyncio.create_task(evaluate_forever(experiments)))
        app.state.ready = True
        log.info(
            "serving model %s (tool-call parser %s, recording %s)",
            model_id,
            formatter.parser_name,
            recorder_settings.durability if recorder else "off",
        )
        try:
            yield
        finally:
            app.state.ready = False
            for task in background:
                task.cancel()
            await engine.close()
            responses.close()
            admission.close()
            if listener is not None:
                await asyncio.to_thread(listener.close)  # registry changes still on their way to the shared store
            if recorder is not None:
                await asyncio.to_thread(recorder.close)  # writes everything still queued

    app = FastAPI(title="loopwise", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.model_id = model_id
    app.state.ready = False
    app.state.created = int(time.time())
    _install_error_handlers(app)
    # by default a file of this runtime's, opened on the first stored response; deletes reach it too
    responses: ResponseBackend = response_store if response_store is not None else ResponseStore(server.data_dir / "responses.db")
    install_store_routes(app, recorder, server.admin_key, feedback_settings, responses=responses)
    install_adapter_routes(
        app,
        registry=registry,
        experiments=experiments,
        admin_key=server.admin_key,
        base_shapes=lambda: base_shapes_of(engine.model),  # type: ignore[attr-defined]
        adapter_root=adapter_root,
        max_rank=adapter_settings.max_lora_rank,
    )
    app.state.registry = registry
    app.state.experiments = experiments
    app.state.agents = agents

    def _name_taken(name: str) -> bool:
        return name == model_id or name in registry.aliases() or any(a["name"] == name for a in registry.list())

    install_agent_routes(app, agents, server.admin_key, server.max_body_bytes, _name_taken, admission)
    install_learner_routes(app, server.data_dir, server.admin_key, learner_enabled)
    metrics.registry.register(LearnerCollector(server.data_dir / "learner"))
    if callable(replica_status := getattr(engine, "status", None)):  # replicas of an external engine
        metrics.registry.register(ReplicaCollector(replica_status))
    install_memory_routes(app, memory, server.admin_key, recorder)
    traffic = TrafficHistory(metrics)
    app.state.traffic = traffic
    install_traffic_routes(app, traffic, server.admin_key)
    install_console_routes(app)
    gateway = Gateway(
        lambda: app.state.generation, lambda model, session, user: _route(model, session, user), registry, metrics, agents, admission=admission
    )
    app.state.gateway = gateway
    install_chat_routes(app, gateway, server.max_body_bytes)
    install_responses_routes(app, gateway, responses, server.max_body_bytes)
    install_messages_routes(app, gateway, server.max_body_bytes)
    install_completions_routes(app, gateway, server.max_body_bytes)
    install_embeddings_routes(app, gateway, model_id, server.max_body_bytes, fallback=embedder)

    def unrecorded_generation() -> Generation:
        return app.state.generation_unrecorded  # type: ignore[no-any-return]

    route = lambda model, session, user: _route(model, session, user)  # noqa: E731
    unrecorded = Gateway(unrecorded_generation, route, registry, metrics, None, admission=admission)
    install_replay_routes(app, gateway, unrecorded, recorder, server.admin_key, server.max_body_bytes)

    # /v1 takes API keys only: the admin key opens /admin and is not an API key (runtime/identity.py)
    app.add_middleware(_RequestContext, keys=KeyRing(server.api_keys, server.admin_key), metrics=metrics, routes=app.router.routes)
    if server.cors_origins:  # outermost: a browser's preflight is answered before authentication
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "X-Loopwise-Trajectory-Id", "X-Loopwise-Turn-Id"],
            max_age=600,
        )

    pins: OrderedDict[tuple[str, str], str] = OrderedDict()  # (session, family) -> version it started on

    def _route(model: str, session: str, user: str | None = None) -> AdapterRef | None:
        """Routing shared by chat requests and agent runs: base, a version, an A/B arm, or the session's pinned version."""
        kind, target = parse_model_name(model, model_id)
        if kind == "base":
            return None
        assert target is not None
        if kind == "version":
            return registry.acquire(target)
        if target in learner_families and target not in registry.aliases():
            return None  # a family a learner trains, before its first champion: the base model serves it
        # a request without a session (no X-Session-Id, no `user`) is its own unit of randomisation: hashing the one
        # anonymous key would send every such request to the same arm, and the experiment could never compare its arms
        arm_key = session if session != ANONYMOUS else uuid.uuid4().hex
        arm = experiments.route(target, arm_key, user) if experiments is not None else None
        if arm is not None:
            with contextlib.suppress(AdapterNotFound):  # an arm unloaded mid-experiment: serve the champion
                return registry.acquire(arm)
        # no experiment: a session stays on the version it started on while that version is loaded
        pin = (session, target)
        if session != ANONYMOUS and (pinned := pins.get(pin)) is not None:
            with contextlib.suppress(AdapterNotFound):
                return registry.acquire(pinned)
        ref = registry.acquire(target)
        if session != ANONYMOUS:
            pins[pin] = ref.name
            while len(pins) > 100_000:
                pins.popitem(last=False)
        return ref

    def _model_ids() -> list[tuple[str, str]]:
        ids = [(model_id, "loopwise")]
        ids += [(a["name"], model_id) for a in registry.list() if a.get("state", "ready") == "ready"]
        ids += [(family, model_id) for family in dict.fromkeys([*registry.aliases(), *learner_families])]
        ids += [(name, "loopwise-agent") for name in (agents.names() if agents is not None else [])]
        return ids

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(i, app.state.created, owner) for i, owner in _model_ids()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        for i, owner in _model_ids():
            if i == model:
                return _model_card(i, app.state.created, owner)
        raise APIError(404, f"The model `{model}` does not exist or you do not have access to it.", param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        try:
            await asyncio.wait_for(engine.health(), timeout=30)
        except Exception as exc:  # any failure to generate means unhealthy; the cause goes to the log
            log.exception("health check failed")
            raise APIError(503, "engine health check failed", type="server_error", code="unhealthy") from exc
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict[str, Any]:
        if not app.state.ready:
            raise APIError(503, "not ready", type="server_error", code="not_ready")
        if recorder is not None and not recorder.healthy:  # answered turns go to the journal until the store takes writes
            raise APIError(503, "the interaction store is not taking writes", type="server_error", code="recorder_unavailable")
        return {"status": "ready", "model": model_id}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


class _RequestContext:
    """Request id, API-key check on ``/v1/``, the error envelope for anything unhandled, request metrics.

    A pure ASGI middleware: Starlette's ``@app.middleware("http")`` (BaseHTTPMiddleware) re-wraps every
    request and response body in extra tasks and streams, which cost measurable latency per request.
    """

    def __init__(self, app: ASGIApp, keys: KeyRing, metrics: Metrics, routes: list[BaseRoute]) -> None:
        self.app, self.keys, self.metrics, self.routes = app, keys, metrics, routes

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

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                MutableHeaders(scope=message)["x-request-id"] = rid
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                if endpoint.startswith("/v1/"):
                    set_owner(scope, _check_auth(request, self.keys))
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


def _model_card(model_id: str, created: int, owned_by: str = "loopwise") -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


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
