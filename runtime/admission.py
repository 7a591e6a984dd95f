"""Admission: what one API key may ask of the server, and where its request's CPU-heavy preparation runs.

- :class:`RateLimiter`: a token bucket per owner (``per_minute`` requests, a burst of as many); over the
  budget a request is refused with the seconds until the next token, which the route answers as 429 with
  ``Retry-After``. Used for ``POST /v1/feedback``.
- :class:`KeyQuota`: per-owner concurrency and queue quotas counted in choices (``n``): generation
  requests and agent runs take slots for as long as they run (a stream until it ends).
- :class:`runtime.throttle.Throttle` (held as ``Admission.throttle``): keys whose requests are mostly refused get
  one request in flight and ``n`` = 1 for a while.
- :class:`Offload`: templating, tokenizing (``ChatService.prepare``) and grammar compilation run on small
  dedicated thread pools with a deadline, never on the event loop; so does every other request-dependent
  step that can take long.

Owners are the identities of ``runtime/identity.py``; the per-owner state is bounded (the least recently
seen owners are forgotten, which only ever gives them a fresh budget).

Not here: the engines' own queue limits (``--max-queue``), body size limits (``runtime/http_body.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runtime.errors import APIError
from runtime.throttle import Throttle

T = TypeVar("T")

MAX_OWNERS = 100_000  # per-owner state kept at most (least recently seen first out)


class RateLimiter:
    """``per_minute`` requests per owner, refilled continuously, with a burst of ``per_minute``; 0 = no limit."""

    def __init__(self, per_minute: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # owner -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, owner: str) -> float | None:
        """Spend one request of ``owner``'s budget: None if allowed, else the seconds until one is available."""
        if self.per_minute <= 0:
            return None
        rate = self.per_minute / 60.0
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.pop(owner, (float(self.per_minute), now))
            tokens = min(float(self.per_minute), tokens + (now - at) * rate)
            allowed = tokens >= 1.0
            self._buckets[owner] = (tokens - 1.0 if allowed else tokens, now)
            while len(self._buckets) > MAX_OWNERS:
                self._buckets.popitem(last=False)
        return None if allowed else (1.0 - tokens) / rate


class QuotaExceeded(Exception):
    """A key asked for more than its quota allows: ``status`` 429 (busy: retry) or 400 (can never fit)."""

    def __init__(self, message: str, *, status: int = 429, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class _Use:
    running: int = 0
    queued: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class KeyQuota:
    """Per-owner concurrency: at most ``max_running`` sequences generating and ``max_queued`` waiting, counted in
    choices (a request with ``n = 4`` takes four). Beyond the queue a request is refused at once (429); a
    request with more choices than ``max_running`` can never run (400). Waiting is FIFO-fair only loosely (the
    first waiter that fits goes); a cancelled waiter leaves the queue. Used on the event loop only."""

    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running, self.max_queued = max_running, max_queued
        self._use: dict[str, _Use] = {}

    async def acquire(self, owner: str, n: int = 1) -> Callable[[], None]:
        """Take ``n`` slots of ``owner`` (waiting in its queue if needed); returns the function that gives them back."""
        if n > self.max_running:
            raise QuotaExceeded(f"n = {n} is more than this key may run at once ({self.max_running})", status=400, param="n")
        use = self._use.setdefault(owner, _Use())
        if use.running + n > self.max_running:
            if use.queued + n > self.max_queued:
                self._forget(owner)
                raise QuotaExceeded(
                    f"this key already has {use.running} choices running and {use.queued} queued "
                    f"(at most {self.max_running} and {self.max_queued}); retry shortly"
                )
            use.queued += n
            try:
                while use.running + n > self.max_running:
                    use.changed.clear()
                    await use.changed.wait()
            finally:
                use.queued -= n
        use.running += n
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                use.running -= n
                use.changed.set()
                self._forget(owner)

        return release

    def _forget(self, owner: str) -> None:
        use = self._use.get(owner)
        if use is not None and use.running == 0 and use.queued == 0:
            del self._use[owner]

    def running(self, owner: str) -> int:
        return self._use[owner].running if owner in self._use else 0

    def queued(self, owner: str) -> int:
        return self._use[owner].queued if owner in self._use else 0

    def owners(self) -> int:
        return len(self._use)


def _lower_priority() -> None:
    """Run this worker thread at nice 10 (Linux nices threads one by one): a request's preparation yields the CPU to
    the engine's decode thread, so one client's grammar bomb slows its own answer, not everyone's tokens."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: the deadline still bounds the work
        pass


class Offload:
    """Request-dependent CPU work off the event loop, each kind on its own small thread pool, with a deadline.

    A deadline that passes fails the request (``asyncio.TimeoutError``); the worker thread cannot be
    interrupted, so it finishes in the background while its pool's other threads (and the loop) go on. The
    pools are small on purpose: a flood of heavy requests queues behind them instead of taking every core."""

    def __init__(self, prepare_threads: int = 2, grammar_threads: int = 1) -> None:
        self._prepare = ThreadPoolExecutor(max_workers=prepare_threads, thread_name_prefix="loopwise-prepare", initializer=_lower_priority)
        self._grammar = ThreadPoolExecutor(max_workers=grammar_threads, thread_name_prefix="loopwise-grammar", initializer=_lower_priority)

    async def prepare(self, timeout_s: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await self._run(self._prepare, timeout_s, fn, *args, **kwargs)

    async def grammar(self, timeout_s: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await self._run(self._grammar, timeout_s, fn, *args, **kwargs)

    @staticmethod
    async def _run(pool: ThreadPoolExecutor, timeout_s: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        fut = loop.run_in_executor(pool, lambda: ctx.run(fn, *args, **kwargs))
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s)

    def close(self) -> None:
        self._prepare.shutdown(wait=False, cancel_futures=True)
        self._grammar.shutdown(wait=False, cancel_futures=True)


MAX_CHARS_PER_TOKEN = 64  # no tokenizer packs more characters into one token: longer prompts cannot fit


def prompt_chars(messages: Any, tools: Any = None) -> int:
    """Characters a chat request asks to template (message text, tool-call arguments, tool schemas), cheaply."""
    total = 0
    for m in messages or ():
        content = getattr(m, "content", None) if not isinstance(m, dict) else m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(getattr(p, "text", None) or (p.get("text", "") if isinstance(p, dict) else "")) for p in content)
        calls = getattr(m, "tool_calls", None) if not isinstance(m, dict) else m.get("tool_calls")
        for c in calls or ():
            fn = getattr(c, "function", None) or (c.get("function") if isinstance(c, dict) else None)
            args = getattr(fn, "arguments", None) if not isinstance(fn, dict) else fn.get("arguments")
            total += len(args) if isinstance(args, str) else len(repr(args)) if args else 0
    for t in tools or ():
        total += len(repr(getattr(getattr(t, "function", None), "parameters", t)))
    return total


class Admission:
    """The app's gate for generation requests (chat completions and agents): quota, size, preparation, grammar.

    Quotas apply per API key; the open server's ``public`` owner (everyone, no identity) and the admin API's
    own work (``admin``: the learner's runs) are bounded only by the engine's queue (``--max-queue``)."""

    def __init__(self, settings: Any, *, unlimited_owners: tuple[str, ...] = (), on_throttled: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.quota = KeyQuota(settings.max_running_per_key, settings.max_queued_per_key)
        self.throttle = Throttle(
            settings.throttle_refusals, settings.throttle_window_s, settings.throttle_penalty_s, exempt=unlimited_owners, on_refuse=on_throttled
        )
        self.offload = Offload()
        self._unlimited = frozenset(unlimited_owners)
        self._penalty: dict[str, float] = {}  # owner -> monotonic time its grammar penalty ends

    async def enter(self, owner: str, n: int = 1) -> Callable[[], None]:
        """Take ``n`` of ``owner``'s slots until the returned function is called (429 or 400 when it cannot)."""
        if owner in self._unlimited:
            return lambda: None
        self.throttle.check_choices(owner, n)
        try:
            return await self.quota.acquire(owner, n)
        except QuotaExceeded as exc:
            if exc.status == 400:
                raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
            raise APIError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None

    def check_size(self, messages: Any, tools: Any, max_model_len: int) -> None:
        """Refuse, before any templating, a prompt whose text could not fit the context even at the densest tokenization."""
        limit = max_model_len * MAX_CHARS_PER_TOKEN
        if (chars := prompt_chars(messages, tools)) > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your messages hold {chars} characters, "
                "more than could ever fit. Please reduce the length of the messages.",
                param="messages",
                code="context_length_exceeded",
            )

    async def prepare(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` (templating, tokenizing) on the preparation pool, within ``prepare_timeout_s``."""
        try:
            return await self.offload.prepare(self.settings.prepare_timeout_s, fn, *args, **kwargs)
        except TimeoutError:
            raise APIError(
                503, "the server could not prepare this request in time; retry later", type="server_error", code="prepare_timeout",
                headers={"Retry-After": "1"},
            ) from None  # fmt: skip

    async def compile_grammar(self, compile_fn: Callable[..., Any], grammar: Any, owner: str) -> Any:
        """``compile_fn(grammar, timeout_s=...)`` on the grammar pool: the engine kills a compilation at the deadline
        (``runtime/grammar_worker.py``), which is a 400; the key that sent it then waits ``grammar_penalty_s``
        before its next grammar (429), so a stream of grammar bombs costs one deadline of CPU per penalty."""
        timeout = self.settings.grammar_timeout_s
        until = self._penalty.get(owner, 0.0)
        if until > time.monotonic():
            raise APIError(
                429,
                "this key's last grammar took too long to compile; retry later",
                type="rate_limit_error",
                code="grammar_penalty",
                headers={"Retry-After": str(max(1, math.ceil(until - time.monotonic())))},
            )
        try:
            # the engine enforces the deadline itself; the outer bound only guards against a worker that never starts
            return await self.offload.grammar(timeout + 180.0, functools.partial(compile_fn, grammar, timeout_s=timeout))
        except TimeoutError:
            if owner not in self._unlimited:
                self._penalty[owner] = time.monotonic() + self.settings.grammar_penalty_s
                while len(self._penalty) > MAX_OWNERS:
                    self._penalty.pop(next(iter(self._penalty)))
            raise APIError(
                400,
                f"the response_format / tool_choice grammar did not compile within {timeout:g} s; simplify it",
                param="response_format",
                code="grammar_too_complex",
            ) from None

    def close(self) -> None:
        self.offload.close()
