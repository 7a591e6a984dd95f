"""Prefix-shared packing (learner/packing.py): the trie layout of a hand-made batch, and on the tiny model the packed
logprobs and update against one independent forward pass per sample, for generated batches of the shapes the
learner trains on (groups sharing a context, a trajectory's turns extending each other, a common system prompt)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from learner.config import LoRAConfig, TrainerConfig
from learner.packing import pack, plan_packed
from learner.samples import Sample
from learner.trainer import LoRATrainer, iter_lora_parameters, packable

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
VOCAB = 2000  # the tiny model's


def sample(k: int, ctx: list[int], out: list[int], temperature: float = 1.0) -> Sample:
    return Sample(
        turn_id=f"t{k}",
        trajectory_id=f"tr{k}",
        group_id=f"g{k}",
        turn_index=0,
        context_ids=ctx,
        output_ids=out,
        logprobs=[],
        loss_mask=[1] * len(out),
        adapter=None,
        adapter_version=0,
        reward=None,
        trajectory_reward=None,
        temperature=temperature,
        created_at=0.0,
    )


def test_a_shared_context_is_laid_out_once_with_an_ancestor_mask() -> None:
    # two answers to one prompt [11, 12, 13]: [14, 15] and [14, 16]; and an unrelated sample [21] -> [22]
    contexts, outputs = [[11, 12, 13], [11, 12, 13], [21]], [[14, 15], [14, 16], [22]]
    p = pack([[0, 1], [2]], contexts, outputs)
    assert p.input_ids.tolist() == [[11, 12, 13, 14, 15, 16], [21, 22, 0, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 1, 0, 0, 0, 0]]  # 16 sits at depth 4, beside 15
    want = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 1],  # 16 sees the prompt and the shared 14, not its sibling 15
    ]
    assert p.attend[0, 0].int().tolist() == want
    assert p.attend[1, 0].int().tolist()[:2] == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert all(p.attend[1, 0, i].int().tolist() == [int(j == i) for j in range(6)] for i in range(2, 6))  # padding sees itself
    # every output token, in sample order: the position whose logits predict it (the one before it on its path)
    assert p.target.tolist() == [14, 15, 14, 16, 22]
    assert list(zip(p.row.tolist(), p.pos.tolist(), strict=True)) == [(0, 2), (0, 3), (0, 2), (0, 3), (1, 0)]
    assert p.sample.tolist() == [0, 0, 1, 1, 2] and p.col.tolist() == [0, 1, 0, 1, 1]  # right-aligned in T = 2 columns
    assert p.positions == 8  # against 5 + 5 + 2 = 12 unpacked


def test_the_plan_shares_prefixes_and_keeps_every_sample_once() -> None:
    rng = random.Random(0)
    system = [rng.randrange(3, VOCAB) for _ in range(40)]
    seqs = []
    for _ in range(6):
        ctx = system + [rng.randrange(3, VOCAB) for _ in range(30)]
        seqs += [ctx + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
    plan = plan_packed(seqs, micro_batch_tokens=2048)
    flat = sorted(i for mb in plan for row in mb for i in row)
    assert flat == list(range(len(seqs)))
    rows = [row for mb in plan for row in mb]
    p = pack(rows, [s[:70] for s in seqs], [s[70:] for s in seqs])
    assert p.positions < 0.45 * sum(len(s) for s in seqs)  # a group's 8 answers share their 70-token prompt
    assert p.target.numel() == sum(len(s) - 70 for s in seqs)
    for mb in plan:  # rows x longest row within the micro-batch budget (one row may be longer only alone)
        sizes = [len(pack([row], [s[:70] for s in seqs], [s[70:] for s in seqs]).input_ids[0]) for row in mb]
        assert len(mb) == 1 or len(mb) * max(sizes) <= 2048


def test_only_a_sample_sharing_its_prefix_takes_a_row_past_its_bound() -> None:
    rng = random.Random(1)
    tok = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    turn1 = tok(300)
    turn2 = turn1 + tok(400)  # a trajectory's turns: each context extends the last
    turn3 = turn2 + tok(400)
    long_alone = tok(1500)  # one long sample with nothing to share
    short = [tok(100) for _ in range(12)]  # unrelated short samples
    seqs = [turn1, turn2, turn3, long_alone, *short]
    rows = [row for mb in plan_packed(seqs, micro_batch_tokens=2048, row_tokens=512) for row in mb]
    sizes = {tuple(sorted(row)): len(pack([row], [s[:1] for s in seqs], [s[1:] for s in seqs]).input_ids[0]) for row in rows}
    [turns] = [row for row in sizes if 0 in row]
    others = len(turns) - 3  # short samples that joined the row while it was within the bound, before the turns grew it
    assert {1, 2} <= set(turns) and sizes[turns] == 1100 + 100 * others and 100 * others + 300 <= 512  # the turns share it
    assert sizes[(3,)] == 1500  # the long sample alone: no short sample joins its row
    assert all(n <= 512 for row, n in sizes.items() if row not in (turns, (3,)))  # the short ones in rows of <= 512
    assert sorted(i for row in rows for i in row) == list(range(len(seqs)))


def reference_logprobs(model_path: Path, samples: list[Sample]) -> list[list[float]]:
    """One forward pass per sample, no padding, no packing: the definition of each output token's logprob."""
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.context_ids + s.output_ids])
            logits = model(input_ids=ids).logits[0].float() / s.temperature  # (L, V)
            lp = torch.log_softmax(logits, -1)
            c = len(s.context_ids)
            out.append([float(lp[c + j - 1, t]) for j, t in enumerate(s.output_ids)])
    return out


@st.composite
def batches(draw: st.DrawFn) -> list[Sample]:
    """Samples as the learner gets them: groups of answers to one prompt (all after one system prompt), and turns of one
    trajectory whose context is the previous turn's context, output and a tool result; answers may share first tokens."""
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    tok = lambda n: [rnd.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    system = tok(draw(st.integers(1, 12)))
    out: list[Sample] = []
    for _ in range(draw(st.integers(1, 3))):  # groups
        ctx = system + tok(draw(st.integers(0, 6)))
        first = tok(3)
        for _ in range(draw(st.integers(1, 4))):
            answer = (first[: rnd.randrange(0, 4)] + tok(rnd.randrange(1, 12))) or tok(1)
            out.append(sample(len(out), ctx, answer, temperature=rnd.choice([1.0, 0.7])))
    ctx = system + tok(2)
    for _ in range(draw(st.integers(0, 3))):  # a multi-turn trajectory
        answer = tok(rnd.randrange(1, 8))
        out.append(sample(len(out), ctx, answer))
        ctx = ctx + answer + tok(rnd.randrange(1, 4))
    rnd.shuffle(out)
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(samples=batches(), mbt=st.sampled_from([64, 256, 4096]))
def test_packed_logprobs_are_each_samples_own(tiny_model_path: Path, samples: list[Sample], mbt: int) -> None:
    trainer = LoRATrainer(tiny_model_path, TrainerConfig(threads=1, progress=False, micro_batch_tokens=mbt, autocast="off"), LORA)
    assert trainer.packing
    got = trainer.token_logprobs(samples)
    want = reference_logprobs(tiny_model_path, samples)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) and max(abs(a - b) for a, b in zip(g, w, strict=True)) < 1e-4


def test_a_packed_step_is_the_unpacked_step(tiny_model_path: Path) -> None:
    rnd = random.Random(3)
    system = [rnd.randrange(3, VOCAB) for _ in range(10)]
    samples = []
    for _ in range(4):
        ctx = system + [rnd.randrange(3, VOCAB) for _ in range(5)]
        samples += [sample(len(samples), ctx, [rnd.randrange(3, VOCAB) for _ in range(rnd.randrange(2, 15))]) for _ in range(4)]
    adv = [rnd.choice([-1.0, 0.5, 1.0]) for _ in samples]
    after = {}
    for packed in (False, True):
        cfg = TrainerConfig(threads=1, progress=False, lr=1e-2, seed=0, epochs=2, pack_prefixes=packed, autocast="off", micro_batch_tokens=256)
        tr = LoRATrainer(tiny_model_path, cfg, LORA)
        assert tr.packing is packed
        m = tr.step(samples, adv)
        after[packed] = (m, {n: p.detach().clone() for n, p in iter_lora_parameters(tr.model)})
    (m0, w0), (m1, w1) = after[False], after[True]
    assert m1.loss == pytest.approx(m0.loss, rel=1e-4, abs=1e-6) and m1.grad_norm == pytest.approx(m0.grad_norm, rel=1e-3)
    assert m1.entropy == pytest.approx(m0.entropy, rel=1e-4) and m1.clip_frac == pytest.approx(m0.clip_frac, abs=1e-6)
    assert max(float((w0[n] - w1[n]).abs().max()) for n in w0) < 1e-5  # the same two AdamW steps


def test_architectures_outside_the_packed_ones_keep_one_row_per_sample(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    assert packable(model) is None
    model.config._attn_implementation = "flex_attention"
    assert "flex_attention" in (packable(model) or "")

    class GemmaLike(torch.nn.Module):
        config = model.config

    assert "GemmaLike is not one of" in (packable(GemmaLike()) or "")
    off = LoRATrainer(tiny_model_path, TrainerConfig(threads=1, progress=False, pack_prefixes=False, autocast="off"), LORA)
    assert off.packing is False
