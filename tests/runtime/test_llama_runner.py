"""The embedded engine's runners against the definition: logits equal the model's full forward over each sequence so far.

A small scheduler drives a runner the way the engine does (prompts in chunks under a token budget,
mixed with decode rows; rows leaving; a row outgrowing its KV pool), and every step's logits are
compared with ``model(input_ids=<the whole sequence>)``'s last position: any wrong KV column, position,
mask or row mix-up shows as a different number.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.engines.hf_runner import HFRunner
from runtime.engines.llama_runner import LlamaRunner, fits
from runtime.engines.lora_batch import LoraBank
from runtime.engines.runner import Chunk, DecodeRow

PROMPTS = (5, 23, 40, 3)  # prompt lengths; the 40-token one goes past the first pool (cap 8) while prefilled
NEW = (12, 6, 9, 30)  # tokens each generates; the 3-token prompt grows through the 8- and 32-token pools
BUDGET = 16  # prompt tokens per step


def _model(path: Path, dtype: torch.dtype) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _runner(kind: str, model: Any) -> Any:
    if kind == "transformers":
        HFRunner.prepare(model)
        return HFRunner(model, LoraBank(model))
    return LlamaRunner(model, LoraBank(model), max_len=2048, first_cap=8)


def _drive(runner: Any, check: Callable[[torch.Tensor, list[int], str], None], vocab: int) -> None:
    """Run every prompt to completion, greedy; ``check(logits_row, sequence_so_far, where)`` sees every logits row."""
    g = torch.Generator().manual_seed(1)
    seqs = [
        {"key": i, "ids": torch.randint(3, vocab, (n,), generator=g).tolist(), "fed": 0, "out": [], "new": m}
        for i, (n, m) in enumerate(zip(PROMPTS, NEW, strict=True))
    ]
    waiting = list(seqs)
    prefilling: list[dict] = []
    running: list[dict] = []
    checked = 0
    step = 0
    with torch.inference_mode():
        while waiting or prefilling or running:
            if waiting and (step % 3 == 0 or not (prefilling or running)):  # arrivals spread over the steps
                seq = waiting.pop(0)
                runner.begin(seq["key"], len(seq["ids"]))
                prefilling.append(seq)
            step += 1
            chunks, budget = [], BUDGET
            for seq in prefilling:
                n = min(budget, len(seq["ids"]) - seq["fed"])
                if n <= 0:
                    break
                chunks.append((seq, Chunk(seq["key"], seq["ids"][seq["fed"] : seq["fed"] + n], seq["fed"], None, seq["fed"] + n == len(seq["ids"]))))
                budget -= n
            decode = [DecodeRow(s["key"], s["out"][-1], None) for s in running]
            logits = runner.step(decode, [c for _, c in chunks])
            for seq, c in chunks:
                seq["fed"] += len(c.ids)
            joined = [seq for seq, c in chunks if c.last]
            prefilling = [s for s in prefilling if s not in joined]
            sampled = [*running, *joined]
            assert logits.shape == (len(sampled), vocab)
            for row, seq in zip(logits, sampled, strict=True):
                check(row, seq["ids"] + seq["out"], f"step {step}, sequence {seq['key']}")
                seq["out"].append(int(row.argmax()))
                checked += 1
            running = []
            for seq in sampled:
                if len(seq["out"]) >= seq["new"]:
                    runner.release(seq["key"])
                else:
                    running.append(seq)
    assert checked == sum(NEW)


def _last(model: Any, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def _assert_as_close_to_fp32_as_the_bf16_forward(runner: Any, ref32: Any, ref16: Any) -> None:
    """Drive ``runner`` (bf16) and hold every logits row to transformers' bf16 forward's distance from fp32's."""
    ours, theirs, scale = [], [], []

    def check(row: torch.Tensor, ids: list[int], where: str) -> None:
        truth = _last(ref32, ids)
        ours.append(float((row.float() - truth).abs().max()))
        theirs.append(float((_last(ref16, ids) - truth).abs().max()))
        scale.append(float(truth.abs().max()))

    _drive(runner, check, ref32.config.vocab_size)
    assert min(scale) > 2.0
    assert sum(ours) / len(ours) <= 2 * sum(theirs) / len(theirs), (ours, theirs)
    assert max(ours) <= 3 * max(theirs), (max(ours), max(theirs))


@pytest.mark.parametrize("kind", ["llama", "transformers"])
def test_runner_logits_equal_the_full_forward_fp32(ctx_model_path: Path, kind: str) -> None:
    model = _model(ctx_model_path, torch.float32)
    runner = _runner(kind, _model(ctx_model_path, torch.float32))

    def check(row: torch.Tensor, ids: list[int], where: str) -> None:
        torch.testing.assert_close(row, _last(model, ids), rtol=1e-4, atol=1e-4, msg=lambda m: f"{where}: {m}")

    _drive(runner, check, model.config.vocab_size)


@pytest.mark.parametrize("amx", [True, False])
def test_llama_runner_bf16_is_as_close_to_fp32_as_the_bf16_forward(ctx_model_path: Path, amx: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 rounds differently when the same numbers are computed in other GEMM shapes (a chunk vs the
    whole sequence), so the bf16 runner is held to the standard of transformers' own bf16 forward: its
    distance from the fp32 logits is of the same size. A wrong KV column or position is off by the
    logits' whole scale (order 10 on this context-sensitive model). Both prompt-attention paths, whatever
    this CPU has: bf16 where AMX is, float32 where bf16 has no matrix unit."""
    import runtime.engines.llama_runner as llama_runner

    monkeypatch.setattr(llama_runner, "_has_amx", lambda: amx)
    ref32, ref16 = _model(ctx_model_path, torch.float32), _model(ctx_model_path, torch.bfloat16)
    runner = _runner("llama", _model(ctx_model_path, torch.bfloat16))
    assert runner.chunk_attn_dtype == (torch.bfloat16 if amx else torch.float32)
    assert _runner("llama", _model(ctx_model_path, torch.float32)).chunk_attn_dtype == torch.float32
    _assert_as_close_to_fp32_as_the_bf16_forward(runner, ref32, ref16)


def test_released_rows_do_not_change_the_others(ctx_model_path: Path) -> None:
    """A finished row's columns are zeroed, so a NaN it left behind never reaches a row reusing its place."""
    model = _model(ctx_model_path, torch.float32)
    runner = _runner("llama", model)
    with torch.inference_mode():
        runner.begin("a", 4)
        runner.begin("b", 4)
        runner.step([], [Chunk("a", [5, 6, 7, 8], 0, None, True), Chunk("b", [9, 10, 11, 12], 0, None, True)])
        pool, row = runner.kv.where["a"]
        for i in range(len(runner.layers)):
            pool.k[i][row, :, :4] = float("nan")
            pool.v[i][row, :, :4] = float("nan")
        runner.release("a")
        runner.begin("c", 3)
        logits = runner.step([DecodeRow("b", 13, None)], [Chunk("c", [14, 15, 16], 0, None, True)])
        logits = runner.step([DecodeRow("b", 17, None), DecodeRow("c", 18, None)], [])
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[1], model(input_ids=torch.tensor([[14, 15, 16, 18]])).logits[0, -1], rtol=1e-4, atol=1e-4)


def test_a_row_gone_nan_fails_only_itself(ctx_model_path: Path) -> None:
    """A live row whose KV holds NaN (as a broken adapter leaves it) shares its pool's batched attention
    with the others: its logits are NaN (the engine fails that request), the others' equal the full forward."""
    model = _model(ctx_model_path, torch.float32)
    runner = _runner("llama", model)
    with torch.inference_mode():
        for key in ("a", "b", "c"):
            runner.begin(key, 4)
        runner.step([], [Chunk(k, [5 + i, 6, 7, 8], 0, None, True) for i, k in enumerate("abc")])
        pool, row = runner.kv.where["b"]
        assert all(runner.kv.where[k][0] is pool for k in "ac")  # one pool: one batched GEMM for the three
        for i in range(len(runner.layers)):
            pool.v[i][row, :, 1] = float("nan")
        logits = runner.step([DecodeRow(k, 20, None) for k in "abc"], [])
    assert torch.isnan(logits[1]).all()
    for i in (0, 2):
        torch.testing.assert_close(logits[i], model(input_ids=torch.tensor([[5 + i, 6, 7, 8, 20]])).logits[0, -1], rtol=1e-4, atol=1e-4)


def test_fits_names_what_it_cannot_serve(ctx_model_path: Path) -> None:
    model = _model(ctx_model_path, torch.float32)
    assert fits(model, 2048) is None
    model.config.sliding_window = 512
    assert "sliding window" in (fits(model, 2048) or "")
    assert fits(model, 256) is None  # the window never binds within a 256-token context
    model.config.sliding_window = None
    model.config.hidden_act = "gelu"
    assert "hidden_act" in (fits(model, 2048) or "")


def _wide_head_model(dtype: torch.dtype) -> Any:
    """A 2-layer Llama with head dim 64 (2 query heads on 1 kv head), weights drawn like ``ctx_model_path``'s."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else 0.3))
    return model.to(dtype).eval()


def test_llama_runner_bf16_with_the_cpu_kernels_is_as_close_to_fp32_as_the_bf16_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPUs with AVX512-BF16 and no AMX prompt chunks and decode rows attend through the compiled kernels (head dim
    64 here, their smallest): held to the bf16 forward's distance from fp32, as above, over chunked prompts with causal
    offsets beside decode rows in pools of several caps, rows leaving and moving pools. ``LOOPWISE_CPU_KERNELS=torch``
    turns them off."""
    from runtime.engines import cpu_kernels

    if cpu_kernels.why_not() is not None or cpu_kernels.ops() is None:
        pytest.skip(f"the kernels are not used on this machine: {cpu_kernels.why_not() or 'they did not build'}")
    ref32, ref16 = _wide_head_model(torch.float32), _wide_head_model(torch.bfloat16)
    runner = _runner("llama", _wide_head_model(torch.bfloat16))
    assert runner.kernels is cpu_kernels.ops()
    assert _runner("llama", _wide_head_model(torch.float32)).kernels is None
    _assert_as_close_to_fp32_as_the_bf16_forward(runner, ref32, ref16)
    monkeypatch.setenv("LOOPWISE_CPU_KERNELS", "torch")
    cpu_kernels.ops.cache_clear()
    try:
        assert _runner("llama", _wide_head_model(torch.bfloat16)).kernels is None
    finally:
        cpu_kernels.ops.cache_clear()
