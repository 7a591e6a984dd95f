"""A runtime restores its adapters and aliases from its store at start-up (``runtime/adapters/sync.py``).

The registry is the real one; the store is a dict in ``load_registry``'s shape (oldest change first), and loading
records the order. What must serve (alias targets, pinned versions) is loaded last and never evicted; of the rest
only the newest that fit are loaded, so nothing is loaded and evicted again at start-up. The restart itself, on a
real ``serve.py``, is in ``test_adapter_serving.py`` (the promoted alias serves after a restart).
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.adapters.names import AdapterRef
from runtime.adapters.registry import AdapterRegistry
from runtime.adapters.sync import RegistrySync


class _Store:
    def __init__(self, adapters: dict[str, dict[str, Any]], aliases: dict[str, str]) -> None:
        self.state = {"adapter": adapters, "alias": {f: {"target": t} for f, t in aliases.items()}}

    def load_registry(self) -> dict[str, dict[str, dict[str, Any]]]:
        return self.state


def _restore(names: list[str], aliases: dict[str, str], pinned: set[str], max_loaded: int) -> tuple[AdapterRegistry, list[str], list[str]]:
    loads: list[str] = []
    unloads: list[str] = []

    async def load(ref: AdapterRef) -> None:
        loads.append(ref.name)

    async def unload(name: str) -> None:
        unloads.append(name)

    async def validated(ref: AdapterRef) -> AdapterRef:
        return ref

    registry = AdapterRegistry(max_loaded=max_loaded, load_fn=load, unload_fn=unload)
    adapters = {n: {"path": f"/adapters/{n}", "sha256": None, "pinned": n in pinned} for n in names}
    asyncio.run(RegistrySync(_Store(adapters, aliases), registry, None, validated).sync_once())
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
