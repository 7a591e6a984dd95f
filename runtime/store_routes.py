"""HTTP surfaces over the interaction store: ``POST /v1/feedback`` and the admin API.

- ``POST /v1/feedback`` (API key): ``{"trajectory_id" | "turn_id" | "completion_id", "reward",
  "turn_rewards"?: {turn_id: reward}, "source"?, "comment"?, "idempotency_key"?}``. Rewards may come
  at any later time; unknown ids are 404, non-finite rewards 400; a repeated idempotency key is
  stored once (the answer says ``"duplicate": true``). A ``completion_id`` rewards each of its turns.
- Admin (``Authorization: Bearer <admin key>``; disabled without ``--admin-key``):
  ``GET /admin/stats``, ``GET /admin/trajectories?limit=&since=&rewarded=``,
  ``GET /admin/trajectories/{id}``, ``DELETE /admin/sessions/{key}`` (complete deletion).

Store calls run in worker threads (SQLite is blocking). Ids that are still in the recorder's queue are
flushed first, so feedback sent right after a response never sees a spurious 404.

Not here: how turns are written (``runtime/recorder.py``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError

from learner.records import Reward
from runtime.errors import APIError, from_validation
from runtime.http_body import read_json
from runtime.openai_schemas import FeedbackRequest
from runtime.recorder import ANONYMOUS, Recorder

log = logging.getLogger(__name__)


def session_of(request: Request, user: str | None) -> str:
    """The session key: ``X-Session-Id`` header, else the ``user`` field, else the shared anonymous session."""
    return request.headers.get("x-session-id") or user or ANONYMOUS


async def prune_forever(recorder: Recorder, days: float, every_s: float = 3600) -> None:
    while True:
        cutoff = time.time() - days * 86400
        try:
            removed = await asyncio.to_thread(recorder.store.prune, cutoff)
            log.info("retention: pruned %d unrewarded turns older than %.1f days", removed, days)
        except Exception:  # a failed prune is retried next round; serving goes on
            log.exception("retention prune failed")
        await asyncio.sleep(every_s)


class InternalKey(str):
    """An admin key only loopwise's own processes hold (the learner, when no ``--admin-key`` was given):
    it opens the admin API for them, while to everyone else the admin API still answers as disabled."""


def check_admin_key(request: Request, admin_key: str | None) -> None:
    disabled = APIError(403, "the admin API is disabled; start the server with --admin-key", type="permission_error", code="admin_disabled")
    if not admin_key:
        raise disabled
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header.lower().startswith("bearer ") else ""
    ok = hmac.compare_digest(token.encode(), admin_key.encode())
    if not ok and isinstance(admin_key, InternalKey):
        raise disabled
    if not ok:
        raise APIError(
            401, "a valid admin key is required (Authorization: Bearer <admin key>)", type="authentication_error", code="invalid_admin_key"
        )


def install_store_routes(app: FastAPI, recorder: Recorder | None, admin_key: str | None) -> None:
    def need_recorder() -> Recorder:
        if recorder is None:
            raise APIError(409, "recording is off on this server (started with --no-record)", code="recording_disabled")
        return recorder

    def check_admin(request: Request) -> Recorder:
        check_admin_key(request, admin_key)
        return need_recorder()

    async def exists(rec: Recorder, kind: str, some_id: str) -> bool:
        if rec.is_pending(some_id):
            await rec.flush()
        if kind == "turn":
            return await asyncio.to_thread(rec.store.turn_exists, some_id)
        return await asyncio.to_thread(rec.store.trajectory_exists, some_id)

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> dict[str, Any]:
        rec = need_recorder()
        body = await read_json(request)
        try:
            fb = FeedbackRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc) from None
        targets: list[tuple[str, str, float, str | None]] = []  # (kind, id, value, idempotency key)
        if fb.trajectory_id is not None:
            if not await exists(rec, "trajectory", fb.trajectory_id):
                raise APIError(404, f"unknown trajectory_id {fb.trajectory_id!r}", param="trajectory_id", code="not_found")
            targets.append(("trajectory", fb.trajectory_id, fb.reward, fb.idempotency_key))  # type: ignore[arg-type]
        elif fb.turn_id is not None:
            if not await exists(rec, "turn", fb.turn_id):
                raise APIError(404, f"unknown turn_id {fb.turn_id!r}", param="turn_id", code="not_found")
            targets.append(("turn", fb.turn_id, fb.reward, fb.idempotency_key))  # type: ignore[arg-type]
        elif fb.completion_id is not None:
            if rec.is_pending(fb.completion_id):
                await rec.flush()
            turn_ids = await asyncio.to_thread(rec.store.turns_for_completion, fb.completion_id)
            if not turn_ids:
                raise APIError(404, f"unknown completion_id {fb.completion_id!r}", param="completion_id", code="not_found")
            for tid in turn_ids:
                key = f"{fb.idempotency_key}:{tid}" if fb.idempotency_key and len(turn_ids) > 1 else fb.idempotency_key
                targets.append(("turn", tid, fb.reward, key))  # type: ignore[arg-type]
        for tid, value in (fb.turn_rewards or {}).items():
            if not await exists(rec, "turn", tid):
                raise APIError(404, f"unknown turn_id {tid!r} in turn_rewards", param="turn_rewards", code="not_found")
            targets.append(("turn", tid, value, f"{fb.idempotency_key}:turn:{tid}" if fb.idempotency_key else None))
        stored, duplicate = [], False
        for kind, target_id, value, key in targets:
            reward = Reward(target=kind, target_id=target_id, value=value, source=fb.source, comment=fb.comment, idempotency_key=key)  # type: ignore[arg-type]
            saved, created = await asyncio.to_thread(rec.store.add_reward, reward)
            duplicate = duplicate or not created
            stored.append({"reward_id": saved.reward_id, "target": saved.target, "target_id": saved.target_id, "value": saved.value})
        return {"object": "feedback", "rewards": stored, "duplicate": duplicate}

    @app.get("/admin/stats")
    async def admin_stats(request: Request) -> dict[str, Any]:
        rec = check_admin(request)
        counts = await asyncio.to_thread(rec.store.stats)
        return {**counts, "queued": rec.queued(), "durability": rec.durability}

    @app.get("/admin/trajectories")
    async def admin_trajectories(request: Request, limit: int = 50, since: float | None = None, rewarded: bool | None = None) -> dict[str, Any]:
        rec = check_admin(request)
        if not 1 <= limit <= 1000:
            raise APIError(400, "limit must be between 1 and 1000", param="limit", code="invalid_value")
        await rec.flush()
        rows = await asyncio.to_thread(rec.store.list_trajectories, limit, since, rewarded)
        return {"object": "list", "data": rows}

    @app.get("/admin/trajectories/{trajectory_id}")
    async def admin_trajectory(request: Request, trajectory_id: str) -> dict[str, Any]:
        rec = check_admin(request)
        if rec.is_pending(trajectory_id):
            await rec.flush()
        traj = await asyncio.to_thread(rec.store.get_trajectory, trajectory_id)
        if traj is None:
            raise APIError(404, f"unknown trajectory_id {trajectory_id!r}", param="trajectory_id", code="not_found")
        return traj.model_dump()

    @app.delete("/admin/sessions/{key}")
    async def admin_delete_session(request: Request, key: str) -> dict[str, Any]:
        rec = check_admin(request)
        await rec.flush()  # nothing of this session may land after the deletion
        rec.forget_session(key)
        deleted = await asyncio.to_thread(rec.store.delete_session, key)
        return {"object": "session.deleted", "session": key, "deleted_turns": deleted}
