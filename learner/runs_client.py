"""Many runs of one agent through a runtime's runs endpoint, concurrently: the learner's own rollouts.

``post_runs(base_url, key, agent, bodies)`` posts each body to ``POST /admin/agents/{agent}/runs`` (the
learner's runs are the admin's; ``admin=False`` uses ``/v1``) with at most ``concurrency`` in flight and
returns, per body in order, the run's JSON or an error string (a failed run never fails the others).
``transport`` replaces httpx's network transport (tests run an app in process).

Not here: what the runs are for (``learner/svr_rollouts.py``, ``learner/reves.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx

__all__ = ["RunOutcome", "post_runs", "post_runs_async"]

RunOutcome = dict[str, Any] | str  # the run's JSON, or why it failed


async def post_runs_async(
    base_url: str,
    api_key: str | None,
    agent: str,
    bodies: Sequence[dict[str, Any]],
    *,
    concurrency: int = 8,
    timeout_s: float = 900.0,
    admin: bool = True,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[RunOutcome]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max(1, concurrency))
    path = f"/{'admin' if admin else 'v1'}/agents/{agent}/runs"
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport) as client:

        async def one(body: dict[str, Any]) -> RunOutcome:
            async with sem:
                try:
                    r = await client.post(path, json=body)
                except httpx.HTTPError as exc:
                    return f"{type(exc).__name__}: {exc}"
            if r.status_code != 200:
                return f"{r.status_code}: {r.text[:300]}"
            out: dict[str, Any] = r.json()
            return out

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def post_runs(base_url: str, api_key: str | None, agent: str, bodies: Sequence[dict[str, Any]], **kw: Any) -> list[RunOutcome]:
    """:func:`post_runs_async` from synchronous code (the learner's loop)."""
    return asyncio.run(post_runs_async(base_url, api_key, agent, bodies, **kw))
