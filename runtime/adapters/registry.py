"""The in-process adapter registry (SGLang ``lora_registry`` semantics): which adapter versions are routable.

What it does: ``AdapterRegistry`` routes for one event loop. Registration only after a successful load,
versions never reused for other weights, atomic alias flips, ``acquire``/``release`` around every
request, unload only after in-flight requests drain, LRU eviction that skips pinned/in-flight/alias
targets and unloads its victim once the new version routes (a hot swap waits for one engine call). A
``RegistryListener`` is told of each change (``runtime/adapters/sync.py`` writes them to a shared store).

What it does not: load weights (the engine does, through ``load_fn``/``unload_fn``), check adapter folders
(``runtime/adapters/validation.py``), speak HTTP (``runtime/admin/adapters.py``), or pick A/B arms
(``runtime/adapters/experiments.py``).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.adapters.names import AdapterCapacity, AdapterError, AdapterExists, AdapterInUse, AdapterInvalid, AdapterNotFound, AdapterRef

logger = logging.getLogger(__name__)


class RegistryListener(Protocol):
    """Told of each change to routing (synchronously, on the registry's loop: it must not block)."""

    def registered(self, ref: AdapterRef, made_alias: bool) -> None: ...
    def unregistered(self, name: str) -> None: ...
    def alias_set(self, family: str, target_name: str) -> None: ...


@dataclass
class _Entry:
    ref: AdapterRef
    in_flight: int = 0
    tick: int = 0  # LRU order
    last_used: float | None = None
    drained: asyncio.Event | None = None  # set while unregistering


class AdapterRegistry:
    """Which adapter versions are loaded and routable, for one asyncio event loop.

    Concurrency invariant: every check and the routing change it guards happen in one synchronous step
    (no ``await`` in between), so on a single loop they are atomic. ``acquire`` is synchronous: resolving
    a name and incrementing its in-flight count can't interleave with ``unregister``/eviction, which
    remove a name from routing synchronously *before* awaiting the drain or ``unload_fn``. So a request
    either is counted before removal (and unload waits for it) or fails with ``AdapterNotFound``; it
    never holds a version that gets unloaded under it. (SGLang's async ``acquire`` needs its writer lock
    for the same guarantee.) ``_lock`` serialises the engine calls (``load_fn``/``unload_fn``) and the
    checks that precede them; draining waits outside it. An eviction's unload is the one engine call that runs
    after the lock is released (its successor routes first); every later engine call waits for it (``_settle``).
    """

    def __init__(self, *, max_loaded: int, load_fn: Callable[[AdapterRef], Awaitable[None]], unload_fn: Callable[[str], Awaitable[None]]) -> None:
        if max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        self.max_loaded, self._load_fn, self._unload_fn = max_loaded, load_fn, unload_fn
        self._routed: dict[str, _Entry] = {}  # name -> entry, routable
        self._draining: dict[str, _Entry] = {}  # removed from routing, still loaded in the engine
        self._retired: dict[str, AdapterRef] = {}  # unloaded; the name may only come back with the same files
        self._aliases: dict[str, str] = {}  # family -> name
        self._tick = 0
        self._lock = asyncio.Lock()
        self._eviction: asyncio.Task[None] | None = None  # the last eviction's unload, finishing after its successor routes
        # told of every change made with notify=True (runtime/adapters/sync.py writes them to a shared store)
        self.listener: RegistryListener | None = None

    def next_version(self, family: str) -> int:
        seen = [e.ref for e in (*self._routed.values(), *self._draining.values())] + [*self._retired.values()]
        return max((r.version for r in seen if r.family == family), default=0) + 1

    async def register(self, ref: AdapterRef, *, make_alias: bool = False, notify: bool = True) -> AdapterRef:
        """Load ``ref`` and route it (and point its family's alias at it with ``make_alias``).

        At capacity the least recently used evictable version leaves routing first and stays loaded (listed as
        draining) while ``ref`` loads: the engine holds one adapter more for that moment, and the victim is unloaded
        in the background once ``ref`` routes, so a hot swap waits for one engine call, not two. An engine that
        refuses the extra load (no spare slot) gets the old order: the victim is unloaded, then ``ref`` is loaded
        once more (if that fails too the error propagates and the victim stays evicted, as before). A load cancelled
        while the victim is still loaded routes the victim again."""
        async with self._lock:
            await self._settle()  # the last eviction's unload first: the engine holds one spare adapter at most
            name = ref.name
            if name in self._routed or name in self._draining:
                raise AdapterExists(f"{name} is already registered; versions are immutable, use {ref.family}@{self.next_version(ref.family)}")
            old = self._retired.get(name)
            if old is not None and (old.path, old.sha256) != (ref.path, ref.sha256):
                raise AdapterExists(f"{name} was served before from other files; use {ref.family}@{self.next_version(ref.family)}")
            victim = None
            if len(self._routed) + len(self._draining) >= self.max_loaded:
                victim = self._pick_victim()
                del self._routed[victim.ref.name]  # out of routing before the await (see class docstring)
                self._draining[victim.ref.name] = victim  # still loaded until ref is
                logger.info("evicting adapter %s (least recently used) for %s", victim.ref.name, name)
            try:
                await self._load_fn(ref)  # raises → never registered
            except Exception as exc:
                if victim is None:
                    raise
                logger.info("loading %s beside %s failed (%s); unloading %s first", name, victim.ref.name, exc, victim.ref.name)
                del self._draining[victim.ref.name]
                await self._unload(victim.ref)
                await self._load_fn(ref)
                victim = None
            except BaseException:  # cancelled: the victim is still loaded, so it routes again
                if victim is not None:
                    del self._draining[victim.ref.name]
                    self._routed[victim.ref.name] = victim
                raise
            self._retired.pop(name, None)
            self._routed[name] = _Entry(ref, tick=self._next_tick())
            if make_alias:
                self._aliases[ref.family] = name
            if notify and self.listener is not None:
                self.listener.registered(ref, make_alias)
            if victim is not None:
                self._eviction = asyncio.create_task(self._finish_eviction(victim), name=f"evict-{victim.ref.name}")
            return ref

    async def _finish_eviction(self, victim: _Entry) -> None:
        """Unload an evicted version once its successor routes (the engine calls after it wait: ``_settle``)."""
        try:
            await self._unload(victim.ref)
        except Exception:
            logger.exception("unloading evicted adapter %s failed", victim.ref.name)
        finally:
            self._draining.pop(victim.ref.name, None)

    async def _settle(self) -> None:
        """Wait for the last eviction's unload (under ``_lock``, before any other engine call)."""
        if self._eviction is not None:
            await asyncio.shield(self._eviction)  # cancelled here, it finishes anyway and the next call waits again
            self._eviction = None

    async def settled(self) -> None:
        """Wait until every eviction's unload has finished (tests, shutdown)."""
        async with self._lock:
            await self._settle()

    def _pick_victim(self) -> _Entry:
        targets = set(self._aliases.values())
        candidates = [e for n, e in self._routed.items() if not e.ref.pinned and e.in_flight == 0 and n not in targets]
        if not candidates:
            raise AdapterCapacity(
                f"{self.max_loaded} adapters loaded ({len(self._draining)} draining) and none is evictable "
                "(all pinned, in flight or alias targets); unregister one or raise max_loaded"
            )
        return min(candidates, key=lambda e: e.tick)

    async def _unload(self, ref: AdapterRef) -> None:
        self._retired[ref.name] = ref
        await self._unload_fn(ref.name)

    def set_alias(self, family: str, target_name: str, *, notify: bool = True) -> None:
        entry = self._routed.get(target_name)
        if entry is None:
            raise AdapterNotFound(f"alias target {target_name} is not registered")
        if entry.ref.family != family:
            raise AdapterInvalid(f"alias {family!r} can only point at {family}@N, not {target_name}")
        self._aliases[family] = target_name  # one assignment: requests see the old or the new target
        if notify and self.listener is not None:
            self.listener.alias_set(family, target_name)

    def remove_alias(self, family: str) -> None:
        if self._aliases.pop(family, None) is None:
            raise AdapterNotFound(f"no alias {family!r}")

    def resolve(self, name_or_alias: str) -> AdapterRef:
        name = name_or_alias if "@" in name_or_alias else self._aliases.get(name_or_alias)
        entry = self._routed.get(name) if name else None
        if entry is None:
            raise AdapterNotFound(f"adapter {name_or_alias!r} is not loaded")
        return entry.ref

    def acquire(self, name_or_alias: str) -> AdapterRef:
        # Synchronous on purpose: resolve + increment are atomic w.r.t. unregister/eviction (class docstring).
        ref = self.resolve(name_or_alias)
        entry = self._routed[ref.name]
        entry.in_flight += 1
        entry.tick, entry.last_used = self._next_tick(), time.time()
        return ref

    def release(self, ref: AdapterRef) -> None:
        entry = self._routed.get(ref.name) or self._draining.get(ref.name)
        if entry is None or entry.in_flight <= 0:
            raise AdapterError(f"release of {ref.name} without a matching acquire")
        entry.in_flight -= 1
        if entry.in_flight == 0 and entry.drained is not None:
            entry.drained.set()

    @contextlib.asynccontextmanager
    async def lease(self, name_or_alias: str) -> AsyncIterator[AdapterRef]:
        ref = self.acquire(name_or_alias)
        try:
            yield ref
        finally:
            self.release(ref)

    async def unregister(self, name: str, *, timeout: float = 30, notify: bool = True) -> None:
        """Stop routing ``name`` now, wait for its in-flight requests, then unload it from the engine.

        If the drain takes longer than ``timeout`` (or the call is cancelled) the adapter goes back into
        routing, since it is still loaded, and ``AdapterInUse`` is raised. An ``unload_fn`` error propagates
        after the adapter has left the registry.
        """
        async with self._lock:
            entry = self._routed.get(name)
            if entry is None:
                raise AdapterNotFound(f"adapter {name!r} is not registered")
            aliases = sorted(a for a, t in self._aliases.items() if t == name)
            if aliases:
                raise AdapterInUse(f"{name} is the target of alias(es) {aliases}; move or remove the alias first")
            del self._routed[name]  # same step as the checks: no new acquires from here on
            if notify and self.listener is not None:
                self.listener.unregistered(name)
            self._draining[name] = entry
            entry.drained = asyncio.Event()
            if entry.in_flight == 0:
                entry.drained.set()
        try:
            await asyncio.wait_for(entry.drained.wait(), timeout)
        except BaseException as exc:  # timed out or cancelled: it is still loaded, so route it again
            del self._draining[name]
            entry.drained = None
            self._routed[name] = entry
            if isinstance(exc, TimeoutError):
                raise AdapterInUse(f"{name} still has {entry.in_flight} request(s) in flight after {timeout}s; left loaded") from None
            raise
        async with self._lock:
            await self._settle()
            del self._draining[name]
            await self._unload(entry.ref)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def list(self) -> builtins.list[dict[str, Any]]:
        """One row per loaded adapter (routable ones first, then those draining towards unload)."""
        rows = [(e, "ready") for e in self._routed.values()] + [(e, "draining") for e in self._draining.values()]
        return [
            dict(
                name=e.ref.name,
                family=e.ref.family,
                version=e.ref.version,
                path=e.ref.path,
                pinned=e.ref.pinned,
                in_flight=e.in_flight,
                aliases=sorted(a for a, t in self._aliases.items() if t == e.ref.name),
                last_used=e.last_used,
                state=state,
            )
            for e, state in rows
        ]
