"""HTTP surfaces over the interaction store: ``POST /v1/feedback`` and the admin API.

- ``POST /v1/feedback`` (API key): ``{"trajectory_id" | "turn_id" | "completion_id", "reward",
  "turn_rewards"?: {turn_id: reward}, "source"?, "comment"?, "idempotency_key"?}``. Rewards may come
  at any later time, only for the caller's own records: unknown ids and other keys' ids are both 404;
  rewards outside ``[-max_abs_reward, max_abs_reward]`` (or not finite) are 400; ``source`` is a plain
  name, and ``verifier:*`` / ``judge:*`` / ``hook:*`` are reserved for the runtime's evaluators and the learner's scorers,
  ``memory:*`` for the rewards the runtime derives for a memory copilot's rewrites (403); each key
  may send ``per_minute`` feedback requests a minute (429 with ``Retry-After`` beyond); a repeated
  idempotency key (per key) is stored once (the answer says ``"duplicate": true``). A ``completion_id``
  rewards each of its choices' turns, or with ``choice_index`` that choice's turn only. How each form reaches
  training (the rule): a turn reward is part of its trajectory's reward stream, so on a one-turn trajectory
  (a plain chat completion; each of ``n`` choices is its own one-turn trajectory) it is that trajectory's
  outcome; see ``learner/advantages.py`` and ``docs/learning.md``. A reward on a run that read a memory copilot's
  memory also rewards the rewrite that wrote it (``runtime/memory_credit.py``).
- ``DELETE /v1/sessions/{key}`` (API key): deletes the caller's own session completely: its stored turns,
  trajectories and the rewards on them, its turns still queued for the store (or journaled, or of requests still
  generating: :meth:`Recorder.tombstone`, so none is written after the deletion) and its stored ``/v1/responses``.
  ``deleted_turns`` counts the stored and the queued turns; 404 when there was nothing (another key's session of
  that name is not reachable: it answers as a missing one).
- ``POST /admin/feedback`` (admin key; the console's): the same body, on any owner's records, any plain
  source, no rate limit; each reward belongs to the owner of what it rewards.
- Admin (``Authorization: Bearer <admin key>``; disabled without ``--admin-key``):
  ``GET /admin/stats``, ``GET /admin/trajectories?limit=&since=&rewarded=&owner=``,
  ``GET /admin/trajectories/{id}``, ``DELETE /admin/sessions/{key}?owner=`` (complete deletion of one
  owner's session; 409 ``ambiguous_owner`` when several owners have that session name and none is named).

Store calls run in worker threads (SQLite is blocking). Ids that are still in the recorder's queue are
flushed first, so feedback sent right after a response never sees a spurious 404. :func:`prune_forever` is the
retention loop (``--retention-days``) the app runs in the background.

Not here: how turns are written (``runtime/recorder.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from learner.records import PUBLIC_OWNER, RESERVED_SOURCES, Reward, TooManyRewards, UnknownTarget
from runtime.api.openai_schemas import FeedbackRequest
from runtime.errors import APIError, from_validation
from runtime.http_body import read_json
from runtime.identity import check_admin_key, owner_of
from runtime.memory_credit import CREDIT_PREFIX, after_rewards
from runtime.recorder import Recorder
from runtime.services import services

log = logging.getLogger(__name__)
router = APIRouter()


async def prune_forever(recorder: Recorder, days: float, every_s: float = 3600) -> None:
    while True:
        cutoff = time.time() - days * 86400
        try:
            removed = await recorder.call(recorder.store.prune, cutoff)
            log.info("retention: pruned %d unrewarded turns older than %.1f days", removed, days)
        except Exception:  # a failed prune is retried next round; serving goes on
            log.exception("retention prune failed")
        await asyncio.sleep(every_s)


SOURCE = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
CLIENT_RESERVED = tuple(dict.fromkeys((*RESERVED_SOURCES, CREDIT_PREFIX)))  # memory:<source>: a rewrite's credit (the runtime's)


def check_source(source: str, *, reserved_ok: bool = False) -> None:
    """A feedback ``source`` is a plain name, and not one the runtime's evaluators own (case-insensitively; the admin may)."""
    if not SOURCE.match(source):
        raise APIError(400, "source must be 1-200 characters of letters, digits and _ . : -", param="source", code="invalid_value")
    if not reserved_ok and source.lower().startswith(CLIENT_RESERVED):
        raise APIError(
            403,
            f"reward sources starting with {' or '.join(CLIENT_RESERVED)} are reserved for the runtime's own evaluators and memory credit",
            type="permission_error",
            param="source",
            code="reserved_source",
        )


def check_rewards(fb: FeedbackRequest, max_abs: float) -> None:
    if fb.reward is not None and not abs(fb.reward) <= max_abs:
        raise APIError(400, f"reward must be a finite number in [-{max_abs:g}, {max_abs:g}]", param="reward", code="invalid_value")
    for tid, value in (fb.turn_rewards or {}).items():
        if not abs(value) <= max_abs:
            raise APIError(
                400, f"turn_rewards[{tid!r}] must be a finite number in [-{max_abs:g}, {max_abs:g}]", param="turn_rewards", code="invalid_value"
            )


def _need_recorder(request: Request) -> Recorder:
    recorder = services(request).recorder
    if recorder is None:
        raise APIError(409, "recording is off on this server (started with --no-record)", code="recording_disabled")
    return recorder


def _check_admin(request: Request) -> Recorder:
    check_admin_key(request, services(request).admin_key)
    return _need_recorder(request)


async def _exists(rec: Recorder, kind: str, some_id: str, owner: str | None) -> bool:
    if rec.is_pending(some_id):
        await rec.flush()
    if kind == "turn":
        return await rec.call(rec.store.turn_exists, some_id, owner)
    return await rec.call(rec.store.trajectory_exists, some_id, owner)


@router.post("/v1/feedback")
async def feedback(request: Request) -> dict[str, Any]:
    return await _feedback(request, admin=False)


@router.post("/admin/feedback")
async def admin_feedback(request: Request) -> dict[str, Any]:
    """The admin's feedback (the console's): any owner's turns and trajectories, any plain source, no rate limit;
    each reward belongs to the owner of what it rewards."""
    check_admin_key(request, services(request).admin_key)
    return await _feedback(request, admin=True)


async def _feedback(request: Request, *, admin: bool) -> dict[str, Any]:
    rec = _need_recorder(request)
    settings = services(request).feedback
    owner: str | None = None if admin else owner_of(request)  # None: any owner's records (the admin)
    wait = services(request).feedback_limiter.take(owner) if owner is not None else None
    if wait is not None:
        raise APIError(
            429,
            f"too much feedback from this key: at most {settings.per_minute} requests a minute",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(max(1, math.ceil(wait)))},
        )
    body = await read_json(request)
    try:
        fb = FeedbackRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None
    check_source(fb.source, reserved_ok=admin)
    check_rewards(fb, settings.max_abs_reward)
    targets = await _targets(rec, fb, owner)
    stored, duplicate = [], False
    fresh: list[Reward] = []
    for kind, target_id, value, key in targets:
        by = owner if owner is not None else await rec.call(rec.store.record_owner, kind, target_id)
        if admin and key is not None:  # stored as the tenant's reward: the admin's key must not collide with the tenant's own
            key = "admin:" + key
        reward = Reward(
            target=kind,
            target_id=target_id,
            value=value,
            source=fb.source,
            comment=fb.comment,
            idempotency_key=key,
            owner=by or PUBLIC_OWNER,
        )
        try:
            saved, created = await rec.call(rec.store.add_reward, reward, settings.max_per_target)
        except UnknownTarget as exc:  # deleted meanwhile
            raise APIError(404, f"unknown {kind} id {target_id!r}", code="not_found") from exc
        except TooManyRewards as exc:  # each stored reward is read by the learner: a key cannot pile them up without bound
            raise APIError(409, f"{exc}; the newest of a source is the one the learner uses", code="too_many_rewards") from exc
        duplicate = duplicate or not created
        if created:
            fresh.append(saved)
        stored.append({"reward_id": saved.reward_id, "target": saved.target, "target_id": saved.target_id, "value": saved.value})
    await after_rewards(rec, fresh)  # a run that read a copilot's memory credits the rewrite that wrote it
    return {"object": "feedback", "rewards": stored, "duplicate": duplicate}


async def _targets(rec: Recorder, fb: FeedbackRequest, owner: str | None) -> list[tuple[str, str, float, str | None]]:
    """What ``fb`` rewards: (kind, id, value, idempotency key) each; a 404 for an id ``owner`` cannot reach."""
    targets: list[tuple[str, str, float, str | None]] = []
    # another owner's id answers exactly like an unknown one: existence never leaks across keys
    if fb.trajectory_id is not None:
        if not await _exists(rec, "trajectory", fb.trajectory_id, owner):
            raise APIError(404, f"unknown trajectory_id {fb.trajectory_id!r}", param="trajectory_id", code="not_found")
        targets.append(("trajectory", fb.trajectory_id, fb.reward, fb.idempotency_key))  # type: ignore[arg-type]
    elif fb.turn_id is not None:
        if not await _exists(rec, "turn", fb.turn_id, owner):
            raise APIError(404, f"unknown turn_id {fb.turn_id!r}", param="turn_id", code="not_found")
        targets.append(("turn", fb.turn_id, fb.reward, fb.idempotency_key))  # type: ignore[arg-type]
    elif fb.completion_id is not None:
        if rec.is_pending(fb.completion_id):
            await rec.flush()
        turn_ids = await rec.call(rec.store.turns_for_completion, fb.completion_id, owner, fb.choice_index)
        if not turn_ids and fb.choice_index is not None:
            others: list[str] = await rec.call(rec.store.turns_for_completion, fb.completion_id, owner)
            if others:
                raise APIError(404, f"completion {fb.completion_id!r} has no choice {fb.choice_index}", param="choice_index", code="not_found")
        if not turn_ids:
            raise APIError(404, f"unknown completion_id {fb.completion_id!r}", param="completion_id", code="not_found")
        for tid in turn_ids:
            key = f"{fb.idempotency_key}:{tid}" if fb.idempotency_key and len(turn_ids) > 1 else fb.idempotency_key
            targets.append(("turn", tid, fb.reward, key))  # type: ignore[arg-type]
    for tid, value in (fb.turn_rewards or {}).items():
        if not await _exists(rec, "turn", tid, owner):
            raise APIError(404, f"unknown turn_id {tid!r} in turn_rewards", param="turn_rewards", code="not_found")
        targets.append(("turn", tid, value, f"{fb.idempotency_key}:turn:{tid}" if fb.idempotency_key else None))
    return targets


@router.delete("/v1/sessions/{key}")
async def delete_own_session(request: Request, key: str) -> dict[str, Any]:
    """The caller deletes one of its own sessions completely (another key's session of that name is not reachable)."""
    owner = owner_of(request)
    rec = services(request).recorder
    if rec is None:  # --no-record keeps no turns, but the Responses API still stores the session's responses
        services(request).router.forget_session(owner, key)
        deleted, responses_deleted = 0, await asyncio.to_thread(services(request).responses.delete_session, owner, key)
    else:
        deleted, responses_deleted = await _delete_session(request, rec, owner, key)
    if deleted == 0 and responses_deleted == 0:
        raise APIError(404, f"no session {key!r}", param="key", code="not_found")
    return {"object": "session.deleted", "session": key, "deleted_turns": deleted, "deleted_responses": responses_deleted}


async def _delete_session(request: Request, rec: Recorder, owner: str, key: str) -> tuple[int, int]:
    """Delete ``owner``'s session ``key`` everywhere it is held; (turns, stored responses) deleted.

    The order matters (see ``runtime/recorder.py``): the tombstone first, so that no turn of the session taken
    before it is written from now on (nor a stored response of its turns); then the flush, after which the writer
    holds none it took before; then the journal, the store and the stored responses."""
    responses = services(request).responses
    services(request).router.forget_session(owner, key)  # a new session of this name starts on the alias's version
    tomb = rec.tombstone(owner, key)
    # a response still on its way (its request generating, or just recorded) is not stored
    await rec.call(responses.forbid, tomb.in_flight | tomb.recent)
    await rec.flush()
    purged = await rec.call(rec.purge_journal, owner, key)
    stored = await rec.call(rec.store.delete_session, owner, key)
    gone = await rec.call(responses.delete_session, owner, key)
    return stored + purged + tomb.dropped, gone


@router.get("/admin/stats")
async def admin_stats(request: Request) -> dict[str, Any]:
    rec = _check_admin(request)
    counts = await rec.call(rec.store.stats)
    return {**counts, "queued": rec.queued(), "durability": rec.durability}


@router.get("/admin/trajectories")
async def admin_trajectories(
    request: Request, limit: int = 50, since: float | None = None, rewarded: bool | None = None, owner: str | None = None
) -> dict[str, Any]:
    rec = _check_admin(request)
    if not 1 <= limit <= 1000:
        raise APIError(400, "limit must be between 1 and 1000", param="limit", code="invalid_value")
    await rec.flush()
    rows = await rec.call(rec.store.list_trajectories, limit, since, rewarded, owner)
    return {"object": "list", "data": rows}


@router.get("/admin/trajectories/{trajectory_id}")
async def admin_trajectory(request: Request, trajectory_id: str) -> dict[str, Any]:
    rec = _check_admin(request)
    if rec.is_pending(trajectory_id):
        await rec.flush()
    traj = await rec.call(rec.store.get_trajectory, trajectory_id)
    if traj is None:
        raise APIError(404, f"unknown trajectory_id {trajectory_id!r}", param="trajectory_id", code="not_found")
    return traj.model_dump()


@router.delete("/admin/sessions/{key}")
async def admin_delete_session(request: Request, key: str, owner: str | None = None) -> dict[str, Any]:
    """Delete one owner's session ``key``; ``?owner=`` names the owner, needed when several owners have a session of that name."""
    rec = _check_admin(request)
    if owner is None:
        await rec.flush()
        owners = await rec.call(rec.store.session_owners, key)
        if len(owners) > 1:
            raise APIError(
                409,
                f"{len(owners)} owners have a session named {key!r} ({', '.join(owners)}); name one with ?owner=",
                param="owner",
                code="ambiguous_owner",
            )
        owner = owners[0] if owners else PUBLIC_OWNER
    deleted, responses_deleted = await _delete_session(request, rec, owner, key)
    return {"object": "session.deleted", "session": key, "owner": owner, "deleted_turns": deleted, "deleted_responses": responses_deleted}
