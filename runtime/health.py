"""``GET /health``, ``GET /ready`` and ``GET /metrics``: whether this server generates, takes traffic, and its counters.

- ``/health``: a one-token generate within 30 s (``Engine.health``), else a 503 ``unhealthy`` (the cause is logged).
- ``/ready``: 503 ``not_ready`` until the app's startup finished (and after shutdown began), 503
  ``recorder_unavailable`` while the interaction store refuses writes (answered turns then go to the journal).
- ``/metrics``: Prometheus' text format (``runtime/metrics.py``).

Not here: the app's startup (``runtime/app.py``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.errors import APIError
from runtime.services import services

log = logging.getLogger(__name__)
router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    try:
        await asyncio.wait_for(services(request).engine.health(), timeout=30)
    except Exception as exc:  # any failure to generate means unhealthy; the cause goes to the log
        log.exception("health check failed")
        raise APIError(503, "engine health check failed", type="server_error", code="unhealthy") from exc
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> dict[str, Any]:
    s = services(request)
    if not request.app.state.ready:
        raise APIError(503, "not ready", type="server_error", code="not_ready")
    if s.recorder is not None and not s.recorder.healthy:  # answered turns go to the journal until the store takes writes
        raise APIError(503, "the interaction store is not taking writes", type="server_error", code="recorder_unavailable")
    return {"status": "ready", "model": s.model_id}


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(services(request).metrics.render(), media_type="text/plain; version=0.0.4")
