"""Adapter names, validation against the tiny base model (real PEFT adapters), and registry semantics.

Validation tests build real LoRA adapters with peft on the tiny Llama (and one on a hidden-size-32 Llama
for the shape mismatch). Registry tests use async fakes for the engine's load/unload and run each
scenario with ``asyncio.run`` (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from runtime.adapters.names import (
    AdapterCapacity,
    AdapterError,
    AdapterExists,
    AdapterInUse,
    AdapterInvalid,
    AdapterNotFound,
    AdapterRef,
    parse_model_name,
)
from runtime.adapters.registry import AdapterRegistry
from runtime.adapters.validation import base_shapes_of, validate_adapter


# ---------------------------------------------------------------- fixtures
def _save_lora(model, out: Path, r: int = 4) -> Path:
    from peft import LoraConfig, get_peft_model

    get_peft_model(model, LoraConfig(r=r, target_modules=["q_proj", "v_proj"])).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def base_shapes(tiny_model_path: Path) -> dict[str, tuple[int, int]]:
    from transformers import AutoModelForCausalLM

    return base_shapes_of(AutoModelForCausalLM.from_pretrained(tiny_model_path))


@pytest.fixture(scope="module")
def good_adapter(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    return _save_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path_factory.mktemp("lora") / "good")


@pytest.fixture(scope="module")
def narrow_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=2000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return _save_lora(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("lora") / "narrow")


@pytest.fixture
def adapter(good_adapter: Path, tmp_path: Path) -> Path:
    """A private copy of the good adapter, safe to break."""
    return Path(shutil.copytree(good_adapter, tmp_path / "root" / "a"))


def check(path: Path, base_shapes, **kw) -> dict:
    kw.setdefault("max_rank", 16)
    kw.setdefault("adapter_root", None)
    return validate_adapter(path, base_shapes=base_shapes, **kw)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- validation
def test_real_peft_adapter_validates(adapter: Path, base_shapes) -> None:
    config = check(adapter, base_shapes, adapter_root=adapter.parent, expected_sha256=sha(adapter / "adapter_model.safetensors"))
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert set(config["target_modules"]) == {"q_proj", "v_proj"}
    assert ("model.layers.0.self_attn.q_proj") in base_shapes


def test_module_import_does_not_load_torch_or_safetensors() -> None:
    import subprocess
    import sys

    code = (
        "import sys, runtime.adapters.names, runtime.adapters.validation, runtime.adapters.registry;"
        " print('torch' in sys.modules, 'safetensors' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_base_name_mismatch_only_warns(adapter: Path, base_shapes, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="runtime.adapters.validation"):
        check(adapter, base_shapes, base_name_or_path="/elsewhere/tiny")
    assert "/elsewhere/tiny" in caplog.text


def test_refuses_adapter_built_on_another_hidden_size(narrow_adapter: Path, base_shapes) -> None:
    with pytest.raises(AdapterInvalid, match="in-features 32 != base in-features 64"):
        check(narrow_adapter, base_shapes)


def test_refuses_rank_over_limit(adapter: Path, base_shapes) -> None:
    with pytest.raises(AdapterInvalid, match="rank 4 exceeds the server's max rank 2"):
        check(adapter, base_shapes, max_rank=2)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: (a / "adapter_config.json").unlink(), "has no adapter_config.json"),
        (lambda a: (a / "adapter_config.json").write_text("{not json"), "is not a JSON object"),
        (lambda a: (a / "adapter_model.safetensors").unlink(), "has no adapter_model.safetensors"),
        (lambda a: _truncate(a / "adapter_model.safetensors"), "unreadable or corrupt"),
        (lambda a: (a / "adapter_model.safetensors").write_bytes(b"garbage"), "unreadable or corrupt"),
        (lambda a: _edit_config(a, peft_type="IA3"), "only 'LORA'"),
        (lambda a: _edit_config(a, target_modules=["q_proj", "w_fancy"]), r"\['w_fancy'\] match no module"),
        (lambda a: _edit_config(a, target_modules=r".*\.nope"), "matches no module"),
        (lambda a: shutil.rmtree(a), "does not exist"),
        (lambda a: _edit_config(a, use_dora=True), "DoRA"),
        (lambda a: _edit_config(a, modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda a: _edit_config(a, bias="all"), "bias='all'"),
    ],
    ids=[
        *("no-config", "bad-json", "no-weights", "truncated", "garbage", "not-lora", "target-missing", "target-regex", "no-dir"),
        *("dora", "modules-to-save", "bias"),
    ],
)
def test_refusals(adapter: Path, base_shapes, mutate, match: str) -> None:
    mutate(adapter)
    with pytest.raises(AdapterInvalid, match=match):
        check(adapter, base_shapes)


def test_refuses_a_file_as_adapter_path(adapter: Path, base_shapes) -> None:
    with pytest.raises(AdapterInvalid, match="is not a directory"):
        check(adapter / "adapter_config.json", base_shapes)


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _edit_config(a: Path, **changes) -> None:
    cfg = json.loads((a / "adapter_config.json").read_text())
    (a / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))


def test_refuses_tensors_for_a_module_the_base_lacks(adapter: Path, base_shapes) -> None:
    shapes = {k: v for k, v in base_shapes.items() if not k.endswith("layers.1.self_attn.v_proj")}
    with pytest.raises(AdapterInvalid, match=r"'model.layers.1.self_attn.v_proj', which is not a module"):
        check(adapter, shapes)


def test_refuses_paths_outside_the_adapter_root(adapter: Path, base_shapes, tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = Path(shutil.copytree(adapter, tmp_path / "outside"))
    with pytest.raises(AdapterInvalid, match="outside the adapter root"):
        check(outside, base_shapes, adapter_root=root)
    with pytest.raises(AdapterInvalid, match="outside the adapter root"):
        check(root / ".." / "outside", base_shapes, adapter_root=root)
    (root / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(AdapterInvalid, match="outside the adapter root"):
        check(root / "link", base_shapes, adapter_root=root)
    # a file symlinked out of the root is refused too
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(AdapterInvalid, match="adapter_model.safetensors .* outside the adapter root"):
        check(adapter, base_shapes, adapter_root=root)
    check(adapter, base_shapes, adapter_root=tmp_path)  # fine once the root covers it


def test_sha256_of_weights(adapter: Path, base_shapes) -> None:
    with pytest.raises(AdapterInvalid, match="sha256 of adapter_model.safetensors does not match"):
        check(adapter, base_shapes, expected_sha256="0" * 64)


def test_manifest_hashes(adapter: Path, base_shapes) -> None:
    files = {n: sha(adapter / n) for n in ("adapter_model.safetensors", "adapter_config.json")}
    (adapter / "manifest.json").write_text(json.dumps({"files": files}))
    check(adapter, base_shapes, expected_sha256=sha(adapter / "manifest.json"))
    with pytest.raises(AdapterInvalid, match="sha256 of manifest.json does not match"):
        check(adapter, base_shapes, expected_sha256=files["adapter_model.safetensors"])
    _edit_config(adapter, lora_alpha=99)  # tampered after publishing
    with pytest.raises(AdapterInvalid, match="adapter_config.json is missing or does not match"):
        check(adapter, base_shapes)
    (adapter / "manifest.json").write_text(json.dumps({"files": [{"path": "adapter_config.json", "sha256": sha(adapter / "adapter_config.json")}]}))
    with pytest.raises(AdapterInvalid, match="does not list adapter_model.safetensors"):
        check(adapter, base_shapes)


# ---------------------------------------------------------------- names
def test_adapter_ref_names() -> None:
    assert AdapterRef("tools-agent", 7, "/a").name == "tools-agent@7"
    for family, version in [("", 1), ("-x", 1), ("a b", 1), ("a" * 65, 1), ("ok", 0), ("ok", True)]:
        with pytest.raises(AdapterInvalid):
            AdapterRef(family, version, "/a")


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("tiny", ("base", None)),
        ("tools-agent", ("alias", "tools-agent")),
        ("tools-agent@2", ("version", "tools-agent@2")),
        ("tiny:tools-agent", ("alias", "tools-agent")),
        ("tiny:family@2", ("version", "family@2")),
        ("org/base-7b:family@12", ("version", "family@12")),
    ],
)
def test_parse_model_name(model: str, expected) -> None:
    base = "org/base-7b" if model.startswith("org/") else "tiny"
    assert parse_model_name(model, base) == expected


@pytest.mark.parametrize("model", ["", "tiny:", "other:fam", "fam@", "fam@0", "fam@02", "fam@x", "a b", "tiny:fam@1@2", "-fam"])
def test_parse_model_name_refuses(model: str) -> None:
    with pytest.raises(AdapterNotFound):
        parse_model_name(model, "tiny")


# ---------------------------------------------------------------- registry
class FakeEngine:
    """Records its calls; ``capacity`` (None: no limit) refuses a load when full, as SGLang's ``--max-loaded-loras``
    does; ``gate`` (when set) holds every load until it is set; ``peak`` is the most adapters it ever held."""

    def __init__(self, fail: set[str] = frozenset(), capacity: int | None = None) -> None:
        self.loaded: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self.fail = set(fail)
        self.capacity = capacity
        self.gate: asyncio.Event | None = None
        self.peak = 0

    async def load(self, ref: AdapterRef) -> None:
        await asyncio.sleep(0)
        self.calls.append(("load", ref.name))
        if self.gate is not None:
            await self.gate.wait()
        if ref.name in self.fail:
            raise RuntimeError(f"cannot load {ref.name}")
        if self.capacity is not None and len(self.loaded) >= self.capacity:
            raise RuntimeError(f"{len(self.loaded)} adapters loaded: no slot for {ref.name}")
        self.loaded.append(ref.name)
        self.peak = max(self.peak, len(self.loaded))

    async def unload(self, name: str) -> None:
        await asyncio.sleep(0)
        self.calls.append(("unload", name))
        self.loaded.remove(name)


def registry(max_loaded: int = 8, fail: set[str] = frozenset(), capacity: int | None = None) -> tuple[AdapterRegistry, FakeEngine]:
    eng = FakeEngine(fail, capacity)
    return AdapterRegistry(max_loaded=max_loaded, load_fn=eng.load, unload_fn=eng.unload), eng


def ref(family: str, version: int, pinned: bool = False, path: str | None = None) -> AdapterRef:
    return AdapterRef(family, version, path or f"/adapters/{family}/{version}", pinned=pinned)


def test_versions_are_immutable_and_next_version_counts_up() -> None:
    async def main() -> None:
        reg, eng = registry()
        assert reg.next_version("fam") == 1
        await reg.register(ref("fam", 1))
        await reg.register(ref("fam", 3))
        assert reg.next_version("fam") == 4 and reg.next_version("other") == 1
        with pytest.raises(AdapterExists, match="fam@4"):
            await reg.register(ref("fam", 1, path="/new/weights"))
        assert eng.calls == [("load", "fam@1"), ("load", "fam@3")]
        await reg.unregister("fam@3")
        assert reg.next_version("fam") == 4  # a retired version still counts
        with pytest.raises(AdapterExists, match="served before from other files"):
            await reg.register(ref("fam", 3, path="/new/weights"))
        await reg.register(ref("fam", 3))  # reloading the very same files is allowed

    asyncio.run(main())


def test_failed_load_is_never_registered() -> None:
    async def main() -> None:
        reg, eng = registry(fail={"fam@1"})
        with pytest.raises(RuntimeError, match="cannot load"):
            await reg.register(ref("fam", 1), make_alias=True)
        assert reg.list() == [] and reg.aliases() == {}
        with pytest.raises(AdapterNotFound):
            reg.acquire("fam@1")
        eng.fail.clear()
        await reg.register(ref("fam", 1), make_alias=True)  # the name was never taken
        assert reg.resolve("fam").name == "fam@1"

    asyncio.run(main())


def test_alias_flip_is_atomic_and_checked() -> None:
    async def main() -> None:
        reg, _ = registry()
        await reg.register(ref("fam", 1), make_alias=True)
        await reg.register(ref("fam", 2))
        await reg.register(ref("other", 1))
        old = reg.acquire("fam")
        reg.set_alias("fam", "fam@2")
        new = reg.acquire("fam")
        assert (old.name, new.name) == ("fam@1", "fam@2")  # in-flight keeps its version, new requests see the flip
        assert reg.aliases() == {"fam": "fam@2"}
        with pytest.raises(AdapterInvalid, match="can only point at fam@N"):
            reg.set_alias("fam", "other@1")
        with pytest.raises(AdapterNotFound):
            reg.set_alias("fam", "fam@9")
        assert reg.aliases() == {"fam": "fam@2"}  # failed flips change nothing
        with pytest.raises(AdapterNotFound):
            reg.resolve("other")  # no alias was made for it

    asyncio.run(main())


def test_acquire_release_counts_and_lease() -> None:
    async def main() -> None:
        reg, _ = registry()
        await reg.register(ref("fam", 1), make_alias=True)
        a = reg.acquire("fam")
        reg.acquire("fam@1")
        (row,) = reg.list()
        assert row["in_flight"] == 2 and row["aliases"] == ["fam"] and row["last_used"] is not None
        async with reg.lease("fam") as leased:
            assert leased == a and reg.list()[0]["in_flight"] == 3
        reg.release(a)
        reg.release(a)
        assert reg.list()[0]["in_flight"] == 0
        with pytest.raises(AdapterError, match="without a matching acquire"):
            reg.release(a)

    asyncio.run(main())


def test_unregister_waits_for_in_flight_requests_to_drain() -> None:
    async def main() -> None:
        reg, eng = registry()
        await reg.register(ref("fam", 1))
        held = reg.acquire("fam@1")
        task = asyncio.create_task(reg.unregister("fam@1"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert ("unload", "fam@1") not in eng.calls and not task.done()
        with pytest.raises(AdapterNotFound):
            reg.acquire("fam@1")  # out of routing immediately
        assert [r["state"] for r in reg.list()] == ["draining"]
        reg.release(held)
        await asyncio.wait_for(task, 1)
        assert eng.calls[-1] == ("unload", "fam@1") and eng.loaded == [] and reg.list() == []

    asyncio.run(main())


def test_unregister_timeout_leaves_it_routed() -> None:
    async def main() -> None:
        reg, eng = registry()
        await reg.register(ref("fam", 1))
        held = reg.acquire("fam@1")
        with pytest.raises(AdapterInUse, match="1 request"):
            await reg.unregister("fam@1", timeout=0.01)
        assert reg.resolve("fam@1") == held and eng.loaded == ["fam@1"]
        task = asyncio.create_task(reg.unregister("fam@1"))
        await asyncio.sleep(0)
        task.cancel()  # a cancelled unregister also leaves it routed
        with pytest.raises(asyncio.CancelledError):
            await task
        assert reg.resolve("fam@1") == held and reg.list()[0]["state"] == "ready"
        reg.release(held)
        await reg.unregister("fam@1")
        assert eng.loaded == []

    asyncio.run(main())


def test_alias_target_cannot_be_unregistered_until_moved() -> None:
    async def main() -> None:
        reg, eng = registry()
        await reg.register(ref("fam", 1), make_alias=True)
        await reg.register(ref("fam", 2))
        with pytest.raises(AdapterInUse, match="alias"):
            await reg.unregister("fam@1")
        assert reg.resolve("fam").name == "fam@1"
        reg.set_alias("fam", "fam@2")
        await reg.unregister("fam@1")
        assert eng.loaded == ["fam@2"]
        with pytest.raises(AdapterNotFound):
            await reg.unregister("fam@1")

    asyncio.run(main())


def test_lru_eviction_skips_pinned_in_flight_and_alias_targets() -> None:
    async def main() -> None:
        reg, eng = registry(max_loaded=5)
        await reg.register(ref("pinned", 1, pinned=True))  # the oldest ones are all protected
        busy = await reg.register(ref("busy", 1))
        await reg.register(ref("champ", 1), make_alias=True)
        await reg.register(ref("idle", 1))
        await reg.register(ref("idle", 2))
        reg.acquire("busy@1")
        async with reg.lease("idle@1"):  # idle@1 used recently → idle@2 is least recently used
            pass
        await reg.register(ref("x", 1))
        await reg.settled()  # the victim is unloaded once its successor routes
        assert eng.calls[-2:] == [("load", "x@1"), ("unload", "idle@2")]
        await reg.register(ref("y", 1))
        await reg.settled()
        assert eng.calls[-2:] == [("load", "y@1"), ("unload", "idle@1")]
        assert sorted(eng.loaded) == ["busy@1", "champ@1", "pinned@1", "x@1", "y@1"]
        with pytest.raises(AdapterNotFound):
            reg.acquire("idle@1")  # evicted adapters are out of routing

        # nothing evictable → AdapterCapacity, and the engine is not asked to load anything
        reg.acquire("x@1")
        reg.acquire("y@1")
        n_calls = len(eng.calls)
        with pytest.raises(AdapterCapacity, match="none is evictable"):
            await reg.register(ref("z", 1))
        assert len(eng.calls) == n_calls and "z@1" not in {r["name"] for r in reg.list()}
        reg.release(busy)  # busy@1 drains → evictable again
        await reg.register(ref("z", 1))
        await reg.settled()
        assert eng.calls[-2:] == [("load", "z@1"), ("unload", "busy@1")]
        assert eng.peak == 6  # one over max_loaded, for the moment of each handover
        assert len(reg.list()) == 5

    asyncio.run(main())


def test_a_hot_swap_at_capacity_loads_before_it_unloads() -> None:
    """At capacity the victim leaves routing at once but stays loaded (listed as draining) while its successor
    loads; the successor routes, and only then is the victim unloaded: the swap waits for one engine call. The
    next engine call waits for that unload, so the engine never holds more than one adapter over max_loaded."""

    async def main() -> None:
        reg, eng = registry(max_loaded=2)
        await reg.register(ref("fam", 1), make_alias=True)
        await reg.register(ref("old", 1))
        eng.gate = asyncio.Event()
        swap = asyncio.create_task(reg.register(ref("fam", 2), make_alias=True))
        await asyncio.sleep(0.01)
        assert eng.calls[-1] == ("load", "fam@2") and "old@1" in eng.loaded
        assert {r["name"]: r["state"] for r in reg.list()} == {"fam@1": "ready", "old@1": "draining"}
        with pytest.raises(AdapterNotFound):
            reg.acquire("old@1")
        assert reg.resolve("fam").name == "fam@1"  # the alias flips with the load, not before
        eng.gate.set()
        await swap
        assert reg.resolve("fam").name == "fam@2"
        await reg.register(ref("other", 1))  # waits for old@1's unload before its own engine calls
        await reg.settled()
        assert [c for c in eng.calls if c[0] == "unload"] == [("unload", "old@1"), ("unload", "fam@1")]
        assert eng.calls.index(("unload", "old@1")) < eng.calls.index(("load", "other@1"))
        assert sorted(eng.loaded) == ["fam@2", "other@1"] and eng.peak == 3
        assert sorted(r["name"] for r in reg.list()) == ["fam@2", "other@1"]

    asyncio.run(main())


def test_an_engine_without_a_spare_slot_gets_the_victim_unloaded_first() -> None:
    """An engine that refuses the extra adapter (SGLang at ``--max-loaded-loras``): the victim is unloaded and
    the load is tried once more, so the swap still lands."""

    async def main() -> None:
        reg, eng = registry(max_loaded=2, capacity=2)
        await reg.register(ref("a", 1))
        await reg.register(ref("b", 1))
        await reg.register(ref("c", 1), make_alias=True)
        await reg.settled()
        assert eng.calls[-3:] == [("load", "c@1"), ("unload", "a@1"), ("load", "c@1")]
        assert sorted(eng.loaded) == ["b@1", "c@1"] and reg.resolve("c").name == "c@1"
        assert sorted(r["name"] for r in reg.list()) == ["b@1", "c@1"]

    asyncio.run(main())


def test_a_failed_or_cancelled_swap_at_capacity() -> None:
    """A load cancelled while the victim is still loaded routes the victim again; a load that fails beside it and
    again after it was unloaded raises, and the registry holds neither (the victim was evicted, as before)."""

    async def main() -> None:
        reg, eng = registry(max_loaded=1, fail={"bad@1"})
        await reg.register(ref("keep", 1))
        eng.gate = asyncio.Event()
        task = asyncio.create_task(reg.register(ref("new", 1)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert reg.acquire("keep@1").name == "keep@1" and eng.loaded == ["keep@1"]
        reg.release(reg.resolve("keep@1"))
        eng.gate = None
        with pytest.raises(RuntimeError, match="cannot load bad@1"):
            await reg.register(ref("bad", 1))
        assert eng.calls[-3:] == [("load", "bad@1"), ("unload", "keep@1"), ("load", "bad@1")]
        assert reg.list() == [] and eng.loaded == []
        await reg.register(ref("next", 1))  # and the registry goes on
        assert [r["name"] for r in reg.list()] == ["next@1"]

    asyncio.run(main())


def test_draining_adapters_count_towards_capacity() -> None:
    async def main() -> None:
        reg, eng = registry(max_loaded=2)
        await reg.register(ref("a", 1))
        await reg.register(ref("b", 1), make_alias=True)
        held = reg.acquire("a@1")
        task = asyncio.create_task(reg.unregister("a@1"))
        await asyncio.sleep(0)
        with pytest.raises(AdapterCapacity, match="1 draining"):
            await reg.register(ref("c", 1))
        reg.release(held)
        await task
        await reg.register(ref("c", 1))
        assert sorted(eng.loaded) == ["b@1", "c@1"]

    asyncio.run(main())


def test_unregister_during_register_is_serialised() -> None:
    async def main() -> None:
        reg, eng = registry()
        await reg.register(ref("a", 1))
        await asyncio.gather(reg.register(ref("b", 1)), reg.unregister("a@1"), reg.register(ref("c", 1)))
        assert sorted(eng.loaded) == ["b@1", "c@1"]
        assert [c[0] for c in eng.calls].count("load") == 3

    asyncio.run(main())
