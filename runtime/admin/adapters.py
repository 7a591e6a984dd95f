"""Admin API for adapters, aliases and A/B experiments, and the periodic experiment evaluator.

All routes need the admin key (``Authorization: Bearer <admin key>``):

- ``GET /admin/adapters``; ``POST /admin/adapters`` ``{"path", "family", "version"?, "alias"?, "pinned"?,
  "sha256"?}`` (version defaults to the next number; the folder is validated against the base model
  before anything is loaded); ``DELETE /admin/adapters/{family@N}`` (waits for in-flight requests);
  ``PUT /admin/aliases/{family}`` ``{"target": "family@N"}`` (flips atomically).
Experiment calls run on the event loop (their store reads are small aggregates), because promotion
flips a registry alias and the registry is single-loop by design.

- ``POST /admin/experiments`` (see ``runtime/adapters/experiments.py`` for the fields), ``GET /admin/experiments``,
  ``GET /admin/experiments/{name}`` (recomputes the statistics and applies automatic decisions),
  ``POST /admin/experiments/{name}/stop``, ``POST /admin/experiments/{name}/promote`` ``{"arm"}``.

Not here: choosing an adapter for a request (``runtime/adapters/routing.py``), the folder checks
(``runtime/adapters/validation.py``), the experiments' statistics and decisions (``runtime/adapters/``).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.adapters.experiments import ExperimentConfig, ExperimentError, Experiments
from runtime.adapters.names import AdapterCapacity, AdapterError, AdapterExists, AdapterInUse, AdapterInvalid, AdapterNotFound, AdapterRef
from runtime.engine import AdapterError as EngineAdapterError
from runtime.engine import EngineError
from runtime.errors import APIError, from_engine, from_validation
from runtime.http_body import read_json
from runtime.identity import check_admin_key
from runtime.services import services

log = logging.getLogger(__name__)
router = APIRouter()


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    family: str
    version: int | None = Field(None, ge=1)
    alias: bool = False
    pinned: bool = False
    sha256: str | None = None


class SetAlias(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str


class PromoteArm(BaseModel):
    model_config = ConfigDict(extra="forbid")
    arm: str


def adapter_api_error(exc: AdapterError) -> APIError:
    if isinstance(exc, AdapterNotFound):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, AdapterInvalid):
        return APIError(400, str(exc), param="path", code="invalid_adapter")
    if isinstance(exc, AdapterExists | AdapterInUse | AdapterCapacity):
        return APIError(409, str(exc), code=type(exc).__name__)
    return APIError(400, str(exc), code="adapter_error")


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


def _known_experiment(request: Request, name: str) -> Experiments:
    exps = _need_experiments(request)
    if name not in exps.configs:
        raise APIError(404, f"unknown experiment {name!r}", param="name", code="not_found")
    return exps


def _need_experiments(request: Request) -> Experiments:
    experiments = services(request).experiments
    if experiments is None:
        raise APIError(409, "experiments need the interaction store (recording is off)", code="recording_disabled")
    return experiments


@router.get("/admin/adapters")
async def list_adapters(request: Request) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    registry = services(request).registry
    return {"object": "list", "data": registry.list(), "aliases": registry.aliases()}


@router.post("/admin/adapters")
async def load_adapter(request: Request) -> dict[str, Any]:
    s = services(request)
    check_admin_key(request, s.admin_key)
    body: LoadAdapter = _parse(LoadAdapter, await read_json(request))
    try:
        version = body.version or s.registry.next_version(body.family)
        ref = AdapterRef(family=body.family, version=version, path=body.path, pinned=body.pinned, sha256=body.sha256)
        ref = await s.registry.register(await s.validated(ref), make_alias=body.alias)
    except AdapterError as exc:
        raise adapter_api_error(exc) from exc
    except EngineAdapterError as exc:  # the engine (e.g. SGLang) refused it; the registry is unchanged
        log.warning("engine refused adapter %s@%s from %s: %s", body.family, body.version or "next", body.path, exc)
        raise APIError(400, str(exc), param="path", code="adapter_load_failed") from exc
    except EngineError as exc:
        raise from_engine(exc) from exc
    log.info("loaded adapter %s from %s", ref.name, ref.path)
    return {"object": "adapter", "name": ref.name, "family": ref.family, "version": ref.version, "aliases": s.registry.aliases()}


@router.delete("/admin/adapters/{name}")
async def unload_adapter(request: Request, name: str) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    try:
        await services(request).registry.unregister(name)
    except AdapterError as exc:
        raise adapter_api_error(exc) from exc
    except EngineError as exc:  # it left routing; the engine failed to free it (logged for the operator)
        log.error("engine failed to unload adapter %s: %s", name, exc)
        raise APIError(
            502, f"adapter {name} is no longer routed, but the engine failed to unload it", type="server_error", code="adapter_unload_failed"
        ) from exc
    return {"object": "adapter.deleted", "name": name}


@router.put("/admin/aliases/{family}")
async def set_alias(request: Request, family: str) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    body: SetAlias = _parse(SetAlias, await read_json(request))
    try:
        services(request).registry.set_alias(family, body.target)
    except AdapterError as exc:
        raise adapter_api_error(exc) from exc
    return {"object": "alias", "family": family, "target": body.target}


@router.post("/admin/experiments")
async def create_experiment(request: Request) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    exps = _need_experiments(request)
    cfg: ExperimentConfig = _parse(ExperimentConfig, await read_json(request))
    try:
        return exps.create(cfg, {a["name"] for a in services(request).registry.list() if a.get("state", "ready") == "ready"})
    except ExperimentError as exc:
        raise APIError(409, str(exc), code="experiment_conflict") from exc


@router.get("/admin/experiments")
async def list_experiments(request: Request) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    exps = _need_experiments(request)
    keys = ("status", "champion", "winner", "started_at")
    rows = [{"name": n, "family": c.family, **{k: exps.states[n].get(k) for k in keys}} for n, c in exps.configs.items()]
    return {"object": "list", "data": rows}


@router.get("/admin/experiments/{name}")
async def experiment_status(request: Request, name: str) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    exps = _known_experiment(request, name)
    return exps.evaluate(name)


@router.post("/admin/experiments/{name}/stop")
async def stop_experiment(request: Request, name: str) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    exps = _known_experiment(request, name)
    return exps.stop(name)


@router.post("/admin/experiments/{name}/promote")
async def promote_experiment(request: Request, name: str) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    exps = _known_experiment(request, name)
    body: PromoteArm = _parse(PromoteArm, await read_json(request))
    try:
        return exps.promote(name, body.arm)
    except (ExperimentError, AdapterError) as exc:
        raise APIError(400, str(exc), param="arm", code="invalid_value") from exc
