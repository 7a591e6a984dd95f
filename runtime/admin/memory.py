"""HTTP surface of agent memory: read and delete memory documents, over a small backend protocol.

The runtime never imports ``memory/``: ``serve.py`` hands ``create_app`` a ``runtime.services.MemoryBackend``
(``memory.store.MemoryStore``, or ``memory.store_pg.PostgresMemoryStore`` with ``--store postgresql://``, where
every runtime serves the same documents) and these routes call it in worker threads.

- ``GET /v1/memory`` (API key): the caller's documents (owner, scope, version, chars, updated_at).
- ``GET /v1/memory/{scope}``: the caller's document: current ``text``, ``version`` and every kept
  version's metadata (provenance: method, copilot adapter, player and copilot trajectory/turn ids).
- ``DELETE /v1/memory/{scope}``: deletes every version, and every recorded run whose prompt held the
  memory (player runs tagged ``memory_scope`` and the copilot's own rewrites), so no copy is left in
  ``interactions.db`` either; a later GET is 404.
- Admin (``Authorization: Bearer <admin key>``): ``GET /admin/memory?owner=`` lists everyone's (or one
  owner's) documents; ``GET`` / ``DELETE /admin/memory/{owner}/{scope}`` reach any document. The admin
  key is not an API key, so the ``/v1/memory`` routes only ever reach the caller's own documents.

The caller's owner identity comes from its key (``runtime/identity.py``); every lookup is by (owner,
scope), so a scope that is unknown and one that belongs to someone else answer the same 404 (existence
never leaks). A malformed scope is a 400. Without a key on a server with keys, the app's middleware
answers 401 before these routes run.

Not here: storage (``memory/store.py``), writing memory (``memory/copilot.py``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi import APIRouter, Request

from runtime.errors import APIError
from runtime.identity import check_admin_key, owner_of
from runtime.services import services

OWNER = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
router = APIRouter()


def _valid(scope: str) -> bool:
    """``user:<id>`` | ``session:<id>`` | ``agent:<name>``, id 1-200 characters without ``/``, spaces or control characters."""
    kind, sep, ident = scope.partition(":")
    if not sep or kind not in ("user", "session", "agent") or not 0 < len(ident) <= 200:
        return False
    return not any(c.isspace() or c == "/" or ord(c) < 32 or ord(c) == 127 for c in ident)


def _owner_for(request: Request, owner: str | None) -> str:
    """The owner whose documents a ``/v1`` request reaches: always its own (the admin uses ``/admin/memory``)."""
    own = owner_of(request)
    if owner is not None and owner != own:
        raise APIError(
            403, "a key reaches only its own memory; the admin API (/admin/memory) reaches others'", param="owner", code="permission_denied",
            type="permission_error",
        )  # fmt: skip
    return own


def _check_scope(scope: str) -> None:
    if not _valid(scope):
        raise APIError(
            400,
            f"invalid memory scope {scope!r}: use user:<id>, session:<id> or agent:<name> (id: 1-200 characters, no '/' or spaces)",
            param="scope",
            code="invalid_value",
        )


def _not_found(scope: str) -> APIError:
    return APIError(404, f"no memory {scope!r}", param="scope", code="memory_not_found")


def _check_owner(owner: str) -> None:
    if not OWNER.match(owner):
        raise APIError(400, f"invalid owner {owner!r}", param="owner", code="invalid_value")


async def _get_doc(request: Request, owner: str, scope: str) -> dict[str, Any]:
    memory = services(request).memory
    _check_owner(owner)
    _check_scope(scope)
    doc = await asyncio.to_thread(memory.document, owner, scope) if memory is not None else None
    if doc is None:
        raise _not_found(scope)
    return doc


async def _delete_doc(request: Request, owner: str, scope: str) -> dict[str, Any]:
    memory, recorder = services(request).memory, services(request).recorder
    _check_owner(owner)
    _check_scope(scope)
    n = await asyncio.to_thread(memory.delete, owner, scope) if memory is not None else 0
    if n == 0:
        raise _not_found(scope)
    runs = 0
    if recorder is not None:  # the recorded prompts that held it (and the copilot's rewrites of it) go too
        await recorder.flush()
        ids = await recorder.call(recorder.store.trajectories_with_meta, owner, "memory_scope", scope)
        runs = await recorder.call(recorder.store.delete_trajectories, ids) if ids else 0
    return {"object": "memory.deleted", "scope": scope, "owner": owner, "deleted_versions": n, "deleted_turns": runs}


async def _list_docs(request: Request, owner: str | None) -> dict[str, Any]:
    memory = services(request).memory
    if owner is not None:
        _check_owner(owner)
    data = await asyncio.to_thread(memory.documents, owner) if memory is not None else []
    return {"object": "list", "data": data}


@router.get("/v1/memory")
async def list_memory(request: Request, owner: str | None = None) -> dict[str, Any]:
    return await _list_docs(request, _owner_for(request, owner))


@router.get("/v1/memory/{scope}")
async def get_memory(scope: str, request: Request, owner: str | None = None) -> dict[str, Any]:
    return await _get_doc(request, _owner_for(request, owner), scope)


@router.delete("/v1/memory/{scope}")
async def delete_memory(scope: str, request: Request, owner: str | None = None) -> dict[str, Any]:
    return await _delete_doc(request, _owner_for(request, owner), scope)


@router.get("/admin/memory")
async def admin_list_memory(request: Request, owner: str | None = None) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    return await _list_docs(request, owner)


@router.get("/admin/memory/{owner}/{scope}")
async def admin_get_memory(owner: str, scope: str, request: Request) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    return await _get_doc(request, owner, scope)


@router.delete("/admin/memory/{owner}/{scope}")
async def admin_delete_memory(owner: str, scope: str, request: Request) -> dict[str, Any]:
    check_admin_key(request, services(request).admin_key)
    return await _delete_doc(request, owner, scope)
