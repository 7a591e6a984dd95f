"""HTTP surfaces of served agents, over the ``AgentHost`` contract (``runtime/agent_api.py``).

- Any generating API (chat completions, responses, messages) with ``model`` = an agent's name runs the
  agent server-side through the shared request path (``runtime/serving.py``); the ``loopwise`` field
  carries the trajectory id, the last turn id, turns used and the stop reason.
- ``POST /v1/agents/{name}/runs`` (API key): the whole trajectory (turns, tool calls, observations,
  verdicts, verifier reward), owned by the caller's key.
- ``POST /admin/agents/{name}/runs`` (admin key; what the learner uses): the same, owned by ``admin``,
  and the only place a ``branch`` (a replay of a recorded trajectory) is accepted.
- ``POST /admin/agents/{name}/variants`` (admin key; RODS's synthesis in the learner): problems of the agent's
  task with the structure of a given one, each checked by the task's verifier.
- Admin: ``GET /admin/agents``, ``POST /admin/agents`` (an agent config), ``DELETE /admin/agents/{name}``.

A client that disconnects before its run ends cancels the run (a 499 in the access log), as a chat request's.

Not here: the agent loop (``agents/``), which the runtime never imports.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.agent_api import RunConflict, RunNotFound, ServedAgent, UnknownModel
from runtime.engine import EngineError
from runtime.errors import APIError, from_engine
from runtime.http_body import read_json
from runtime.identity import ADMIN_OWNER, bind_caller, check_admin_key, owner_of, session_of
from runtime.services import Services, services
from runtime.serving import unless_disconnected

router = APIRouter()


def _agent_or_404(request: Request, name: str) -> ServedAgent:
    host = services(request).agents
    agent = host.get(name) if host is not None else None
    if agent is None:
        raise APIError(404, f"no agent named {name!r}", param="name", code="agent_not_found")
    return agent


def _name_taken(s: Services, name: str) -> bool:
    """``name`` is already the base model's, an alias's or an adapter version's (an agent must not shadow it)."""
    return name == s.model_id or name in s.registry.aliases() or any(a["name"] == name for a in s.registry.list())


async def _run(name: str, request: Request, *, admin: bool) -> dict[str, Any] | Response:
    agent = _agent_or_404(request, name)
    s = services(request)
    body = await read_json(request, s.max_body)
    if not admin and (body.get("branch") is not None or body.get("segment") is not None):
        what = "branch" if body.get("branch") is not None else "segment"
        raise APIError(
            403,
            f"{what} runs replay or grow recorded trajectories and are for the learner and admins: "
            "POST /admin/agents/{name}/runs with the admin key",
            param=what,
            type="permission_error",
            code="permission_denied",
        )
    text = body.get("input")  # text that could never fit the context is refused before it is templated and tokenized
    messages = [{"content": text}] if isinstance(text, str) else body.get("messages")
    s.admission.check_size(messages if isinstance(messages, list) else None, None, s.engine.info.max_model_len)
    session = session_of(request, body.get("user"))
    owner = ADMIN_OWNER if admin else owner_of(request)
    leave = await s.admission.enter(owner)  # one run, one slot
    try:
        with bind_caller(request, body.get("user"), owner=owner):
            # a client that leaves cancels its run (its turn in flight is aborted), as a chat request's generation is
            out = await unless_disconnected(request, agent.run(body, session_id=session, request_id=request.state.request_id, admin=admin))
        return out if out is not None else Response(status_code=499)
    except UnknownModel as exc:
        raise APIError(404, str(exc), param="model", code="model_not_found") from exc
    except RunNotFound as exc:
        raise APIError(404, str(exc), param=exc.param, code=exc.code) from exc
    except PermissionError as exc:
        raise APIError(403, str(exc), type="permission_error", code="permission_denied") from exc
    except RunConflict as exc:
        raise APIError(409, str(exc), param=exc.param, code=exc.code) from exc
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
    except EngineError as exc:
        raise from_engine(exc) from exc
    finally:
        leave()


@router.post("/v1/agents/{name}/runs", response_model=None)
async def run_agent(name: str, request: Request) -> dict[str, Any] | Response:
    return await _run(name, request, admin=False)


@router.post("/admin/agents/{name}/runs", response_model=None)
async def admin_run_agent(name: str, request: Request) -> dict[str, Any] | Response:
    check_admin_key(request, services(request).admin_key)
    return await _run(name, request, admin=True)


@router.post("/admin/agents/{name}/variants")
async def agent_variants(name: str, request: Request) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    agent = _agent_or_404(request, name)
    body = await read_json(request, services(request).max_body)
    try:
        return await agent.variants(body)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


@router.get("/admin/agents")
async def list_agents(request: Request) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    host = services(request).agents
    return {"object": "list", "data": host.describe() if host is not None else []}


@router.post("/admin/agents", status_code=201)
async def create_agent(request: Request) -> dict[str, Any]:
    s = services(request)
    check_admin_key(request, s.admin_key)
    if s.agents is None:
        raise APIError(400, "this server was started without agent support", code="agents_disabled")
    body = await read_json(request, s.max_body)
    name = body.get("name")
    if isinstance(name, str) and _name_taken(s, name):
        raise APIError(409, f"{name!r} is already a model or adapter name", param="name", code="name_taken")
    try:
        return s.agents.create(body)
    except FileExistsError as exc:
        raise APIError(409, str(exc), param="name", code="name_taken") from exc
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


@router.delete("/admin/agents/{name}")
async def delete_agent(name: str, request: Request) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    host = services(request).agents
    if host is None or not host.delete(name):
        raise APIError(404, f"no agent named {name!r}", param="name", code="agent_not_found")
    return {"deleted": name}
