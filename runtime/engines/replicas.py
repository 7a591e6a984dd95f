"""Several servers of one external backend behind one runtime: adapter-aware routing, failover, adapters after restarts.

``ReplicaSet([engine, ...])`` is an :class:`runtime.engine.Engine` over N ``HTTPEngine`` s (SGLang or
vLLM servers of the same model; ``--engine-url`` repeated). One server is the case N = 1, so a single
server gets the same failure handling.

- **Routing** (per request): the replicas that are up and have the request's adapter loaded; among them
  the session's replica (``GenerateRequest.session``) while it is one of them, else the least loaded
  (requests this runtime has in flight there), ties broken round-robin; the session is then pinned to
  it (a bounded LRU), so a conversation keeps its prefix cache.
- **Failover**: a replica that cannot be reached, or turns out not to have the adapter, before anything
  was handed to the caller is taken out (or re-checked) and the request goes to the next candidate.
  Once a stream has handed out tokens a failure ends that request (``ServerLost``): the serving layer
  sends the client an error event and records the turn as aborted. A refused connection takes the
  replica out at once; other failures make the monitor probe it now.
- **Adapters**: loads and unloads go to every replica that is up, concurrently. A replica that refuses a
  load (not a transport failure) rolls it back everywhere and the error propagates, so the registry
  stays unchanged; replicas that are down get the adapter when they return. Aliases are resolved by the
  registry above (``runtime/adapters/registry.py``) before a request gets here, so a flip reaches every replica.
- **Embeddings**: servers of a pooling model (``HTTPEngine.pooling_model``, read at connect) embed on the least
  loaded one that is up (``pool``); one that cannot be reached is skipped, as for generation.
- **Monitor**: one task per replica probes it every ``health_interval_s`` (``HTTPEngine.probe``: cheap,
  and for vLLM it lists the server's adapters). A refused connection takes a replica out; probes that
  time out or fail do after three in a row, unless the replica handed out tokens within the last probe
  window: a server too busy to answer its probe (SGLang's ``/health`` is a generate queued behind the
  batch) is serving, not dead. A replica that comes back is re-read (``connect``), its
  adapters are re-synced (names it still lists are kept; the rest are loaded again under fresh names;
  ones no longer wanted are unloaded) and only then is it routed to. An up replica that lists fewer of
  our adapters than we loaded (it restarted between two probes) is re-synced the same way.

Not here: the wire formats (``runtime/engines/sglang.py``, ``vllm.py``), launching servers, A/B routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from runtime.engine import AdapterError, EngineClosed, EngineError, EngineInfo, GenerateRequest, GenerateResult, PoolingModel, StreamChunk
from runtime.engines.http_engine import AdapterGone, HTTPEngine, LocalModel, ServerDown, ServerLost

log = structlog.stdlib.get_logger(__name__)

_MAX_PINS = 100_000
_RELOAD_RETRY_S = 30.0  # an adapter a replica refused to reload is tried again after this long
_PROBE_FAILURES_TO_DOWN = 3  # consecutive failed probes that take an up replica out (a refused connection does at once)


@dataclass(eq=False)
class Replica:
    index: int
    engine: HTTPEngine
    up: bool = False
    needs_sync: bool = False  # its adapters must be re-synced before the next request that needs them
    failures: int = 0
    requests: int = 0  # requests routed here
    last_progress: float = 0.0  # time.monotonic() when it last handed out tokens (a busy replica is not a dead one)
    retry_at: dict[str, float] = field(default_factory=dict)  # adapter -> when to try loading it here again
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # serialises adapter operations on this server
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return self.engine.url

    def has(self, adapter: str | None) -> bool:
        return adapter is None or adapter in self.engine.adapters()


class ReplicaSet:
    """N servers of one backend as one :class:`runtime.engine.Engine` (see the module docstring)."""

    def __init__(
        self,
        engines: Sequence[HTTPEngine],
        *,
        health_interval_s: float = 2.0,
        probe_timeout_s: float = 10.0,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("a replica set needs at least one engine")
        self.replicas = [Replica(i, e) for i, e in enumerate(engines)]
        self.health_interval_s = health_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._wanted: dict[str, str] = {}  # adapter name -> path: what every replica should have loaded
        self._pins: OrderedDict[tuple[str | None, str], int] = OrderedDict()  # (owner, session) -> replica index
        self._rr = itertools.count()
        self._watchers: list[asyncio.Task[None]] = []
        self._info: EngineInfo | None = None
        self._local: LocalModel | None = None
        self._on_close = on_close  # e.g. stop launched servers: runs in close(), inside the app's shutdown

    # ---- Engine protocol: lifecycle ---------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineClosed("engine not started")
        return self._info

    @property
    def tokenizer(self) -> Any:
        return self._local.tokenizer if self._local is not None else None

    @property
    def model(self) -> Any:
        return self._local.model if self._local is not None else None

    @property
    def backend(self) -> str:
        return self.replicas[0].engine.backend

    async def start(self) -> None:
        first = self.replicas[0].engine
        await first.open()  # loads the local model folder once; the other replicas share it
        self._local = first.local
        for r in self.replicas[1:]:
            r.engine.local = self._local
            await r.engine.open()
        results = await asyncio.gather(*(r.engine.connect() for r in self.replicas), return_exceptions=True)
        infos = []
        for r, res in zip(self.replicas, results, strict=True):
            if isinstance(res, EngineInfo):
                r.up = True
                infos.append(res)
            elif isinstance(res, EngineError):
                log.warning("replica_down_at_start", url=r.url, error=str(res))
            else:
                raise res
        if not infos:
            failure = next(res for res in results if isinstance(res, BaseException))
            raise failure
        max_len = min(i.max_model_len for i in infos)
        self._info = EngineInfo(
            backend=infos[0].backend,
            model=infos[0].model,
            max_model_len=max_len,
            vocab_size=infos[0].vocab_size,
            eos_token_ids=infos[0].eos_token_ids,
            dtype=infos[0].dtype,
            prompt_logprobs=all(i.prompt_logprobs for i in infos),
        )
        self._watchers = [asyncio.create_task(self._watch(r), name=f"replica-{r.index}") for r in self.replicas]
        log.info("replicas_started", backend=self.backend, up=[r.url for r in self.replicas if r.up], down=[r.url for r in self.replicas if not r.up])

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        for task in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._watchers = []
        await asyncio.gather(*(r.engine.close() for r in self.replicas), return_exceptions=True)
        if self._on_close is not None:
            await asyncio.to_thread(self._on_close)

    # ---- routing ---------------------------------------------------------------------------
    def _pick(self, req: GenerateRequest, exclude: set[int]) -> Replica:
        live = [r for r in self.replicas if r.up and r.index not in exclude]
        cands = [r for r in live if r.has(req.adapter)]
        if not cands:
            if live and req.adapter is not None:
                if req.adapter in self._wanted:  # every live replica lost it: being reloaded (503, retry), not unknown (404)
                    raise EngineClosed(f"adapter {req.adapter!r} is being loaded again on the {self.backend} replicas")
                raise AdapterError(f"adapter {req.adapter!r} is not loaded on any live {self.backend} replica")
            n_down = sum(not r.up for r in self.replicas)
            raise EngineClosed(f"no {self.backend} replica can serve this request ({n_down} of {len(self.replicas)} down)")
        # a session is its owner's (two keys may name theirs alike): one key's session never steers another's to a replica
        key = (req.owner, req.session) if req.session is not None else None
        if key is not None:
            pinned = self._pins.get(key)
            if pinned is not None and any(r.index == pinned for r in cands):
                self._pins.move_to_end(key)
                self.replicas[pinned].requests += 1
                return self.replicas[pinned]
        turn = next(self._rr)
        chosen = min(cands, key=lambda r: (r.engine.in_flight, (r.index - turn) % len(self.replicas)))
        chosen.requests += 1
        if key is not None:
            self._pins[key] = chosen.index
            self._pins.move_to_end(key)
            while len(self._pins) > _MAX_PINS:
                self._pins.popitem(last=False)
        return chosen

    def _failed_before_output(self, r: Replica, req: GenerateRequest, exc: EngineError) -> None:
        """A replica failed a request before anything reached the caller: take it out or have it re-checked."""
        if isinstance(exc, AdapterGone):
            # it lost an adapter we loaded there (a restart between two probes): stop routing that adapter to it
            if req.adapter is not None:
                r.engine.forget_adapters([req.adapter])
            r.needs_sync = True
            log.warning("replica_lost_adapter", url=r.url, adapter=req.adapter, error=str(exc))
        elif isinstance(exc.__cause__, httpx.ConnectError):
            self._mark_down(r, str(exc))
        else:
            log.warning("replica_request_failed", url=r.url, request_id=req.request_id, error=str(exc))
        r.wake.set()

    def _mark_down(self, r: Replica, reason: str) -> None:
        if r.up:
            r.up = False
            r.needs_sync = True
            log.warning("replica_down", url=r.url, reason=reason, up=sum(x.up for x in self.replicas), of=len(self.replicas))

    # ---- Engine protocol: generation -------------------------------------------------------
    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        tried: set[int] = set()
        while True:
            r = self._pick(req, tried)
            it = aiter(r.engine.stream(req))
            try:
                first = await anext(it)
                break
            except (ServerDown, AdapterGone) as exc:
                tried.add(r.index)
                self._failed_before_output(r, req, exc)
                if not self._has_candidate(req, tried):
                    raise
        r.last_progress = time.monotonic()
        try:
            yield first
            if first.finish_reason is None:
                async for chunk in it:
                    r.last_progress = time.monotonic()
                    yield chunk
        except ServerLost:
            r.wake.set()
            raise
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        tried: set[int] = set()
        while True:
            r = self._pick(req, tried)
            try:
                result = await r.engine.generate(req)
                r.last_progress = time.monotonic()
                return result
            except (ServerDown, AdapterGone) as exc:
                tried.add(r.index)
                self._failed_before_output(r, req, exc)
                if not self._has_candidate(req, tried):
                    raise

    # ---- embeddings (servers of a pooling model) ---------------------------------------------
    @property
    def pooling_model(self) -> PoolingModel | None:
        """The pooling model the servers serve (None: a generative one), as the first server read says, up or not."""
        return next((r.engine.pooling_model for r in self.replicas if r.engine.pooling_model is not None), None)

    async def pool(self, inputs: list[tuple[int, ...]], dimensions: int | None = None) -> list[list[float]]:
        """Embed on the least loaded server of the pooling model that is up; one that cannot be reached is skipped."""
        tried: set[int] = set()
        while True:
            cands = [r for r in self.replicas if r.up and r.index not in tried and r.engine.pooling_model is not None]
            if not cands:
                n_down = sum(not r.up for r in self.replicas)
                raise EngineClosed(f"no {self.backend} replica serving the pooling model is up ({n_down} of {len(self.replicas)} down)")
            r = min(cands, key=lambda x: x.engine.in_flight)
            try:
                return await r.engine.pool(inputs, dimensions)
            except ServerDown as exc:
                tried.add(r.index)
                if isinstance(exc.__cause__, httpx.ConnectError):
                    self._mark_down(r, str(exc))
                r.wake.set()

    def _has_candidate(self, req: GenerateRequest, tried: set[int]) -> bool:
        return any(r.up and r.index not in tried and r.has(req.adapter) for r in self.replicas)

    async def health(self) -> None:
        """A one-token generate on the least loaded replica that is up."""
        live = [r for r in self.replicas if r.up]
        if not live:
            raise EngineClosed(f"no {self.backend} replica is up ({len(self.replicas)} down)")
        await min(live, key=lambda r: r.engine.in_flight).engine.health()

    def stats(self) -> dict[str, float]:
        return {
            "waiting": 0.0,
            "running": float(sum(r.engine.in_flight for r in self.replicas)),
            "replicas_up": float(sum(r.up for r in self.replicas)),
            "replicas": float(len(self.replicas)),
        }

    def status(self) -> list[dict[str, Any]]:
        """One row per replica: url, up, requests in flight, loaded adapters, requests routed there (``/metrics``)."""
        return [
            {"url": r.url, "up": r.up, "in_flight": r.engine.in_flight, "adapters": sorted(r.engine.adapters()), "requests": r.requests}
            for r in self.replicas
        ]

    # ---- adapters --------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> None:
        if name in self._wanted:
            raise AdapterError(f"adapter {name!r} is already loaded (versions are immutable: load it under a new name)")
        live = [r for r in self.replicas if r.up]
        if not live:
            raise EngineClosed(f"no {self.backend} replica is up to load adapter {name!r}")
        self._wanted[name] = path  # before the loads: a replica that is re-syncing meanwhile picks it up

        async def one(r: Replica) -> None:
            async with r.lock:
                if not r.has(name):
                    await r.engine.load_adapter(name, path)

        results = await asyncio.gather(*(one(r) for r in live), return_exceptions=True)
        refused = [res for res in results if isinstance(res, BaseException) and not isinstance(res, ServerDown)]
        loaded = [r for r, res in zip(live, results, strict=True) if res is None]
        for r, res in zip(live, results, strict=True):
            if isinstance(res, ServerDown):
                self._mark_down(r, str(res))
        if refused or not loaded:
            self._wanted.pop(name, None)
            await asyncio.gather(*(self._unload_from(r, name) for r in loaded), return_exceptions=True)
            failure = refused[0] if refused else results[0]
            assert isinstance(failure, BaseException)
            raise failure
        log.info("replicas_adapter_loaded", adapter=name, on=[r.url for r in loaded], pending=[r.url for r in self.replicas if r not in loaded])

    async def unload_adapter(self, name: str) -> None:
        if self._wanted.pop(name, None) is None:
            raise AdapterError(f"adapter {name!r} is not loaded")
        results = await asyncio.gather(*(self._unload_from(r, name) for r in self.replicas if r.up), return_exceptions=True)
        errors = [res for res in results if isinstance(res, BaseException)]
        if errors:
            raise errors[0]

    async def _unload_from(self, r: Replica, name: str) -> None:
        async with r.lock:
            if r.has(name):
                try:
                    await r.engine.unload_adapter(name)
                except ServerDown as exc:
                    self._mark_down(r, str(exc))  # it is forgotten there when the replica comes back

    def adapters(self) -> dict[str, str]:
        return dict(self._wanted)

    # ---- the monitor -----------------------------------------------------------------------
    async def _watch(self, r: Replica) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(r.wake.wait(), self.health_interval_s)
            r.wake.clear()
            asked = set(r.engine.adapters().values())  # a load that lands while the probe is out is not in its list
            try:
                listed = await asyncio.wait_for(r.engine.probe(), self.probe_timeout_s)
            except (EngineError, TimeoutError) as exc:
                r.failures += 1
                refused = isinstance(exc.__cause__, httpx.ConnectError) or "ConnectError" in str(exc)
                serving = time.monotonic() - r.last_progress <= self.probe_timeout_s + self.health_interval_s
                if r.up and (refused or (r.failures >= _PROBE_FAILURES_TO_DOWN and not serving)):
                    self._mark_down(r, f"health probe failed: {str(exc) or type(exc).__name__}")
                elif r.up:
                    log.info("replica_probe_failed", url=r.url, failures=r.failures, serving=serving, error=str(exc) or type(exc).__name__)
                continue
            except Exception:
                log.exception("replica_probe_crashed", url=r.url)
                continue
            r.failures = 0
            ours = asked & set(r.engine.adapters().values())  # mapped before the probe asked and still: must be listed
            if listed is not None and not ours <= listed:
                r.needs_sync = True
            due = any(n not in r.engine.adapters() and r.retry_at.get(n, 0.0) <= time.monotonic() for n in self._wanted)
            if not r.up or r.needs_sync or due or any(n not in self._wanted for n in r.engine.adapters()):
                try:
                    await self._sync(r, listed, asked)
                except EngineError as exc:
                    log.warning("replica_sync_failed", url=r.url, error=str(exc))

    async def _sync(self, r: Replica, listed: set[str] | None, asked: set[str] | None = None) -> None:
        """Bring a replica's adapters in line with what is wanted (after it came back, or lost some), then route to it.
        ``listed`` is what its probe answered; ``asked``, the server names mapped when the probe was sent (None: all),
        so a load that landed while the probe was out is not taken for one the server lost."""
        async with r.lock:
            came_back = not r.up
            if came_back:
                await r.engine.connect()
            if r.needs_sync:
                mapped = r.engine.adapters()
                if listed is None:  # the server cannot list its adapters: whatever we had there is suspect
                    await r.engine.discard(r.engine.forget_adapters())
                else:
                    lost = [n for n, server_name in mapped.items() if server_name not in listed and (asked is None or server_name in asked)]
                    r.engine.forget_adapters(lost)
                r.needs_sync = False
            reloaded, failed = [], []
            now = time.monotonic()
            for name in [n for n in r.engine.adapters() if n not in self._wanted]:
                try:
                    await r.engine.unload_adapter(name)
                except ServerDown:
                    raise
                except EngineError as exc:  # leave it to the server; we no longer route to it
                    r.engine.forget_adapters([name])
                    log.warning("replica_adapter_unload_failed", url=r.url, adapter=name, error=str(exc))
            for name, path in list(self._wanted.items()):
                if r.has(name) or r.retry_at.get(name, 0.0) > now:
                    continue
                try:
                    await r.engine.load_adapter(name, path)
                    reloaded.append(name)
                    r.retry_at.pop(name, None)
                except ServerDown:
                    raise
                except EngineError as exc:
                    failed.append(name)
                    r.retry_at[name] = now + _RELOAD_RETRY_S
                    log.error("replica_adapter_reload_failed", url=r.url, adapter=name, error=str(exc), retry_in_s=_RELOAD_RETRY_S)
            if came_back:
                r.up = True
                log.warning("replica_up", url=r.url, reloaded=reloaded, failed=failed, up=sum(x.up for x in self.replicas), of=len(self.replicas))
            elif reloaded or failed:
                log.warning("replica_adapters_resynced", url=r.url, reloaded=reloaded, failed=failed)
