"""A session stays on the adapter version it started on, and a session belongs to its owner (``runtime/adapters/routing.py``).

Sessions are names the clients choose (``X-Session-Id``, ``user``), so two keys can use the same one: a pin keyed by the
name alone let one key decide which version served another key's conversation, and its 100,000 oldest-first entries
let one key flood everyone's pins out. The registry is the real one; the model calls are not made.
"""

from __future__ import annotations

import asyncio

import pytest

from runtime.adapters import routing
from runtime.adapters.names import AdapterRef
from runtime.adapters.registry import AdapterRegistry
from runtime.adapters.routing import ModelRouter


async def _nothing(*_: object) -> None:
    return None


def _router(*versions: int) -> tuple[ModelRouter, AdapterRegistry]:
    registry = AdapterRegistry(max_loaded=8, load_fn=_nothing, unload_fn=_nothing)
    for v in versions:
        asyncio.run(registry.register(AdapterRef(family="fam", version=v, path=f"/a/fam/v{v}"), make_alias=(v == versions[0])))
    return ModelRouter(registry, None, "base"), registry


def _serve(router: ModelRouter, registry: AdapterRegistry, session: str, owner: str) -> str:
    ref = router("fam", session, None, owner)
    assert ref is not None
    registry.release(ref)
    return ref.name


def test_one_keys_session_never_pins_what_another_keys_session_of_the_same_name_gets() -> None:
    router, registry = _router(1, 2)
    assert _serve(router, registry, "user-1", "key-b") == "fam@1"
    registry.set_alias("fam", "fam@2")
    assert _serve(router, registry, "user-1", "key-a") == "fam@2"  # a new conversation of key A: the current champion
    assert _serve(router, registry, "user-1", "key-b") == "fam@1"  # key B's conversation stays where it started


def test_a_key_flooding_session_names_forgets_only_its_own_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "MAX_PINS", 5)
    router, registry = _router(1, 2)
    assert _serve(router, registry, "chat", "key-a") == "fam@1"
    registry.set_alias("fam", "fam@2")
    for i in range(50):
        _serve(router, registry, f"flood-{i}", "key-b")
    assert _serve(router, registry, "chat", "key-a") == "fam@1"


def test_the_pins_kept_are_the_most_recently_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "MAX_PINS", 3)
    router, registry = _router(1, 2)
    for s in ("old", "a", "b"):
        _serve(router, registry, s, "key-a")
    registry.set_alias("fam", "fam@2")
    _serve(router, registry, "old", "key-a")  # used again: the most recent now
    _serve(router, registry, "new", "key-a")  # a fourth session: the least recently used ("a") is forgotten
    assert [_serve(router, registry, s, "key-a") for s in ("old", "a", "b")] == ["fam@1", "fam@2", "fam@2"]


def test_a_deleted_session_starts_again_on_the_alias() -> None:
    router, registry = _router(1, 2)
    _serve(router, registry, "chat", "key-a")
    _serve(router, registry, "chat", "key-b")
    registry.set_alias("fam", "fam@2")
    router.forget_session("key-a", "chat")
    assert _serve(router, registry, "chat", "key-a") == "fam@2"
    assert _serve(router, registry, "chat", "key-b") == "fam@1"  # the other key's session of that name is untouched
