"""Throttling API keys whose requests are mostly refused: probing or broken clients, found at the HTTP edge.

A request refused for what it is (malformed or oversized JSON, an invalid value, a forbidden reward source,
another key's ids: status 400, 403, 404, 413 or 422) costs the server little, but a key that sends little
else is probing the API or broken, and its valid requests in between (an ``n`` = 16 flood, say) are the ones
that cost everyone: on a CPU every batch row slows every other request's step. :class:`Throttle` counts each
key's requests and refusals over a sliding window (``window_s``, in twelve buckets); once at least
``refusals`` were refused there *and* they were at least half of the key's requests, the key is throttled
for ``penalty_s`` (renewed each time it crosses the line again). A throttled key:

- has at most one request in flight; more are answered 429 before their body is read, after a one-second
  tarpit (``TARPIT_S``; at most ``MAX_TARPIT`` of a key's requests wait at once, more are answered at once), so a
  client that retries in a loop sends one request a second per connection instead of thousands: each costs the
  event loop little, but thousands a second cost everyone (``enter``, called by the app's middleware);
- may not ask for ``n`` > 1 (:meth:`runtime.admission.Admission.enter` refuses it with 429);
- waits the same tarpit before each refusal of its one admitted request (:meth:`delay`): cheap refusals, one
  right after another through that one slot, would otherwise still cost the server a parse and a check each,
  as fast as it can make them (the soak's throttled key sent 350 a minute, more than when it was not throttled).

Its valid work still runs, one request at a time; the 429 names why and when it ends (``Retry-After``).

Not counted at all: 401 (no identity yet), 429 (the server's own limits, which a well-behaved client under
load meets too) and 5xx (the server's fault); counted as requests but not refusals: everything else (409,
a race between a key's own requests, included). Never throttled: owners in
``exempt`` (the open server's ``public`` owner, which is everyone, and the admin API's own work). What it
does not do: a key whose requests are all valid but heavy is not flagged; it gets its share of the engine
like any other key (``max_running_per_key``, the embedded engine's row share). Event-loop only (no locks).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from runtime.errors import APIError

log = logging.getLogger("loopwise.throttle")

REFUSED = frozenset({400, 403, 404, 413, 422})  # refused for what the request is; see the module docstring
BUCKETS = 12  # the window's resolution
MAX_OWNERS = 100_000  # per-owner state kept at most (least recently seen first out: a forgotten key starts afresh)
TARPIT_S = 1.0  # a throttled key's refused request waits this long before its 429
MAX_TARPIT = 64  # a key's refused requests waiting at once; more are answered at once


@dataclass
class _Owner:
    buckets: list[tuple[int, int, int]] = field(default_factory=list)  # (bucket index, requests, refusals), oldest first
    until: float = 0.0  # monotonic time the throttle ends (0: not throttled)
    inflight: int = 0
    tarpitted: int = 0


class Throttled(APIError):
    """The 429 of a throttled key; the middleware awaits :meth:`tarpit` before answering it."""

    def __init__(self, message: str, retry_after: int, owner: _Owner | None) -> None:
        super().__init__(429, message, type="rate_limit_error", code="key_throttled", headers={"Retry-After": str(retry_after)})
        self._owner = owner  # set when this refusal holds one of its key's tarpit places

    async def tarpit(self) -> None:
        if self._owner is None:
            return
        try:
            await asyncio.sleep(TARPIT_S)
        finally:
            self._owner.tarpitted -= 1
            self._owner = None


class Throttle:
    """Per-key refusal counting and the throttle it triggers (module docstring). ``refusals`` 0 = never throttle."""

    def __init__(
        self,
        refusals: int = 20,
        window_s: float = 60.0,
        penalty_s: float = 300.0,
        *,
        exempt: Collection[str] = (),
        on_refuse: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refusals, self.window_s, self.penalty_s = refusals, window_s, penalty_s
        self._bucket_s = window_s / BUCKETS
        self._exempt = frozenset(exempt)
        self._on_refuse = on_refuse
        self._clock = clock
        self._owners: OrderedDict[str, _Owner] = OrderedDict()

    def enter(self, owner: str) -> None:
        """A request of ``owner`` starts; :class:`Throttled` (a 429, to be answered after its :meth:`Throttled.tarpit`)
        when the key is throttled and already has one in flight. Every ``enter`` that returns must be followed by one
        :meth:`leave`."""
        if self.refusals <= 0 or owner in self._exempt:
            return
        o = self._owner(owner)
        if o.inflight >= 1 and (left := self._left(o)) > 0:
            if self._on_refuse is not None:
                self._on_refuse()
            slot = o.tarpitted < MAX_TARPIT
            o.tarpitted += slot
            raise self._error(left, "it may have one request in flight until then", o if slot else None)
        o.inflight += 1

    def leave(self, owner: str, status: int) -> None:
        """A request of ``owner`` that :meth:`enter` let in ended with ``status``: count it, and throttle the key when
        its window crosses the line."""
        if self.refusals <= 0 or owner in self._exempt:
            return
        o = self._owner(owner)
        o.inflight = max(0, o.inflight - 1)
        if status == 429 or status >= 500:  # not the request's fault: neither a refusal nor a request judged
            return
        now = self._clock()
        index = int(now // self._bucket_s)
        refused = 1 if status in REFUSED else 0
        if o.buckets and o.buckets[-1][0] == index:
            _, n, r = o.buckets[-1]
            o.buckets[-1] = (index, n + 1, r + refused)
        else:
            o.buckets.append((index, 1, refused))
        o.buckets = [b for b in o.buckets if b[0] > index - BUCKETS]
        requests = sum(b[1] for b in o.buckets)
        refusals = sum(b[2] for b in o.buckets)
        if refused and refusals >= self.refusals and 2 * refusals >= requests:
            if o.until <= now:
                log.warning(
                    "API key %s throttled for %.0f s: %d of its %d requests in the last %.0f s were refused",
                    owner, self.penalty_s, refusals, requests, self.window_s,
                )  # fmt: skip
            o.until = now + self.penalty_s

    def delay(self, owner: str, status: int) -> float:
        """Seconds to hold back the answer ``status`` to ``owner``'s admitted request: the tarpit when the key is
        throttled and the request was refused, else 0."""
        return TARPIT_S if status in REFUSED and self.throttled(owner) else 0.0

    def throttled(self, owner: str) -> bool:
        o = self._owners.get(owner)
        return o is not None and self._left(o) > 0

    def check_choices(self, owner: str, n: int) -> None:
        """A 429 ``APIError`` when a throttled ``owner`` asks for ``n`` > 1 choices."""
        o = self._owners.get(owner)
        if n > 1 and o is not None and (left := self._left(o)) > 0:
            if self._on_refuse is not None:
                self._on_refuse()
            raise self._error(left, "it may ask for one choice (n = 1) at a time until then", None)

    def tarpitted(self, owner: str) -> int:
        """``owner``'s refused requests waiting out their tarpit now."""
        o = self._owners.get(owner)
        return o.tarpitted if o is not None else 0

    def throttled_keys(self) -> int:
        return sum(1 for o in self._owners.values() if self._left(o) > 0)

    def _left(self, o: _Owner) -> float:
        return o.until - self._clock()

    def _owner(self, owner: str) -> _Owner:
        o = self._owners.pop(owner, None) or _Owner()
        self._owners[owner] = o
        while len(self._owners) > MAX_OWNERS:
            self._owners.popitem(last=False)
        return o

    def _error(self, left: float, what: str, tarpit: _Owner | None) -> Throttled:
        return Throttled(
            f"This API key is throttled for {math.ceil(left)} more seconds because most of its recent requests were refused "
            f"(at least {self.refusals} in {self.window_s:.0f} s, and at least half of its requests): {what}. "
            "Fix the requests the server refuses (their 4xx errors say why).",
            math.ceil(left),
            tarpit,
        )
