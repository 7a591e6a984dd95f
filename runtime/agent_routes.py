"""HTTP surfaces of served agents, over the ``AgentHost`` contract (``runtime/agent_api.py``).

- ``POST /v1/chat/completions`` with ``model`` = an agent's name: :func:`agent_chat` runs the agent
  server-side and answers like a chat completion (``stream: true`` streams the final answer in
  OpenAI's chunk format). The ``loopwise`` field carries the trajectory id, the last turn id, turns
  used and the stop reason. Agents run their own tools: a request with ``tools``, ``n > 1`` or
  ``response_format`` is a 400.
- ``POST /v1/agents/{name}/runs`` (API key): the whole trajectory (turns, tool calls, observations,
  verdicts, verifier reward).
- Admin: ``GET /admin/agents``, ``POST /admin/agents`` (an agent config), ``DELETE /admin/agents/{name}``.

Not here: the agent loop (``agents/``), which the runtime never imports.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.agent_api import AgentHost, RunConflict, ServedAgent, UnknownModel
from runtime.chat_format import to_plain
from runtime.engine import EngineError
from runtime.errors import APIError, from_engine
from runtime.http_body import read_json
from runtime.identity import bind_caller
from runtime.openai_schemas import ChatCompletionRequest
from runtime.store_routes import check_admin_key, session_of

STREAM_PIECE = 16  # characters per streamed content chunk of the final answer


def _not_supported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported for agents (agents run their own tools and sampling)", param=param, code="unsupported_for_agent")


async def agent_chat(request: Request, req: ChatCompletionRequest, agent: ServedAgent) -> Response:
    if req.tools:
        raise _not_supported("tools", "passing tools")
    if req.n != 1:
        raise _not_supported("n", "n > 1")
    if req.response_format is not None:
        raise _not_supported("response_format", "response_format")
    messages = [to_plain(m, i) for i, m in enumerate(req.messages)]
    for i, m in enumerate(messages):
        if m["role"] == "tool" or m.get("tool_calls"):
            raise APIError(400, "agents keep their own tool history; send user and assistant text only", param=f"messages[{i}]")
    rid = request.state.request_id
    try:
        with bind_caller(request, req.user):  # who asked, for per-user agent memory
            answer = await agent.chat(messages, session_id=session_of(request, req.user), request_id=rid, options={"seed": req.seed})
    except UnknownModel as exc:
        raise APIError(404, f"agent {agent.name!r}: {exc}", param="model", code="model_not_found") from exc
    except EngineError as exc:
        raise from_engine(exc) from exc
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    usage = {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    headers = {"X-Loopwise-Trajectory-Id": str(answer.loopwise.get("trajectory_id", ""))}
    if not req.stream:
        body = {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "system_fingerprint": None,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": answer.content}, "logprobs": None, "finish_reason": answer.finish_reason}
            ],
            "usage": usage,
            "loopwise": answer.loopwise,
        }
        return JSONResponse(body, headers=headers)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        base = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": req.model, "system_fingerprint": None}
        extra = {"usage": None} if include_usage else {}

        def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> str:
            body = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra, **more}
            return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

        yield chunk({"role": "assistant", "content": ""})
        for k in range(0, len(answer.content), STREAM_PIECE):
            yield chunk({"content": answer.content[k : k + STREAM_PIECE]})
        yield chunk({}, answer.finish_reason, loopwise=answer.loopwise)
        if include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})


def install_agent_routes(app: FastAPI, host: AgentHost | None, admin_key: str | None, max_body: int, reserved: Callable[[str], bool]) -> None:
    def agent_or_404(name: str) -> ServedAgent:
        agent = host.get(name) if host is not None else None
        if agent is None:
            raise APIError(404, f"no agent named {name!r}", param="name", code="agent_not_found")
        return agent

    @app.post("/v1/agents/{name}/runs")
    async def run_agent(name: str, request: Request) -> dict[str, Any]:
        agent = agent_or_404(name)
        body = await read_json(request, max_body)
        try:
            with bind_caller(request, body.get("user")):
                return await agent.run(body, session_id=session_of(request, body.get("user")), request_id=request.state.request_id)
        except UnknownModel as exc:
            raise APIError(404, str(exc), param="model", code="model_not_found") from exc
        except RunConflict as exc:
            raise APIError(409, str(exc), param=exc.param, code=exc.code) from exc
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc
        except EngineError as exc:
            raise from_engine(exc) from exc

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
