"""Constrained turns are trained under the mask they were sampled with: the PPO ratio is 1 on an unchanged policy.

A real in-process app (``runtime.app.create_app``, the embedded engine on the tiny model, the recorder and
its SQLite store) answers chat requests under ``response_format`` JSON schemas at temperature 1; the
recorded turns are read back as learner samples and scored by ``LoRATrainer`` with a fresh adapter
(B = 0, so the policy is exactly the engine's). Without the mask the trainer's logprobs are lower by the
log of the allowed tokens' mass: the ratio was far below 1 and the clip removed the losing tokens first.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from learner.config import LoRAConfig, SampleConfig, TrainerConfig
from learner.grammar_mask import GrammarMasks, GrammarReplayError, compile_grammar, unpack_bitmask
from learner.records.store import SqliteStore
from learner.samples import Cursor, collect_samples
from learner.trainer import LoRATrainer
from learner.update import estimate

SCHEMA = {
    "type": "object",
    "properties": {"move": {"type": "string", "enum": ["rock", "paper", "scissors"]}, "note": {"type": "string", "maxLength": 12}},
    "required": ["move", "note"],
}


@pytest.fixture(scope="module")
def recorded(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight constrained chat turns (json_schema and json_object), recorded by a real app, each with a feedback reward."""
    from fastapi.testclient import TestClient

    from runtime.app import create_app
    from runtime.engines.embedded import EmbeddedEngine
    from runtime.recorder import Recorder
    from runtime.settings import EngineSettings, ServerSettings

    data = tmp_path_factory.mktemp("grammar-data")
    engine = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32")
    recorder = Recorder(SqliteStore(data / "interactions.db"), durability="sync", commit_window_s=0.001)
    app = create_app(ServerSettings(data_dir=data), EngineSettings(), engine, "tiny", recorder=recorder)
    formats = [{"type": "json_schema", "json_schema": {"name": "m", "schema": SCHEMA}}] * 6 + [{"type": "json_object"}] * 2
    with TestClient(app) as tc:
        for k, fmt in enumerate(formats):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Pick a move."}],
                "response_format": fmt,
                "temperature": 1.0,
                "seed": k,
                "max_tokens": 40,
                "logprobs": True,
            }
            r = tc.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            fb = tc.post("/v1/feedback", json={"completion_id": r.json()["id"], "reward": float(k % 2)})
            assert fb.status_code == 200, fb.text
    return data


def samples_of(data: Path) -> list:
    store = SqliteStore(data / "interactions.db")
    try:
        batch = collect_samples(store, family="fam", min_version=0, cursor=Cursor(), cfg=SampleConfig(settle_s=0), now=4e9)
    finally:
        store.close()
    return batch.samples


def test_recorded_constrained_turns_carry_their_grammar(recorded: Path) -> None:
    samples = samples_of(recorded)
    assert len(samples) == 8
    kinds = [s.grammar["kind"] for s in samples]
    assert kinds.count("json_schema") == 6 and kinds.count("json_object") == 2
    assert json.loads(samples[0].grammar["spec"]) == SCHEMA


def test_the_ratio_is_one_on_an_unchanged_policy_for_constrained_turns(recorded: Path, tiny_model_path: Path) -> None:
    samples = samples_of(recorded)
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    tr = LoRATrainer(tiny_model_path, TrainerConfig(threads=1, progress=False, lr=1e-3, autocast="off"), lora)
    masked = tr.token_logprobs(samples)
    unmasked = tr.token_logprobs([s.__class__(**{**s.__dict__, "grammar": None}) for s in samples])
    worst_masked = worst_unmasked = 0.0
    for s, m, u in zip(samples, masked, unmasked, strict=True):
        worst_masked = max(worst_masked, max(abs(a - b) for a, b in zip(m, s.logprobs, strict=True)))
        worst_unmasked = max(worst_unmasked, max(abs(a - b) for a, b in zip(u, s.logprobs, strict=True)))
        # unmasked, every token is less likely than the engine said (the mask removed mass): ratio < 1 everywhere
        assert all(a <= b + 1e-5 for a, b in zip(u, s.logprobs, strict=True))
    assert worst_masked < 1e-4  # log ratio ~ 0: the ratio is 1 (float32 noise of a batched vs a single forward)
    assert worst_unmasked > 1.0  # without the mask: ratios below e^-1 on some tokens (the old trainer's view)
    # a step on these samples with the behaviour logprobs as the old policy sees ratio 1 and clips nothing
    m = tr.step(samples, estimate(samples, "grpo"))
    assert m.optimizer_step and m.loss_stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m.clip_frac == 0.0
    assert "grammar_mismatch" not in m.skipped


def test_a_grammar_that_does_not_replay_leaves_the_turn_out(recorded: Path, tiny_model_path: Path) -> None:
    [s, *_] = samples_of(recorded)
    bad = s.__class__(**{**s.__dict__, "grammar": {"kind": "json_schema", "spec": json.dumps({"type": "array"})}})
    tr = LoRATrainer(tiny_model_path, TrainerConfig(threads=1, progress=False, autocast="off"), LoRAConfig(rank=2, target_modules=["q_proj"]))
    assert tr.replayable([bad, s]) == [1]
    with pytest.raises(GrammarReplayError):
        GrammarMasks(tiny_model_path, vocab_size=tr.vocab_size, eos_token_ids=tr.eos_token_ids).bitmask(bad.grammar, bad.output_ids)


@pytest.mark.parametrize(
    "kind,spec",
    [("json_object", ""), ("json_schema", json.dumps(SCHEMA)), ("ebnf", 'root ::= "<answer>" [0-9]+ "</answer>"')],
)
def test_the_learners_compile_rule_is_the_engines(tiny_model_path: Path, kind: str, spec: str) -> None:
    # the learner may not import the runtime, so it carries the same rule; the two must give the same masks
    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer

    from runtime.engine import Grammar
    from runtime.engines.embedded import _compile

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    vocab = int(AutoConfig.from_pretrained(str(tiny_model_path)).vocab_size)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id]), max_threads=1)
    ours, theirs = xgr.GrammarMatcher(compile_grammar(compiler, kind, spec)), xgr.GrammarMatcher(_compile(compiler, Grammar(kind, spec)))
    a, b = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
    ours.fill_next_token_bitmask(a, 0)
    theirs.fill_next_token_bitmask(b, 0)
    assert torch.equal(a, b)
    allowed = unpack_bitmask(a, vocab)
    assert allowed.shape == (1, vocab) and 0 < int(allowed.sum()) < vocab
    assert math.isfinite(float(allowed.float().mean()))


def test_unpack_bitmask_reads_bit_j_of_word_w_as_token_32w_plus_j() -> None:
    bits = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0 and 2 of word 0; bit 31 of word 1 = token 63
    allowed = unpack_bitmask(bits, 64)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 2, 63]
    assert unpack_bitmask(bits, 40).shape == (1, 40)


def test_the_learners_compiled_grammars_are_bounded_in_memory(tiny_model_path: Path) -> None:
    """Every client grammar recorded with a rewarded turn is compiled by the learner, and xgrammar keeps each compiled one:
    unbounded, one key's distinct schemas grew the learner's memory without end (the runtime's cache had a bound)."""
    from transformers import AutoConfig

    from learner.grammar_mask import CACHE_BYTES

    vocab = int(AutoConfig.from_pretrained(str(tiny_model_path)).vocab_size)
    masks = GrammarMasks(tiny_model_path, vocab_size=vocab, eos_token_ids=[0])
    assert masks._compiler.cache_limit_bytes == CACHE_BYTES == 256 << 20  # -1 (unbounded) before
