"""A runtime's adapters and aliases survive its restart; several runtimes on one shared store agree on them.

Each runtime's ``AdapterRegistry`` and ``Experiments`` live in its own process; the store's ``registry``
table and ``experiments`` table are the source of truth. On a store of the runtime's own (SQLite) they
are read once, at start-up, so a restarted ``serve.py`` serves the versions and aliases (the learner's
champion, the arms of a running experiment) it served before, instead of the base model; on a shared store
(``store.shared``: PostgreSQL) they are also followed while serving:

- ``StoreListener`` writes every change made on this runtime (an adapter loaded or unloaded through the
  admin API, an alias flipped by an admin, the learner or an experiment's promotion) to the store, in
  order, on one background thread (the registry's loop never waits on the database).
- ``RegistrySync.sync_once`` (at start-up, then on a shared store every ``--store-sync-s`` seconds) reads
  the store and makes this runtime match it: loads the adapter versions it has not seen (validated against
  the base model and ``--adapter-root`` exactly as ``POST /admin/adapters`` does: the folder must be readable
  here, i.e. a shared filesystem), flips aliases, unloads those removed from the store (after the aliases,
  which may free them; one still in use is kept and tried again next sync), and reloads the experiments'
  configs and states. Changes applied from the store are not written back. This runtime's own queued
  writes land before the store is read, and a sync during which this runtime changed something applies
  nothing (the rows it read are older than the change: an alias just flipped here was flipped back). What
  must serve (alias targets, live arms, pinned versions) is loaded last, so least-recently-used eviction
  never takes it; of the rest only the newest that fit in ``--max-loaded-adapters`` beside it are loaded
  (a store holding a learner's hundred versions does not load and evict a hundred at start-up).

Sticky routing needs nothing shared: an experiment's arm is a pure hash of the sticky key
(``runtime/adapters/routing.py``), the same on every runtime once they hold the same experiment config.

What it does not do: coordinate two runtimes that change the same thing at the same instant (the later
write wins; the others follow it on their next sync), or evict adapters in step (each runtime's LRU
eviction is its own, and an evicted version is not reloaded until it is an alias target or an arm).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from runtime.adapters.names import AdapterError, AdapterRef
from runtime.adapters.registry import AdapterRegistry

log = logging.getLogger(__name__)


class StoreListener:
    """Writes this runtime's registry changes to its store, in order, off the event loop."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loopwise-registry")
        self.generation = 0  # changes queued so far (on the registry's loop): a sync reading meanwhile reads an older store

    def _save(self, kind: str, name: str, value: dict[str, Any] | None) -> None:
        self.generation += 1

        def write() -> None:
            try:
                self.store.save_registry(kind, name, value)
            except Exception:
                log.exception("could not save %s %s to the store; a restart or another runtime will not see it", kind, name)

        self._writer.submit(write)

    def registered(self, ref: AdapterRef, made_alias: bool) -> None:
        self._save("adapter", ref.name, {"path": ref.path, "sha256": ref.sha256, "pinned": ref.pinned})
        if made_alias:
            self._save("alias", ref.family, {"target": ref.name})

    def unregistered(self, name: str) -> None:
        self._save("adapter", name, None)

    def alias_set(self, family: str, target_name: str) -> None:
        self._save("alias", family, {"target": target_name})

    def flush(self) -> None:
        """Wait for the writes queued so far."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)


class RegistrySync:
    """Makes one runtime's registry and experiments match the store (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        registry: AdapterRegistry,
        experiments: Any,
        validate: Callable[[AdapterRef], Awaitable[AdapterRef]],
        listener: StoreListener | None = None,
    ) -> None:
        self.store, self.registry, self.experiments, self._validate = store, registry, experiments, validate
        self.listener = listener  # this runtime's own writes to the store
        self._seen: dict[str, tuple[str, str | None]] = {}  # adapter name → (path, sha256) already acted on
        self._kept: set[str] = set()  # removed from the store, but could not be unloaded here yet (said once)

    async def sync_once(self) -> None:
        generation = self._generation()
        if self.listener is not None:  # this runtime's own changes reach the store before it is read, or a sync would
            await asyncio.to_thread(self.listener.flush)  # undo them from the older rows (an alias flipped back)
        state = await asyncio.to_thread(self.store.load_registry)
        if self._generation() != generation:
            return  # changed here while the store was read: the next sync reads both
        adapters, aliases = state["adapter"], {f: v["target"] for f, v in state["alias"].items()}
        routed = {a["name"] for a in self.registry.list() if a["state"] == "ready"}
        wanted = set(aliases.values())
        if self.experiments is not None:
            wanted |= self.experiments.live_arms()
        pending: list[str] = []  # the store's order: oldest change first
        for name, value in adapters.items():
            key = (value["path"], value.get("sha256"))
            if name in routed:
                self._seen[name] = key
                continue
            if self._seen.get(name) == key and name not in wanted:
                continue  # loaded once and evicted here since, or refused: not again unless it must serve
            self._seen[name] = key
            pending.append(name)
        for name in self._load_order(pending, adapters, wanted, len(routed)):
            await self._load(name, adapters[name])
        if self._generation() != generation:
            return  # changed here while versions loaded: the aliases read are older than the change
        for family, target in aliases.items():  # before the unloads: an alias moved away from a removed version frees it
            if self.registry.aliases().get(family) != target:
                try:
                    self.registry.set_alias(family, target, notify=False)
                    log.info("alias %s → %s (from the store)", family, target)
                except AdapterError as exc:
                    log.warning("cannot follow the store's alias %s → %s yet: %s", family, target, exc)
        for name in routed - set(adapters):
            if name in self._seen:  # it was in the store and was removed there
                try:
                    await self.registry.unregister(name, notify=False)
                except AdapterError as exc:  # still an alias target or in flight here: kept, tried again next sync
                    if name not in self._kept:
                        self._kept.add(name)
                        log.warning("adapter %s was removed from the store but stays loaded here for now: %s", name, exc)
                    continue
                self._seen.pop(name, None)
                self._kept.discard(name)
                log.info("unloaded adapter %s (removed from the store)", name)
        if self.experiments is not None:
            self.experiments.apply_stored(await asyncio.to_thread(self.experiments.saved.load))

    def _generation(self) -> int:
        """How many changes this runtime has queued for the store (0 without a listener)."""
        return self.listener.generation if self.listener is not None else 0

    def _load_order(self, pending: list[str], adapters: dict[str, dict[str, Any]], wanted: set[str], n_routed: int) -> list[str]:
        """``pending`` to load, what must serve (wanted or pinned) last; of the rest, the newest that fit beside it."""
        must = [n for n in pending if n in wanted or adapters[n].get("pinned")]
        rest = [n for n in pending if n not in must]
        room = max(0, self.registry.max_loaded - n_routed - len(must))
        return rest[len(rest) - room :] + must if room else must

    async def _load(self, name: str, value: dict[str, Any]) -> None:
        family, _, version = name.partition("@")
        try:
            ref = AdapterRef(family=family, version=int(version), path=value["path"], pinned=bool(value.get("pinned")), sha256=value.get("sha256"))
            ref = await self._validate(ref)
            await self.registry.register(ref, notify=False)
            log.info("loaded adapter %s from %s (in the store)", name, ref.path)
        except Exception as exc:  # this runtime cannot load it (not on its filesystem, invalid, full): say so, retry on change
            log.error("cannot load adapter %s from the store here (%s): %s", name, value.get("path"), exc)

    async def run_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sync_once()
            except Exception:  # the store is down, or one entry is bad: serving goes on with what is loaded
                log.exception("syncing with the store failed; retrying in %.1f s", every_s)
