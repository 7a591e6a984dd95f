"""Who is calling: the owner identity derived from the request's API key, and the caller of an agent run.

The runtime has no user accounts. A caller is identified by its Bearer token: the *owner* is
``key-`` + the first 24 hex digits of the token's SHA-256 (the token itself is never stored or logged),
or ``public`` when the request carries none (an open server without ``--api-key``: everyone shares
that owner, so nothing is private there). Within an owner, the request's ``user`` field names the end
user; it is the client's word, trusted only inside its own key.

Agent routes bind the :class:`Caller` of a run (owner + user) in a context variable for the run's
duration (:func:`bind_caller`), so served agents (e.g. the memory copilot) see who asked without
the ``ServedAgent`` protocol changing; code running outside a request sees :data:`PUBLIC_CALLER`.

Not here: checking keys (``runtime/app.py`` does, before any ``/v1/`` route runs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from fastapi import Request

PUBLIC_OWNER = "public"


@dataclass(frozen=True)
class Caller:
    owner: str  # "key-<hash>" or "public"
    user: str | None = None  # the request's ``user`` field


PUBLIC_CALLER = Caller(PUBLIC_OWNER)
_CALLER: ContextVar[Caller] = ContextVar("loopwise_caller", default=PUBLIC_CALLER)


def bearer_token(request: Request) -> str:
    """The API key: ``Authorization: Bearer <key>``, else ``X-Api-Key`` (how Anthropic's SDK sends it)."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("x-api-key", "").strip()


def owner_of_token(token: str) -> str:
    return f"key-{hashlib.sha256(token.encode()).hexdigest()[:24]}" if token else PUBLIC_OWNER


def owner_of(request: Request) -> str:
    """The owner identity of ``request`` (see the module docstring)."""
    return owner_of_token(bearer_token(request))


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


def bind_caller(request: Request, user: Any) -> AbstractContextManager[Caller]:
    """The caller of ``request`` (its key's owner and the ``user`` field, when a non-empty string) for the block."""
    return use_caller(Caller(owner_of(request), user if isinstance(user, str) and user else None))
