"""Batched LoRA (``runtime.engines.lora_batch``) against peft on the tiny model: numbers, refusals, attach/detach."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.engine import AdapterError, EngineError
from runtime.engines.cpu_linear import pack_linears
from runtime.engines.lora_batch import LoraBank
from runtime.engines.lora_weights import read_lora

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig kwargs: several ranks, rslora, rank/alpha patterns, different target sets
SPECS: dict[str, dict] = {
    "r2": dict(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj"]),
    "r4-rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=ALL),
    "r8-patterns": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "down_proj"],
        rank_pattern={"k_proj": 3},
        alpha_pattern={"layers.1.self_attn.q_proj": 2},
    ),
    "r1-mlp": dict(r=1, lora_alpha=1, target_modules=["gate_proj", "up_proj"]),
}


def _base(tiny_model_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora-batch")
    out = {}
    for k, (name, spec) in enumerate(SPECS.items()):
        torch.manual_seed(100 + k)
        model = get_peft_model(_base(tiny_model_path), LoraConfig(init_lora_weights=False, **spec))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.normal_(0, 0.3)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_path, adapters) -> tuple[torch.Tensor, dict[str | None, torch.Tensor], dict[str, torch.Tensor]]:
    """Input ids (B, T) and, per adapter (None = base), peft's unmerged logits and merged logits for them."""
    from peft import PeftModel

    torch.manual_seed(0)
    ids = torch.randint(3, 200, (5, 7))  # (B, T)
    unmerged: dict[str | None, torch.Tensor] = {}
    merged: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        unmerged[None] = _base(tiny_model_path)(input_ids=ids).logits
        for name, path in adapters.items():
            peft = PeftModel.from_pretrained(_base(tiny_model_path), str(path)).eval()
            unmerged[name] = peft(input_ids=ids).logits
            merged[name] = peft.merge_and_unload()(input_ids=ids).logits
    return ids, unmerged, merged


@pytest.fixture
def bank(tiny_model_path, adapters) -> LoraBank:
    model = _base(tiny_model_path)
    pack_linears(model)  # as the engine serves it: LoRA sites in front of oneDNN-packed linears
    b = LoraBank(model)
    for name, path in adapters.items():
        b.attach(name, read_lora(path, b.targets))
    return b


def _forward(bank: LoraBank, ids: torch.Tensor, rows: list[str | None]) -> torch.Tensor:
    with torch.inference_mode(), bank.rows(rows, tokens=ids.numel()):
        return bank._model(input_ids=ids).logits  # (B, T, V)


def test_each_adapter_alone_matches_peft_unmerged_and_merged(bank, reference) -> None:
    ids, unmerged, merged = reference
    for name in [None, *SPECS]:
        ours = _forward(bank, ids, [name] * ids.shape[0])
        torch.testing.assert_close(ours, unmerged[name], rtol=1e-4, atol=1e-4)
        if name is not None:
            torch.testing.assert_close(ours, merged[name], rtol=1e-4, atol=1e-4)
            assert not torch.allclose(ours, unmerged[None], atol=1e-3), f"{name} must change the logits for this test to mean anything"


@pytest.mark.parametrize("stacked", [True, False], ids=["masked-stack", "grouped"])
def test_mixed_rows_match_each_adapter_alone(bank, reference, stacked: bool) -> None:
    ids, unmerged, _ = reference
    if not stacked:
        bank.max_stacked_rank = 0  # force the index_select / index_add_ path
        bank.small_tokens = 0  # and the thread-pool path (decode-sized forwards run LoRA GEMMs inline)
    for rows in (
        ["r2", None, "r4-rslora", "r8-patterns", "r1-mlp"],
        [None, "r8-patterns", None, "r8-patterns", "r2"],
        ["r2", "r2", None, None, "r2"],
    ):
        ours = _forward(bank, ids, rows)
        for i, name in enumerate(rows):
            torch.testing.assert_close(ours[i], unmerged[name][i], rtol=1e-4, atol=1e-4, msg=f"row {i} ({name}) of {rows}")


def test_detach_restores_the_base_and_reattach_works(bank, reference, adapters) -> None:
    ids, unmerged, _ = reference
    for name in SPECS:
        bank.detach(name)
    assert bank.names() == []
    torch.testing.assert_close(_forward(bank, ids, [None] * 5), unmerged[None], rtol=1e-5, atol=1e-5)
    with pytest.raises(EngineError, match="not loaded"):
        _forward(bank, ids, ["r2"] * 5)
    bank.attach("again", read_lora(adapters["r2"], bank.targets))
    torch.testing.assert_close(_forward(bank, ids, ["again"] * 5), unmerged["r2"], rtol=1e-4, atol=1e-4)
    with pytest.raises(AdapterError, match="already loaded"):
        bank.attach("again", read_lora(adapters["r2"], bank.targets))
    with pytest.raises(AdapterError, match="not loaded"):
        bank.detach("r2")


def _edit(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))


def test_read_lora_refuses_what_it_cannot_serve(adapters, tiny_model_path, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    targets = LoraBank(_base(tiny_model_path)).targets
    cases = {
        "dora": (lambda p: _edit(p, use_dora=True), "DoRA"),
        "modules-to-save": (lambda p: _edit(p, modules_to_save=["lm_head"]), "modules_to_save"),
        "rank-mismatch": (lambda p: _edit(p, r=3), "config says r=3"),
        "not-lora": (lambda p: _edit(p, peft_type="IA3"), "not a PEFT LoRA"),
        "truncated": (lambda p: (p / "adapter_model.safetensors").write_bytes(b"\0" * 16), "could not read adapter_model"),
        "extra-tensor": (
            lambda p: save_file(
                {**load_file(p / "adapter_model.safetensors"), "base_model.model.lm_head.weight": torch.zeros(2, 2)}, p / "adapter_model.safetensors"
            ),
            "not a lora_A/lora_B weight",
        ),
    }
    for case, (mutate, match) in cases.items():
        p = tmp_path / case
        shutil.copytree(adapters["r2"], p)
        mutate(p)
        with pytest.raises(AdapterError, match=match):
            read_lora(p, targets)
    with pytest.raises(AdapterError, match="could not read adapter_config"):
        read_lora(tmp_path / "missing", targets)
