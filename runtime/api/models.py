"""``GET /v1/models`` and ``GET /v1/models/{id}``: what a client may name as ``model``.

The list, in this order: the base model (owned by ``loopwise``), every loaded adapter version (``family@N``), every
family alias and every family a learner trains (before its first champion the base model serves it: see
``runtime/adapters/routing.py``), and every served agent (owned by ``loopwise-agent``); an unknown id is a 404
``model_not_found``.

Not here: resolving a name for a request (``runtime/adapters/routing.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from runtime.errors import APIError
from runtime.services import Services, services

router = APIRouter()


def _model_ids(s: Services) -> list[tuple[str, str]]:
    ids = [(s.model_id, "loopwise")]
    ids += [(a["name"], s.model_id) for a in s.registry.list() if a.get("state", "ready") == "ready"]
    ids += [(family, s.model_id) for family in dict.fromkeys([*s.registry.aliases(), *s.learner_families])]
    ids += [(name, "loopwise-agent") for name in (s.agents.names() if s.agents is not None else [])]
    return ids


def _model_card(model_id: str, created: int, owned_by: str = "loopwise") -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    s = services(request)
    return {"object": "list", "data": [_model_card(i, s.created, owner) for i, owner in _model_ids(s)]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict[str, Any]:
    s = services(request)
    for i, owner in _model_ids(s):
        if i == model:
            return _model_card(i, s.created, owner)
    raise APIError(404, f"The model `{model}` does not exist or you do not have access to it.", param="model", code="model_not_found")
