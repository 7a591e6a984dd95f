"""Settling asyncio futures from other threads (engine scheduler, recorder writer).

Call it through ``loop.call_soon_threadsafe(settle, fut, error)``; a future already settled (its
waiter was cancelled) is left alone.
"""

from __future__ import annotations

import asyncio


def settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
