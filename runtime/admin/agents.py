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

Not here: the agent loop (``agents/``), which the runtime never imports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from runtime.admission import Admission
from runtime.agent_api import AgentHost, RunConflict, RunNotFound, ServedAgent, UnknownModel
from runtime.engine import EngineError
from runtime.errors import APIError, from_engine
from runtime.http_body import read_json
from runtime.identity import ADMIN_OWNER, bind_caller, owner_of
from runtime.store_routes import check_admin_key, session_of


def install_agent_routes(
    app: FastAPI, host: AgentHost | None, admin_key: str | None, max_body: int, reserved: Callable[[str], bool], admission: Admission | None = None
) -> None:
    def agent_or_404(name: str) -> ServedAgent:
        agent = host.get(name) if host is not None else None
        if agent is None:
            raise APIError(404, f"no agent named {name!r}", param="name", code="agent_not_found")
        return agent

    async def run(name: str, request: Request, *, admin: bool) -> dict[str, Any]:
        agent = agent_or_404(name)
        body = await read_json(request, max_body)
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
        session = session_of(request, body.get("user"))
        owner = ADMIN_OWNER if admin else owner_of(request)
        leave = await admission.enter(owner) if admission is not None else (lambda: None)  # one run, one slot
        try:
            with bind_caller(request, body.get("user"), owner=owner):
                return await agent.run(body, session_id=session, request_id=request.state.request_id, admin=admin)
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

    @app.post("/v1/agents/{name}/runs")
    async def run_agent(name: str, request: Request) -> dict[str, Any]:
        return await run(name, request, admin=False)

    @app.post("/admin/agents/{name}/runs")
    async def admin_run_agent(name: str, request: Request) -> dict[str, Any]:
        check_admin_key(request, admin_key)
        return await run(name, request, admin=True)

    @app.post("/admin/agents/{name}/variants")
    async def agent_variants(name: str, request: Request) -> dict[str, Any]:
        check_admin_key(request, admin_key)
        agent = agent_or_404(name)
        body = await read_json(request, max_body)
        try:
            return await agent.variants(body)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc

    @app.get("/admin/agents")
    async def list_agents(request: Request) -> dict[str, Any]:
        check_admin_key(request, admin_key)
        return {"object": "list", "data": host.describe() if host is not None else []}

    @app.post("/admin/agents", status_code=201)
    async def create_agent(request: Request) -> dict[str, Any]:
        check_admin_key(request, admin_key)
        if host is None:
            raise APIError(400, "this server was started without agent support", code="agents_disabled")
        body = await read_json(request, max_body)
        name = body.get("name")
        if isinstance(name, str) and reserved(name):
            raise APIError(409, f"{name!r} is already a model or adapter name", param="name", code="name_taken")
        try:
            return host.create(body)
        except FileExistsError as exc:
            raise APIError(409, str(exc), param="name", code="name_taken") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc

    @app.delete("/admin/agents/{name}")
    async def delete_agent(name: str, request: Request) -> dict[str, Any]:
        check_admin_key(request, admin_key)
        if host is None or not host.delete(name):
            raise APIError(404, f"no agent named {name!r}", param="name", code="agent_not_found")
        return {"deleted": name}
