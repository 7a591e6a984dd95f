"""Admin-only generation for the learner: siblings of a recorded chat turn, and unrecorded chat completions (judges).

- ``POST /admin/turns/{turn_id}/siblings`` ``{"n", "model"?, "seed"?, "record"?, "temperature"?, "max_tokens"?}``
  (:class:`SiblingsRequest`; a bad field is a 400 naming it): ``n`` new completions sampled from the
  turn's exact recorded context token ids (no re-templating, no re-tokenizing) with its recorded sampling
  (temperature, top_p, max new tokens, stop strings, decoding grammar) by ``model`` (base name, alias or
  ``family@N``; default the base model). Each is recorded as a one-turn trajectory owned by ``admin`` with the
  original's messages (so it joins the original's group) and meta ``rerollout`` / ``branch_of`` /
  ``branch_turn``, which keeps it out of the live sample stream (``learner.samples``): the learner update that
  asked for it trains on it (group completion, ``learner/group_completion.py``). Answers
  ``{"data": [{"trajectory_id", "turn_id", "text", "output_ids", "logprobs"}]}`` (``logprobs``: the engine's
  sampling logprob of each output token, a final stop token left out); 404 for an unknown turn, 409 when
  recording is off. ``"record": false`` records nothing (no ids in the answer): the learner's logprob parity
  probe (``learner/parity.py``) decodes from recorded contexts that way, greedily (``"temperature": 0``), at a
  turn's recorded temperature with a ``seed``, and under a constrained turn's recorded grammar, and compares
  the ``logprobs`` with its own; ``temperature`` and ``max_tokens`` replace the recorded ones.
- ``POST /admin/chat/completions``: a chat completion (the ``/v1`` body) that is not recorded, for the learner's
  LLM judge (any model or adapter the runtime serves) and other admin work that must never become training data.

Both are the admin's: replays of recorded contexts are for the learner and admins only (no client reads another owner's recorded context).

Not here: the generation path itself (``runtime/generation.py``, ``runtime/serving.py``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.api.chat import completion_body, to_internal
from runtime.api.openai_schemas import ChatCompletionRequest
from runtime.engine import EngineError, Grammar
from runtime.errors import APIError, from_engine, from_validation
from runtime.gen_request import GenRequest
from runtime.http_body import read_json
from runtime.identity import ADMIN_OWNER, check_admin_key, set_owner
from runtime.services import services

MAX_SIBLINGS = 16
SESSION = "rerollouts"  # the admin's session the siblings are recorded in
router = APIRouter()


class SiblingsRequest(BaseModel):
    """``POST /admin/turns/{turn_id}/siblings``'s body. Strict: JSON's own types only (no ``"2"`` for 2, no ``true`` for 1);
    other keys are ignored. A bad field is a 400 ``invalid_value`` naming it (``runtime.errors.from_validation``)."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    n: int = Field(1, ge=1, le=MAX_SIBLINGS, description="completions to sample from the turn's recorded context")
    model: str | None = Field(None, description="base model name, alias or family@N that samples them; default the base model")
    seed: int | None = Field(None, ge=0, lt=2**62, description="sampling seed")
    record: bool = Field(True, description="record each as a one-turn trajectory of the original's group; false records nothing")
    temperature: float | None = Field(None, ge=0, le=2, description="replaces the turn's recorded temperature")
    max_tokens: int | None = Field(None, ge=1, le=4096, description="replaces the turn's recorded max new tokens")


@router.post("/admin/turns/{turn_id}/siblings")
async def siblings(turn_id: str, request: Request) -> dict[str, Any]:
    s = services(request)
    gateway, recorder = s.gateway, s.recorder
    check_admin_key(request, s.admin_key)
    if recorder is None:
        raise APIError(409, "recording is off on this server (started with --no-record)", code="recording_disabled")
    try:
        body = SiblingsRequest.model_validate(await read_json(request, s.max_body))
    except ValidationError as exc:
        raise from_validation(exc) from None
    if recorder.is_pending(turn_id):
        await recorder.flush()
    turn = await recorder.call(recorder.store.get_turn, turn_id)
    if turn is None:
        raise APIError(404, f"unknown turn_id {turn_id!r}", param="turn_id", code="not_found")
    svc = (gateway if body.record else s.unrecorded)._generation()
    sp = turn.sampling
    req = GenRequest(
        model=body.model or svc.model_id,
        messages=[],
        api="admin.siblings",
        n=body.n,
        temperature=float(sp.get("temperature", 1.0) if body.temperature is None else body.temperature),
        top_p=float(sp.get("top_p", 1.0)),
        max_tokens=body.max_tokens or int(sp.get("max_new_tokens") or svc.default_max_tokens),
        stop=tuple(sp.get("stop") or ()),
        seed=body.seed,
        logprobs=True,
        prompt_ids=tuple(turn.context_ids),
        prompt_text="",
    )
    set_owner(request.scope, ADMIN_OWNER)
    t0 = time.perf_counter()
    lease = gateway._acquire(req.model, SESSION, None, ADMIN_OWNER)
    try:
        prep = svc.prepare(req, request.state.request_id, SESSION, adapter=lease.name if lease else None, id_prefix="sibl-", owner=ADMIN_OWNER)
        prep.messages = list(turn.messages)  # recorded with the original's messages: same prefix key, same group
        g = sp.get("grammar")
        if isinstance(g, dict) and g.get("kind") in ("json_schema", "json_object", "ebnf"):
            grammar = Grammar(kind=g["kind"], spec=str(g.get("spec") or ""))
            prep.engine_reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, grammar=grammar)) for r in prep.engine_reqs]
            await gateway._compile_grammar(prep, ADMIN_OWNER, svc)
        choices = await svc.complete(prep)
    except EngineError as exc:
        raise from_engine(exc) from exc
    finally:
        if "prep" in locals():
            svc.settle(prep)
        gateway._release(lease, lease.name if lease else None, t0, 0)
    data = [{"text": c.text, "output_ids": list(c.output_ids), "logprobs": [lp["logprob"] for lp in c.logprobs or []]} for c in choices]
    if prep.slots is not None:
        await recorder.flush()
        meta = {"rerollout": True, "branch_of": turn.trajectory_id, "branch_turn": turn_id, "kind": "group_completion"}
        for slot, d in zip(prep.slots, data, strict=True):
            await recorder.call(recorder.store.set_trajectory_meta, slot.trajectory_id, meta)
            d.update(trajectory_id=slot.trajectory_id, turn_id=slot.turn_id)
    return {"object": "list", "data": data}


@router.post("/admin/chat/completions")
async def admin_chat(request: Request) -> Response:
    s = services(request)
    check_admin_key(request, s.admin_key)
    body = await read_json(request, s.max_body)
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None
    if req.stream:
        raise APIError(400, "the admin's chat completions are not streamed", param="stream", code="invalid_value")
    set_owner(request.scope, ADMIN_OWNER)
    out = await s.unrecorded.run(request, to_internal(req), stream=False, id_prefix="chatcmpl-")
    if out is None:
        return Response(status_code=499)
    return JSONResponse(completion_body(out))
