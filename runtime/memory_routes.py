"""HTTP surface of agent memory: read and delete memory documents, over a small backend protocol.

The runtime never imports ``memory/``: ``serve.py`` hands ``create_app`` a :class:`MemoryBackend`
(``memory.store.MemoryStore``) and these routes call it in worker threads.

- ``GET /v1/memory`` (API key): the caller's documents (owner, scope, version, chars, updated_at).
- ``GET /v1/memory/{scope}``: the caller's document: current ``text``, ``version`` and every kept
  version's metadata (provenance: method, copilot adapter, player and copilot trajectory/turn ids).
- ``DELETE /v1/memory/{scope}``: deletes every version; a later GET is 404.
- Admin (``Authorization: Bearer <admin key>``): ``GET /admin/memory?owner=`` lists everyone's (or one
  owner's) documents; ``GET`` / ``DELETE /admin/memory/{owner}/{scope}`` reach any document. The admin
  key also works on the ``/v1/memory`` routes (the app accepts it wherever ``/v1`` needs an API key):
  ``GET /v1/memory`` lists everyone's documents, ``/v1/memory/{scope}`` reaches the owner that has the
  scope (409 ``ambiguous_owner`` when several do and none is the admin's own), ``?owner=`` names one.

The caller's owner identity comes from its key (``runtime/identity.py``); every lookup is by (owner,
scope), so a scope that is unknown and one that belongs to someone else answer the same 404 (existence
never leaks). A malformed scope is a 400. Without a key on a server with keys, the app's middleware
answers 401 before these routes run.

Not here: storage (``memory/store.py``), writing memory (``memory/copilot.py``).
"""

from __future__ import annotations

import asyncio
import hmac
import re
from typing import Any, Protocol

from fastapi import FastAPI, Request

from runtime.errors import APIError
from runtime.identity import bearer_token, owner_of
from runtime.store_routes import InternalKey, check_admin_key

OWNER = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class MemoryBackend(Protocol):
    def document(self, owner: str, scope: str) -> dict[str, Any] | None: ...
    def documents(self, owner: str | None) -> list[dict[str, Any]]: ...
    def delete(self, owner: str, scope: str) -> int: ...


def _valid(scope: str) -> bool:
    """``user:<id>`` | ``session:<id>`` | ``agent:<name>``, id 1-200 characters without ``/``, spaces or control characters."""
    kind, sep, ident = scope.partition(":")
    if not sep or kind not in ("user", "session", "agent") or not 0 < len(ident) <= 200:
        return False
    return not any(c.isspace() or c == "/" or ord(c) < 32 or ord(c) == 127 for c in ident)


def install_memory_routes(app: FastAPI, memory: MemoryBackend | None, admin_key: str | None) -> None:
    def is_admin(request: Request) -> bool:
        if not admin_key or isinstance(admin_key, InternalKey):
            return False
        return hmac.compare_digest(bearer_token(request).encode(), admin_key.encode())

    def owner_for(request: Request, owner: str | None) -> str:
        """The owner whose documents this request reaches: its own, or (admin only) the one it names."""
        if owner is None:
            return owner_of(request)
        if not is_admin(request):
            raise APIError(403, "only the admin key may name another owner", param="owner", code="permission_denied", type="permission_error")
        return owner

    def check_scope(scope: str) -> None:
        if not _valid(scope):
            raise APIError(
                400,
                f"invalid memory scope {scope!r}: use user:<id>, session:<id> or agent:<name> (id: 1-200 characters, no '/' or spaces)",
                param="scope",
                code="invalid_value",
            )

    def not_found(scope: str) -> APIError:
        return APIError(404, f"no memory {scope!r}", param="scope", code="memory_not_found")

    def check_owner(owner: str) -> None:
        if not OWNER.match(owner):
            raise APIError(400, f"invalid owner {owner!r}", param="owner", code="invalid_value")

    async def get_doc(owner: str, scope: str) -> dict[str, Any]:
        check_owner(owner)
        check_scope(scope)
        doc = await asyncio.to_thread(memory.document, owner, scope) if memory is not None else None
        if doc is None:
            raise not_found(scope)
        return doc

    async def delete_doc(owner: str, scope: str) -> dict[str, Any]:
        check_owner(owner)
        check_scope(scope)
        n = await asyncio.to_thread(memory.delete, owner, scope) if memory is not None else 0
        if n == 0:
            raise not_found(scope)
        return {"object": "memory.deleted", "scope": scope, "owner": owner, "deleted_versions": n}

    async def list_docs(owner: str | None) -> dict[str, Any]:
        if owner is not None:
            check_owner(owner)
        data = await asyncio.to_thread(memory.documents, owner) if memory is not None else []
        return {"object": "list", "data": data}

    @app.get("/v1/memory")
    async def list_memory(request: Request, owner: str | None = None) -> dict[str, Any]:
        if owner is None and is_admin(request):
            return await list_docs(None)
        return await list_docs(owner_for(request, owner))

    async def scope_owner(request: Request, owner: str | None, scope: str) -> str:
        """The owner a ``/v1/memory/{scope}`` request reaches. The admin key without ``?owner=`` reaches the one
        owner that has the scope (admin sees all); when several do, it must name one."""
        if owner is not None or not is_admin(request):
            return owner_for(request, owner)
        check_scope(scope)
        own = owner_of(request)
        docs = await asyncio.to_thread(memory.documents, None) if memory is not None else []
        owners = sorted({d["owner"] for d in docs if d["scope"] == scope})
        if len(owners) > 1 and own not in owners:
            raise APIError(
                409, f"{len(owners)} owners have {scope!r}: name one with ?owner= ({', '.join(owners[:10])})", param="owner", code="ambiguous_owner"
            )
        return own if own in owners or not owners else owners[0]

    @app.get("/v1/memory/{scope}")
    async def get_memory(scope: str, request: Request, owner: str | None = None) -> dict[str, Any]:
        return await get_doc(await scope_owner(request, owner, scope), scope)

    @app.delete("/v1/memory/{scope}")
    async def delete_memory(scope: str, request: Request, owner: str | None = None) -> dict[str, Any]:
        return await delete_doc(await scope_owner(request, owner, scope), scope)

    @app.get("/admin/memory")
    async def admin_list_memory(request: Request, owner: str | None = None) -> dict[str, Any]:
        check_admin_key(request, admin_key)
        return await list_docs(owner)

    @app.get("/admin/memory/{owner}/{scope}")
    async def admin_get_memory(owner: str, scope: str, request: Request) -> dict[str, Any]:
        check_admin_key(request, admin_key)
        return await get_doc(owner, scope)

    @app.delete("/admin/memory/{owner}/{scope}")
    async def admin_delete_memory(owner: str, scope: str, request: Request) -> dict[str, Any]:
        check_admin_key(request, admin_key)
        return await delete_doc(owner, scope)
