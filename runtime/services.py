"""What the routers share: one typed :class:`Services` per app, on ``app.state.services``.

``create_app`` (``runtime/app.py``) builds it once; the module-level routers (``runtime/api/``, ``runtime/admin/``,
``runtime/health.py``) read it in their handlers with :func:`services` (from ``request.app.state``, as vLLM's routers
do), so no route is a closure inside the factory and nothing lives in a module global. What changes while the app
runs (the generation path built at startup, ``ready``) stays on ``app.state`` itself.

:class:`MemoryBackend` is what the memory routes ask of the memory store ``serve.py`` hands in (the runtime never
imports ``memory/``).

Not here: building the parts (``runtime/app.py``), what the routes do (their modules).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from fastapi import Request

from runtime.adapters.experiments import Experiments
from runtime.adapters.names import AdapterRef
from runtime.adapters.registry import AdapterRegistry
from runtime.adapters.routing import ModelRouter
from runtime.admission import Admission, RateLimiter
from runtime.agent_api import AgentHost
from runtime.api.response_store import ResponseBackend
from runtime.engine import Embedder, Engine
from runtime.metrics import Metrics
from runtime.recorder import Recorder
from runtime.serving import Gateway
from runtime.settings import FeedbackSettings
from runtime.traffic import TrafficHistory


class MemoryBackend(Protocol):
    def document(self, owner: str, scope: str) -> dict[str, Any] | None: ...
    def documents(self, owner: str | None) -> list[dict[str, Any]]: ...
    def delete(self, owner: str, scope: str) -> int: ...


@dataclass(frozen=True)
class Services:
    """The app's parts the routes use; one per app, never replaced."""

    model_id: str
    created: int  # the model cards' ``created``
    admin_key: str | None
    max_body: int  # bytes of a request body the routes read at most
    engine: Engine
    metrics: Metrics
    admission: Admission
    registry: AdapterRegistry
    experiments: Experiments | None  # None without the interaction store
    router: ModelRouter  # a request's model name -> the version serving it
    validated: Callable[[AdapterRef], Awaitable[AdapterRef]]  # an adapter folder checked before it loads
    gateway: Gateway  # the recorded request path
    unrecorded: Gateway  # the same, recording nothing (the admin's judges and probes)
    recorder: Recorder | None
    responses: ResponseBackend  # the stored ``/v1/responses``
    feedback: FeedbackSettings
    feedback_limiter: RateLimiter  # feedback requests per key and minute
    agents: AgentHost | None
    memory: MemoryBackend | None
    traffic: TrafficHistory
    learner_root: Path  # ``<data-dir>/learner``: the learners' status files
    learner_enabled: bool
    learner_families: Collection[str]
    embedder: Embedder | None  # embeds for an engine that cannot


def services(request: Request) -> Services:
    """The :class:`Services` of the app serving ``request``."""
    return cast(Services, request.app.state.services)
