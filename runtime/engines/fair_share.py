"""Fair admission across owners: the Virtual Token Counter (VTC).

Sheng, Cao, Li, Zhu, Li, Zhuo, Gonzalez, Stoica: "Fairness in Serving Large Language Models", OSDI 2024
(arXiv:2401.00588; Algorithm 1, "VTC"; reference code github.com/Ying1123/VTC-artifact,
``slora/server/router/vtc_req_queue.py``). The embedded engine's waiting queue is a :class:`FairQueue`:

- Every owner (an API key's identity, ``runtime/identity.py``) has a counter of the service it received:
  ``w_prefill`` per prompt token, charged when one of its requests joins the batch (the paper charges the
  input at admission), and ``w_decode`` per token it decodes, charged after each step. The paper's weights,
  1 and 2 (its artifact's ``input_price``/``output_price``), are the defaults.
- When the batch has room, the next request admitted is the head of the waiting owner with the *lowest*
  counter; ties go to the owner whose head request arrived first. Within an owner, requests are admitted in
  arrival order (FCFS). It is work-conserving: whenever there is room every waiting request is admitted, so
  without contention nothing changes; only when the batch is full does the order differ from FCFS.
- Counter lift: an owner that *arrives* (goes from nothing waiting or running to one request) has its
  counter raised to the lowest counter of the owners active at that moment (``max(own, min(active))``),
  so an owner cannot bank service while idle and then crowd the others out. With no owner active it is raised
  to the counter of the owner that last went idle (the paper's "last client that left").

Row share (not in the paper, whose GPU batch is bounded by memory, not by step time): on a CPU every row of
the batch lengthens every decode step for everyone, so a free row is not free. While two or more owners are
active, the engine lets one owner hold at most ``ceil(max_batch / active owners)`` rows (:meth:`FairQueue.row_cap`);
the rest of its requests wait (an ``n``=16 request from one key runs in waves beside three other keys' work
instead of doubling the batch). Alone, an owner may fill the batch. It is not work-conserving by design: rows
an owner may not take stay empty rather than slow the others' steps. ``row_share=False`` on the engine turns it off.

One deviation from the paper, on purpose: its lift compares with the clients *in the waiting queue*; here
"active" is waiting *or* running. On a CPU engine the waiting queue is often empty while the batch holds
every owner's work, and an owner whose requests all run is still taking service the newcomer should not be
behind (or ahead of) by an idle period.

Memory is bounded: active owners' counters live in ``_counters``; an owner that goes idle moves to a
least-recently-used table of at most ``remember`` owners (older ones are forgotten, which only ever lifts
them to the active minimum on return, as a new owner).

Owner of a request: the engine request's ``owner`` (``runtime/generation.py`` sets the API key's identity),
else the caller bound by ``runtime/identity.bind_caller`` (agent runs), else ``public``. Not thread-safe by
itself: the embedded engine calls it under its ``_cv`` lock.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

W_PREFILL = 1.0  # the paper's input price
W_DECODE = 2.0  # the paper's output price
REMEMBER = 10_000  # idle owners whose counters are kept (least recently active first out)


def owner_of(req: Any) -> str:
    """The owner of engine request ``req`` (see the module docstring for the order of sources)."""
    owner = getattr(req, "owner", None)
    if owner:
        return str(owner)
    from runtime.identity import current_caller  # lazily: the engine stays importable without the web stack loaded

    return current_caller().owner


class FairQueue(Generic[T]):
    """The waiting requests of every owner and the owners' virtual token counters (module docstring)."""

    def __init__(self, w_prefill: float = W_PREFILL, w_decode: float = W_DECODE, remember: int = REMEMBER) -> None:
        self.w_prefill, self.w_decode, self.remember = w_prefill, w_decode, remember
        self._counters: dict[str, float] = {}  # active owners (something waiting or running)
        self._waiting: dict[str, deque[tuple[int, T]]] = {}  # owner -> (arrival number, item), FCFS; no empty deques
        self._running: dict[str, int] = {}  # owner -> items popped and not yet done; no zeros
        self._idle: OrderedDict[str, float] = OrderedDict()  # counters of owners gone idle, bounded
        self._last_left = 0.0  # the counter of the owner that last went idle
        self._arrivals = itertools.count()
        self._len = 0

    # ---- the queue ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[T]:
        """Every waiting item (in no particular order across owners)."""
        for q in self._waiting.values():
            for _, item in q:
                yield item

    def push(self, owner: str, item: T) -> None:
        """``item`` waits behind ``owner``'s earlier ones; an arriving owner's counter is lifted first."""
        if owner not in self._counters:
            own = self._idle.pop(owner, 0.0)
            floor = min(self._counters.values()) if self._counters else self._last_left
            self._counters[owner] = max(own, floor)
        self._waiting.setdefault(owner, deque()).append((next(self._arrivals), item))
        self._len += 1

    def row_cap(self, rows: int) -> int:
        """The most of ``rows`` batch rows one owner may hold now: all of them while it is the only active owner,
        else its equal share ``ceil(rows / active owners)`` (module docstring, "Row share")."""
        active = len(self._counters)
        return rows if active <= 1 else max(1, -(-rows // active))

    def pop(self, cap: int | None = None) -> T | None:
        """The head of the waiting owner with the lowest counter (ties: the earliest head); it counts as running
        until :meth:`done`. With ``cap``, owners already running ``cap`` items are passed over. None when nothing
        (eligible) waits."""
        best: str | None = None
        best_key: tuple[float, int] | None = None
        for owner, q in self._waiting.items():
            if cap is not None and self._running.get(owner, 0) >= cap:
                continue
            key = (self._counters[owner], q[0][0])
            if best_key is None or key < best_key:
                best, best_key = owner, key
        if best is None:
            return None
        q = self._waiting[best]
        _, item = q.popleft()
        if not q:
            del self._waiting[best]
        self._len -= 1
        self._running[best] = self._running.get(best, 0) + 1
        return item

    def done(self, owner: str) -> None:
        """One of ``owner``'s popped items left the batch (finished, failed or cancelled)."""
        left = self._running.get(owner, 0) - 1
        if left > 0:
            self._running[owner] = left
            return
        self._running.pop(owner, None)
        if owner not in self._waiting and owner in self._counters:  # idle now: remember its counter, bounded
            c = self._counters.pop(owner)
            self._last_left = c
            self._idle[owner] = c
            self._idle.move_to_end(owner)
            while len(self._idle) > self.remember:
                self._idle.popitem(last=False)

    # ---- the counters -------------------------------------------------------------------------
    def charge(self, owner: str, prefill: int = 0, decode: int = 0) -> None:
        """Add ``owner``'s service: ``prefill`` prompt tokens admitted, ``decode`` tokens generated."""
        if owner in self._counters:
            self._counters[owner] += self.w_prefill * prefill + self.w_decode * decode

    def counter(self, owner: str) -> float:
        """``owner``'s counter (an idle owner's as remembered; 0 for one never seen)."""
        return self._counters.get(owner, self._idle.get(owner, 0.0))

    def active(self) -> dict[str, float]:
        """The active owners and their counters (a copy)."""
        return dict(self._counters)

    def waiting_of(self, owner: str) -> int:
        return len(self._waiting.get(owner, ()))

    def running_of(self, owner: str) -> int:
        return self._running.get(owner, 0)
