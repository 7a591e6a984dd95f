"""One request can fail only itself: bad numerics in one row (a temperature that underflows, NaN logits from a
broken adapter) fail that row's request, never its batch neighbours; logprobs under a grammar stay valid JSON."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from runtime.engines.sampling import MIN_TEMPERATURE, RowSampling, sample_next

GOOD = [1.0, 3.0, 2.0, -1.0, 0.5]


def row(temperature: float = 0.0, top_logprobs: int = 0, seed: int | None = 0) -> RowSampling:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return RowSampling(temperature=temperature, top_p=1.0, generator=gen, top_logprobs=top_logprobs)


def test_a_nan_row_fails_alone_and_its_neighbours_are_sampled() -> None:
    logits = torch.tensor([GOOD, [float("nan")] * 5, GOOD, [float("-inf")] * 5])
    out = sample_next(logits, [row(1.0), row(1.0), row(0.0), row(0.0)])
    assert out.failed == [False, True, False, True]
    assert out.token_ids[2] == 1 and math.isfinite(out.logprobs[0]) and math.isfinite(out.logprobs[2])
    # greedy rows too: argmax over NaN would pick garbage silently
    out = sample_next(torch.tensor([[float("nan")] * 5, GOOD]), [row(0.0), row(0.0)])
    assert out.failed == [True, False] and out.token_ids[1] == 1


def test_a_temperature_below_the_floor_is_greedy_not_nan() -> None:
    # 1e-50 is 0 in float32: logits / T would be inf and the probabilities NaN
    out = sample_next(torch.tensor([GOOD, GOOD]), [row(1e-50, top_logprobs=2), row(MIN_TEMPERATURE / 2)])
    assert out.failed == [False, False] and out.token_ids == [1, 1]
    expected = torch.log_softmax(torch.tensor(GOOD), dim=-1)[1].item()  # greedy rows report the raw distribution
    assert math.isclose(out.logprobs[0], expected, abs_tol=1e-6)
    assert all(math.isfinite(v) for _, v in out.top[0])


def test_top_logprobs_leave_out_masked_tokens() -> None:
    masked = torch.tensor([[float("-inf"), 3.0, float("-inf"), float("-inf"), 0.5]])  # a grammar allows two tokens
    out = sample_next(masked, [row(0.0, top_logprobs=5)])
    assert [t for t, _ in out.top[0]] == [1, 4]
    json.dumps(out.top, allow_nan=False)  # no -Infinity in what becomes the response


def test_a_bad_temperature_fails_no_concurrent_request(tiny_model_path) -> None:
    """Through the real embedded engine: an underflowing temperature next to normal requests, all decoded in one batch."""
    from runtime.engine import GenerateRequest, SamplingParams
    from runtime.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32")

    async def go() -> list:
        await engine.start()
        try:
            reqs = [
                GenerateRequest(
                    request_id=f"r{i}", input_ids=(1, 2, 3, 4), sampling=SamplingParams(max_new_tokens=6, temperature=t, seed=i, ignore_eos=True)
                )
                for i, t in enumerate([1.0, 1e-50, 0.7, 1e-40])
            ]
            return await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in reqs), return_exceptions=True), 60)
        finally:
            await engine.close()

    results = asyncio.run(go())
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert all(len(r.output_ids) == 6 for r in results)


@pytest.mark.parametrize("runner", ["llama", "transformers"])
def test_nan_logits_fail_only_their_own_request(tiny_model_path, monkeypatch, runner: str) -> None:
    """A row whose logits are NaN (as a NaN adapter produces) fails with an engine error; the others finish, on either runner."""
    from runtime.engine import EngineError, GenerateRequest, SamplingParams
    from runtime.engines.embedded import EmbeddedEngine
    from runtime.engines.hf_runner import HFRunner
    from runtime.engines.llama_runner import LlamaRunner

    engine = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32", runner=runner)
    cls = LlamaRunner if runner == "llama" else HFRunner
    real_step = cls.step

    def poisoned(self, decode, chunks):
        out = real_step(self, decode, chunks)  # rows: the decode rows, then each prompt's last chunk
        keys = [r.key for r in decode] + [c.key for c in chunks if c.last]
        for i, seq in enumerate(keys):
            if seq.req.request_id == "poisoned":
                out[i] = float("nan")
        return out

    async def go() -> list:
        await engine.start()
        try:
            sp = SamplingParams(max_new_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
            reqs = [GenerateRequest(request_id=rid, input_ids=(5, 6, 7), sampling=sp) for rid in ("a", "poisoned", "b")]
            return await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in reqs), return_exceptions=True), 60)
        finally:
            await engine.close()

    monkeypatch.setattr(cls, "step", poisoned)
    results = asyncio.run(go())
    assert isinstance(results[1], EngineError) and "non-finite" in str(results[1])
    assert [len(r.output_ids) for r in (results[0], results[2])] == [5, 5]
