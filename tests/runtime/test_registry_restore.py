"""A runtime restores its adapters and aliases from its store at start-up, and follows it without undoing its own changes
(``runtime/adapters/sync.py``).

The registry is the real one; the store is a dict in ``load_registry``'s shape (oldest change first), and loading
records the order. What must serve (alias targets, pinned versions) is loaded last and never evicted; of the rest
only the newest that fit are loaded, so nothing is loaded and evicted again at start-up. The restart itself, on a
real ``serve.py``, is in ``test_adapter_serving.py`` (the promoted alias serves after a restart); two runtimes on
PostgreSQL in ``test_two_runtimes.py``, whose "fam@1 gone from B" wait timed out now and then under load: the two
sync defects below.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.adapters.names import AdapterError, AdapterRef
from runtime.adapters.registry import AdapterRegistry
from runtime.adapters.sync import RegistrySync, StoreListener


class _Store:
    def __init__(self, adapters: dict[str, dict[str, Any]], aliases: dict[str, str]) -> None:
        self.state = {"adapter": adapters, "alias": {f: {"target": t} for f, t in aliases.items()}}
        self.writes_open = threading.Event()  # a slow database: writes wait until the test opens it
        self.writes_open.set()

    def load_registry(self) -> dict[str, dict[str, dict[str, Any]]]:
        return {k: dict(v) for k, v in self.state.items()}

    def save_registry(self, kind: str, name: str, value: dict[str, Any] | None) -> None:
        self.writes_open.wait(10)
        if value is None:
            self.state[kind].pop(name, None)
        else:
            self.state[kind][name] = value


def _registry(loads: list[str] | None = None, unloads: list[str] | None = None, max_loaded: int = 8) -> AdapterRegistry:
    async def load(ref: AdapterRef) -> None:
        if loads is not None:
            loads.append(ref.name)

    async def unload(name: str) -> None:
        if unloads is not None:
            unloads.append(name)

    return AdapterRegistry(max_loaded=max_loaded, load_fn=load, unload_fn=unload)


async def _validated(ref: AdapterRef) -> AdapterRef:
    return ref


def _adapters(*names: str) -> dict[str, dict[str, Any]]:
    return {n: {"path": f"/adapters/{n}", "sha256": None, "pinned": False} for n in names}


def _restore(names: list[str], aliases: dict[str, str], pinned: set[str], max_loaded: int) -> tuple[AdapterRegistry, list[str], list[str]]:
    loads: list[str] = []
    unloads: list[str] = []
    registry = _registry(loads, unloads, max_loaded)
    adapters = {n: {"path": f"/adapters/{n}", "sha256": None, "pinned": n in pinned} for n in names}
    asyncio.run(RegistrySync(_Store(adapters, aliases), registry, None, _validated).sync_once())
    return registry, loads, unloads


def test_a_learners_many_versions_restore_its_champion_and_the_newest_without_churn() -> None:
    names = [f"fam@{v}" for v in range(1, 7)]  # published in order; the champion is an old one
    registry, loads, unloads = _restore(["keep@1", *names], {"fam": "fam@2"}, {"keep@1"}, max_loaded=4)
    assert loads == ["fam@5", "fam@6", "keep@1", "fam@2"] and unloads == []
    assert registry.aliases() == {"fam": "fam@2"} and registry.resolve("fam").name == "fam@2"


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    max_loaded=st.integers(1, 8),
    data=st.data(),
)
def test_restore_keeps_what_must_serve_and_the_newest_of_the_rest(n: int, max_loaded: int, data: st.DataObject) -> None:
    names = [f"f{k % 3}@{k + 1}" for k in range(n)]  # three families, oldest change first
    must_budget = data.draw(st.integers(0, min(max_loaded, n)))
    must = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=must_budget))
    aliases: dict[str, str] = {}
    pinned: set[str] = set()
    for name in must:  # each must-serve version is an alias target (one per family) or pinned
        family = name.partition("@")[0]
        if family not in aliases and data.draw(st.booleans()):
            aliases[family] = name
        else:
            pinned.add(name)
    registry, loads, unloads = _restore(names, aliases, pinned, max_loaded)
    wanted = set(aliases.values()) | pinned
    rest = [x for x in names if x not in wanted]
    room = max_loaded - len(wanted)
    expected_rest = rest[len(rest) - room :] if room else []  # the newest that fit beside what must serve
    assert unloads == []  # nothing loaded only to be evicted
    assert set(loads) == wanted | set(expected_rest) and len(loads) <= max_loaded
    assert loads[len(loads) - len(wanted) :] == [x for x in names if x in wanted]  # must-serve last, in the store's order
    assert registry.aliases() == aliases


def test_a_sync_never_undoes_this_runtimes_own_alias_flip() -> None:
    """A promotion here queues its write; a sync that read the store before the write landed flipped the alias back
    to the old version until a later sync (the runtime served the demoted version meanwhile)."""

    async def main() -> dict[str, str]:
        store = _Store(_adapters("fam@1", "fam@2"), {"fam": "fam@1"})
        registry = _registry()
        listener = registry.listener = StoreListener(store)
        sync = RegistrySync(store, registry, None, _validated, listener)
        await sync.sync_once()
        assert registry.aliases() == {"fam": "fam@1"}
        store.writes_open.clear()  # the database is slow: the promotion's write waits
        registry.set_alias("fam", "fam@2")
        task = asyncio.create_task(sync.sync_once())
        await asyncio.sleep(0.2)
        store.writes_open.set()
        await task
        await sync.sync_once()  # and once the write has landed, nothing to undo either
        listener.close()
        return registry.aliases()

    assert asyncio.run(main()) == {"fam": "fam@2"}


def test_a_version_removed_from_the_store_while_an_alias_here_still_targets_it_is_unloaded_once_the_alias_moves() -> None:
    """The store moved the alias to fam@2 and removed fam@1 at once. The sync unloaded before flipping aliases, so the
    unload was refused (an alias target) and never tried again: fam@1 stayed loaded here for good."""

    async def main() -> tuple[list[str], set[str], dict[str, str]]:
        unloads: list[str] = []
        store = _Store(_adapters("fam@1", "fam@2"), {"fam": "fam@1"})
        registry = _registry(unloads=unloads)
        sync = RegistrySync(store, registry, None, _validated)
        await sync.sync_once()
        store.state = {"adapter": _adapters("fam@2"), "alias": {"fam": {"target": "fam@2"}}}
        await sync.sync_once()
        return unloads, {a["name"] for a in registry.list()}, registry.aliases()

    unloads, loaded, aliases = asyncio.run(main())
    assert unloads == ["fam@1"] and loaded == {"fam@2"} and aliases == {"fam": "fam@2"}


def test_an_unload_refused_here_is_tried_again_on_the_next_sync() -> None:
    async def main() -> tuple[list[str], list[str]]:
        unloads: list[str] = []
        store = _Store(_adapters("fam@1", "fam@2"), {"fam": "fam@2"})
        registry = _registry(unloads=unloads)
        sync = RegistrySync(store, registry, None, _validated)
        await sync.sync_once()
        lease = registry.acquire("fam@1")  # a request in flight on fam@1
        del store.state["adapter"]["fam@1"]
        unregister = registry.unregister

        async def quick(name: str, **kw: Any) -> None:  # the drain's 30 s timeout, made short
            await unregister(name, **{**kw, "timeout": 0.05})

        registry.unregister = quick  # type: ignore[method-assign]
        await sync.sync_once()
        first = list(unloads)
        registry.release(lease)
        await sync.sync_once()
        return first, unloads

    first, after = asyncio.run(main())
    assert first == [] and after == ["fam@1"]


def test_a_version_whose_folder_is_gone_at_restart_is_skipped_and_served_once_it_is_back(caplog: Any) -> None:
    """The champion's folder was deleted (or its disk not mounted yet) while the runtime was down. The restore loads the
    rest, says which one it could not load, leaves the family's alias unset (a request for ``fam`` is refused rather than
    served by an older version or the base), and a later sync loads it and follows the alias once the folder is back."""
    present = {"fam@1", "other@1"}

    async def validate(ref: AdapterRef) -> AdapterRef:
        if ref.name not in present:
            raise AdapterError(f"{ref.path} is not a folder here")
        return ref

    async def main() -> tuple[list[str], dict[str, str], list[str], dict[str, str]]:
        loads: list[str] = []
        registry = _registry(loads)
        store = _Store(_adapters("fam@1", "fam@2", "other@1"), {"fam": "fam@2", "other": "other@1"})
        sync = RegistrySync(store, registry, None, validate)
        await sync.sync_once()  # start-up: must not raise
        before = (list(loads), registry.aliases())
        present.add("fam@2")
        await sync.sync_once()
        return before[0], before[1], loads, registry.aliases()

    loads_before, aliases_before, loads_after, aliases_after = asyncio.run(main())
    assert sorted(loads_before) == ["fam@1", "other@1"] and aliases_before == {"other": "other@1"}
    assert "cannot load adapter fam@2" in caplog.text and "/adapters/fam@2" in caplog.text
    assert loads_after[-1] == "fam@2" and aliases_after == {"fam": "fam@2", "other": "other@1"}
