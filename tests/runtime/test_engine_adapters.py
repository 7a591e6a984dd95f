"""LoRA adapters in the embedded engine: mixed-adapter batches give each row what it gets alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from runtime.engine import AdapterError, GenerateRequest, SamplingParams
from runtime.engines.embedded import EmbeddedEngine


@pytest.fixture(scope="module")
def adapter_paths(tiny_model_path, tmp_path_factory) -> list[Path]:
    """Two real peft LoRA adapters with large, different weights (so their outputs differ)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    root = tmp_path_factory.mktemp("adapters")
    for k in range(2):
        torch.manual_seed(10 + k)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(tiny_model_path),
            LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False),
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.5)
        model.save_pretrained(root / f"a{k}")
        out.append(root / f"a{k}")
    return out


def run(coro):
    return asyncio.run(coro)


def test_mixed_adapter_batches_match_each_served_alone(tiny_model_path, adapter_paths):
    async def main() -> None:
        eng = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32")
        await eng.start()
        try:
            await eng.load_adapter("fam@1", str(adapter_paths[0]))
            await eng.load_adapter("fam@2", str(adapter_paths[1]))
            assert eng.adapters() == ["fam@1", "fam@2"]
            prompt = tuple(eng.tokenizer.encode("hello world, how are you today", add_special_tokens=False))
            sp = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
            names = [None, "fam@1", "fam@2"]
            alone = {a: (await eng.generate(GenerateRequest(f"alone-{a}", prompt, sp, adapter=a))).output_ids for a in names}
            assert len(set(alone.values())) == 3, "the adapters must change the output for this test to mean anything"
            rows = [a for _ in range(3) for a in names]
            mixed = await asyncio.gather(*(eng.generate(GenerateRequest(f"m{i}", prompt, sp, adapter=a)) for i, a in enumerate(rows)))
            assert [r.output_ids for r in mixed] == [alone[a] for a in rows]
        finally:
            await eng.close()

    run(main())


def test_adapter_errors(tiny_model_path, adapter_paths, tmp_path):
    async def main() -> None:
        eng = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32")
        await eng.start()
        try:
            prompt = tuple(eng.tokenizer.encode("hi", add_special_tokens=False))
            with pytest.raises(AdapterError, match="not loaded"):
                await eng.generate(GenerateRequest("x", prompt, SamplingParams(max_new_tokens=2), adapter="nope@1"))
            with pytest.raises(AdapterError, match="could not load"):
                await eng.load_adapter("bad@1", str(tmp_path / "missing"))
            assert eng.adapters() == []
            await eng.load_adapter("ok@1", str(adapter_paths[0]))
            with pytest.raises(AdapterError, match="already loaded"):
                await eng.load_adapter("ok@1", str(adapter_paths[1]))
            # serving continues after the failures, with and without the adapter
            sp = SamplingParams(max_new_tokens=3, temperature=0)
            assert len((await eng.generate(GenerateRequest("y", prompt, sp, adapter="ok@1"))).output_ids) >= 1
            assert len((await eng.generate(GenerateRequest("z", prompt, sp))).output_ids) >= 1
            await eng.unload_adapter("ok@1")
            with pytest.raises(AdapterError, match="not loaded"):
                await eng.unload_adapter("ok@1")
        finally:
            await eng.close()

    run(main())


def test_unload_is_refused_while_a_request_uses_the_adapter(tiny_model_path, adapter_paths):
    async def main() -> None:
        eng = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32")
        await eng.start()
        try:
            await eng.load_adapter("busy@1", str(adapter_paths[0]))
            prompt = tuple(eng.tokenizer.encode("hello", add_special_tokens=False))
            sp = SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True)
            chunks = eng.stream(GenerateRequest("long", prompt, sp, adapter="busy@1"))
            await anext(chunks)  # the row is running
            with pytest.raises(AdapterError, match="in flight"):
                await eng.unload_adapter("busy@1")
            assert eng.stats()["adapter_unloads_refused"] == 1 and eng.adapters() == ["busy@1"]
            n = 1 + sum([1 async for _ in chunks])  # the request is unharmed and finishes
            assert n == 300
            await eng.unload_adapter("busy@1")
            assert eng.adapters() == [] and eng.stats()["adapter_unloads"] == 1
            with pytest.raises(AdapterError, match="not loaded"):
                await eng.generate(GenerateRequest("after", prompt, sp, adapter="busy@1"))
        finally:
            await eng.close()

    run(main())


def test_concurrent_loads_of_one_name_load_it_once(tiny_model_path, adapter_paths):
    async def main() -> None:
        eng = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32")
        await eng.start()
        try:
            results = await asyncio.gather(*(eng.load_adapter("dup@1", str(p)) for p in adapter_paths), return_exceptions=True)
            assert sum(r is None for r in results) == 1
            assert all("already loaded" in str(r) for r in results if r is not None)
            assert eng.adapters() == ["dup@1"]
        finally:
            await eng.close()

    run(main())
