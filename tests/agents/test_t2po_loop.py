"""T²PO in the agent loop (``agents/t2po.py`` through ``agents/loop.py``): where the thinking is cut when the engine
streams several tokens per chunk, and which seed each turn regeneration samples with.

A scripted engine (``tests/agents/_scripted.py``) streams a reply ``chunk`` tokens at a time, as vLLM and SGLang do;
everything above it is real. Expected numbers come from the definitions: the monitor fires at the first thinking token
``k`` with ``k + 1 >= max(min_tokens, 2·window)`` and a flat window mean, and the loop keeps the output up to and
including that token; a regeneration is a fresh sample (no seed another draft uses; none in an unseeded run).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agents.config import AgentConfig
from agents.loop import AgentLoop
from learner.records.store import SqliteStore
from runtime.engine import GenerateRequest, StreamChunk, Timings
from tests.agents._scripted import Reply, ScriptedEngine, make_client
from tools.builtins import default_registry


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


class ChunkedEngine(ScriptedEngine):
    """``ScriptedEngine`` whose stream yields ``chunk`` tokens per chunk (the last one possibly fewer)."""

    def __init__(self, tokenizer, script, chunk: int) -> None:
        super().__init__(tokenizer, script)
        self.chunk = chunk

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        reply = self._next(req)
        ids = self._tokens(reply, req)
        eos = self.tok.eos_token_id
        try:
            for start in range(0, len(ids), self.chunk):
                part = ids[start : start + self.chunk]
                last = start + self.chunk >= len(ids)
                finish = ("stop" if ids[-1] == eos else "length") if last else None
                yield StreamChunk(
                    tuple(part),
                    self.tok.decode([i for i in part if i != eos]),
                    tuple(self._lp(i, reply.p) for i in part),
                    finish,
                    eos if finish == "stop" else None,
                    timings=Timings() if last else None,
                )
        finally:
            self.closed_streams += 1


def run(tok, tmp_path: Path, script, *, chunk: int = 1, seed: int | None = 1, **cfg):
    engine = ChunkedEngine(tok, script, chunk)
    client, recorder, store = make_client(tok, engine, tmp_path)
    loop = AgentLoop(AgentConfig(name="t-agent", **cfg), client, default_registry())

    async def go():
        try:
            return await loop.run([{"role": "user", "content": "what is 2+2?"}], session_id="s1", seed=seed)
        finally:
            await recorder.flush()

    result = asyncio.run(go())
    recorder.close()
    return result, engine, SqliteStore(tmp_path / "interactions.db")


def call(expr: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "\n</tool_call>"


# ── the cut point ──────────────────────────────────────────────────────────────────────────────────────

THINKING = "<think>" + " hmm" * 200


@pytest.mark.parametrize("chunk", [1, 3, 5, 7])
def test_the_thinking_is_cut_right_after_the_token_the_monitor_fires_at_whatever_the_chunking(tok, tmp_path, chunk):
    ids = tok.encode(THINKING, add_special_tokens=False)
    opened = next(j for j in range(len(ids)) if "<think>" in tok.decode(ids[: j + 1]))  # the first thinking token
    # every token has the same uncertainty H(0.5) = ln 2: with window 4 and min_tokens 8 the monitor fires at its 8th
    # thinking token (k + 1 = max(8, 2·4) = 8, the two windows' means equal), so the loop keeps ids[: opened + 8]
    kept = ids[: opened + 8]
    forced = tok.encode("\n</think>\n", add_special_tokens=False)
    answer = [*tok.encode("<answer>5</answer>", add_special_tokens=False), tok.eos_token_id]
    t2 = {"thinking_intervention": True, "window": 4, "threshold": 0.05, "min_tokens": 8, "think_budget": None, "top_logprobs": 2}
    script = [Reply(THINKING, p=0.5, eos=False), Reply("<answer>5</answer>", p=0.9)]
    result, engine, store = run(tok, tmp_path, script, chunk=chunk, t2po=t2, max_tokens_per_turn=512, max_turns=1)
    assert result.t2po["interventions"] == 1 and result.answer == "5"
    # the answer is decoded after exactly the kept thinking and the forced close, not after the rest of the chunk
    assert list(engine.calls[1].input_ids) == [*engine.calls[0].input_ids, *kept, *forced]
    [turn] = store.get_trajectory(result.trajectory_id).turns
    assert turn.output_ids == [*kept, *forced, *answer]
    assert turn.loss_mask == [1] * len(kept) + [0] * len(forced) + [1] * len(answer)
    assert turn.output_text.startswith(tok.decode(kept) + "\n</think>\n")


# ── a fresh seed per regeneration ──────────────────────────────────────────────────────────────────────

# turn 0 sets u = H(0.7); turn 1's drafts (H(0.71), H(0.72), H(0.73)) are each within eta = 0.3 of it, so the turn is
# regenerated max_try = 2 times and its third draft kept; turn 2's H(0.99) is far from H(0.73): no regeneration
RESAMPLED = [
    Reply(call("1+1"), p=0.7),
    Reply(call("2+2"), p=0.71),
    Reply(call("2+2"), p=0.72),
    Reply(call("2+2"), p=0.73),
    Reply("<answer>4</answer>", p=0.99),
]
T2_RESAMPLE = {"turn_resample": True, "eta": 0.3, "max_try": 2, "top_logprobs": 2}


def seeds_of(tok, tmp_path: Path, seed: int | None) -> list[int | None]:
    result, engine, _ = run(tok, tmp_path, RESAMPLED, seed=seed, tools=("calculator",), t2po=T2_RESAMPLE)
    assert result.t2po["resamples"] == 2 and result.steps[1].drafts_discarded == 2 and len(engine.calls) == 5
    return [c.sampling.seed for c in engine.calls]


def test_each_regeneration_samples_with_a_fresh_seed(tok, tmp_path):
    seeds = seeds_of(tok, tmp_path / "a", seed=1)
    # each turn's own sample keeps its seed (run seed · 1000 + turn): turns 0, 1 and 2
    assert (seeds[0], seeds[1], seeds[4]) == (1000, 1001, 1002)
    regenerations = seeds[2:4]
    assert None not in regenerations and len(set(regenerations)) == 2  # a seeded run's regenerations are seeded, distinct
    # fresh: no first-draft seed of any run seeded 0..99 (a group's runs are seeded s, s + 1, ...; max_turns <= 64)
    assert not {s * 1000 + t for s in range(100) for t in range(64)} & set(regenerations)
    assert seeds_of(tok, tmp_path / "b", seed=1) == seeds  # deterministic given the run's seed
    other = seeds_of(tok, tmp_path / "c", seed=2)
    assert not set(other[2:4]) & set(regenerations)


def test_an_unseeded_run_regenerates_from_the_engine_randomness(tok, tmp_path):
    # no seed for the run: its first draft is unseeded, and so is every regeneration (a fixed seed here would make every
    # unseeded run's regenerations of one context the same sample)
    assert seeds_of(tok, tmp_path, seed=None) == [None] * 5
