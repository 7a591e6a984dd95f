"""Who is calling: API-key checks, the owner identity of a request, and the caller of an agent run.

The runtime has no user accounts. A caller is identified by its Bearer token:

- :class:`KeyRing` holds the server's API keys and its admin key and checks a token against them in
  constant time (``hmac.compare_digest`` over SHA-256 digests, every key compared, so neither the
  position of a mismatch nor which key matched shows in the timing). API keys open ``/v1``; the admin
  key opens ``/admin`` and is *not* an API key (a leaked client config never carries admin rights, and
  the admin's own traffic never mixes with a tenant's).
- The *owner* of a ``/v1`` request is ``key-`` + the first 24 hex digits of its key's SHA-256 (the key
  itself is never stored or logged). On a server without API keys every caller is ``public``: tokens
  are not checked there, so they are no identity and nothing is private. The app's middleware puts the
  owner on the request (:func:`set_owner`) after checking the key; routes read it with :func:`owner_of`.
  Work done through the admin API (e.g. the learner's runs) is owned by :data:`ADMIN_OWNER`.
- Within an owner, the request's ``user`` field names the end user; it is the client's word, trusted
  only inside its own key. The *session* of a request (:func:`session_of`) is its ``X-Session-Id`` header,
  else that ``user`` field.
- The admin API checks the admin key with :func:`check_admin_key` (403 while it is disabled, 401 for a wrong
  key); an :class:`InternalKey` opens it for loopwise's own processes only.

Agent routes bind the :class:`Caller` of a run (owner + user) in a context variable for the run's
duration (:func:`bind_caller`), so served agents (e.g. the memory copilot) and the records they write
see who asked without the ``ServedAgent`` protocol changing; code running outside a request sees
:data:`PUBLIC_CALLER`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from learner.records import ADMIN_OWNER, PUBLIC_OWNER
from runtime.errors import APIError
from runtime.recorder import ANONYMOUS

__all__ = [
    "ADMIN_OWNER",
    "MAX_NAME",
    "PUBLIC_OWNER",
    "Caller",
    "InternalKey",
    "KeyRing",
    "bearer_token",
    "bind_caller",
    "check_admin_key",
    "current_caller",
    "owner_of",
    "owner_of_token",
    "session_of",
]

MAX_NAME = 256  # longest session name (``X-Session-Id``) or ``user`` field


@dataclass(frozen=True)
class Caller:
    owner: str  # "key-<hash>", "public" or "admin"
    user: str | None = None  # the request's ``user`` field


PUBLIC_CALLER = Caller(PUBLIC_OWNER)
_CALLER: ContextVar[Caller] = ContextVar("loopwise_caller", default=PUBLIC_CALLER)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class KeyRing:
    """The server's API keys and admin key; every comparison is constant-time."""

    def __init__(self, api_keys: Iterable[str], admin_key: str | None) -> None:
        self._api = [_digest(k) for k in api_keys if k]
        self._admin = _digest(admin_key) if admin_key else None

    @property
    def open(self) -> bool:
        """No API keys: ``/v1`` is open to everyone (all as owner ``public``)."""
        return not self._api

    def is_api_key(self, token: str) -> bool:
        d = _digest(token)
        ok = False
        for k in self._api:  # no early exit: the time does not depend on which key matches
            ok |= hmac.compare_digest(d, k)
        return ok

    def is_admin_key(self, token: str) -> bool:
        return self._admin is not None and hmac.compare_digest(_digest(token), self._admin)


def bearer_token(request: Request) -> str:
    """The API key: ``Authorization: Bearer <key>``, else ``X-Api-Key`` (how Anthropic's SDK sends it)."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("x-api-key", "").strip()


class InternalKey(str):
    """An admin key only loopwise's own processes hold (the learner, when no ``--admin-key`` was given):
    it opens the admin API for them, while to everyone else the admin API still answers as disabled."""


def check_admin_key(request: Request, admin_key: str | None) -> None:
    disabled = APIError(403, "the admin API is disabled; start the server with --admin-key", type="permission_error", code="admin_disabled")
    if not admin_key:
        raise disabled
    ok = KeyRing((), admin_key).is_admin_key(bearer_token(request))  # constant time, whatever the token's length
    if not ok and isinstance(admin_key, InternalKey):
        raise disabled
    if not ok:
        raise APIError(
            401, "a valid admin key is required (Authorization: Bearer <admin key>)", type="authentication_error", code="invalid_admin_key"
        )


def session_of(request: Request, user: Any) -> str:
    """The session key: ``X-Session-Id`` header, else the ``user`` field, else ``ANONYMOUS`` (no session: an A/B
    experiment then assigns each such request an arm on its own, see ``runtime/adapters/routing.py``).

    Both are the client's names, bounded to ``MAX_NAME`` characters (400 beyond: they are stored with every turn)."""
    header = request.headers.get("x-session-id")
    if header is not None and len(header) > MAX_NAME:
        raise APIError(400, f"the X-Session-Id header is longer than {MAX_NAME} characters", code="invalid_value")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_NAME):
        raise APIError(400, f"user must be a string of at most {MAX_NAME} characters", param="user", code="invalid_value")
    return header or user or ANONYMOUS


def owner_of_token(token: str) -> str:
    return f"key-{hashlib.sha256(token.encode('utf-8', 'surrogatepass')).hexdigest()[:24]}" if token else PUBLIC_OWNER


def set_owner(scope: Any, owner: str) -> None:
    """Record the checked owner of a request in its ASGI scope (the app's middleware does this)."""
    scope.setdefault("state", {})["owner"] = owner


def owner_of(request: Request) -> str:
    """The owner identity of ``request``, as the middleware checked it; ``public`` when nothing was checked."""
    state = request.scope.get("state") or {}
    owner = state.get("owner")
    return owner if isinstance(owner, str) and owner else PUBLIC_OWNER


def current_caller() -> Caller:
    """The caller bound by :func:`bind_caller` in this context, else :data:`PUBLIC_CALLER`."""
    return _CALLER.get()


@contextmanager
def use_caller(caller: Caller) -> Iterator[Caller]:
    """``caller`` is :func:`current_caller` inside the block (and in tasks created there)."""
    token = _CALLER.set(caller)
    try:
        yield caller
    finally:
        _CALLER.reset(token)


def bind_caller(request: Request, user: Any, owner: str | None = None) -> AbstractContextManager[Caller]:
    """The caller of ``request`` (its owner, or ``owner`` when given, and the ``user`` field when a non-empty string) for the block."""
    return use_caller(Caller(owner or owner_of(request), user if isinstance(user, str) and user else None))
