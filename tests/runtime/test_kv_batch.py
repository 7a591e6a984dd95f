"""runtime/engines/kv_batch.py (unit, synthetic tensors) and runtime/engines/embedded.py (engine correctness).

The batching tests compare the engine's greedy output for several concurrent, staggered requests with
``model.generate`` run on each prompt alone, token for token. The tiny model as built is nearly an
identity map (its greedy output repeats the last prompt token whatever came before), which would hide
a broken KV cache, so those tests use a copy of it with re-drawn, larger weights whose output depends
on the whole context (checked by ``test_reference_model_is_context_sensitive``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.engine import (
    EngineOverloaded,
    GenerateRequest,
    GenerateResult,
    Grammar,
    InvalidRequest,
    SamplingParams,
    StreamChunk,
)
from runtime.engines.embedded import EmbeddedEngine
from runtime.engines.kv_batch import BatchKV

# ---- BatchKV on synthetic tensors ------------------------------------------------------------


def _kv(masks: list[list[int]], n_layers: int = 2, heads: int = 1, dim: int = 2, cap: int = 8) -> BatchKV:
    """A BatchKV whose cell (row r, column c) of layer l holds the value 1000*l + 100*r + c (+0.5 in v)."""
    kv = BatchKV(n_layers)
    rows, length = len(masks), len(masks[0])
    for layer in range(n_layers):
        k = torch.zeros(rows, heads, cap, dim)
        for r in range(rows):
            for c in range(length):
                k[r, :, c, :] = 1000 * layer + 100 * r + c
        kv.k.append(k)
        kv.v.append(k + 0.5)
    kv.length = length
    kv.mask = torch.tensor(masks, dtype=torch.long)
    kv.positions = kv.mask.sum(dim=1)
    return kv


def test_keep_reorders_rows_and_trims_all_padding_columns() -> None:
    kv = _kv([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kv.keep([1, 0])  # drop the only row that used column 0; reorder
    assert kv.length == 5
    assert kv.rows == 2
    assert kv.mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert kv.positions.tolist() == [5, 3]
    for layer in range(2):
        # row 0 is the old row 1, shifted left by one column
        assert kv.k[layer][0, 0, :5, 0].tolist() == [1000 * layer + 100 + c for c in range(1, 6)]
        assert kv.k[layer][1, 0, 2:5, 0].tolist() == [1000 * layer + c for c in range(3, 6)]
        assert kv.v[layer][1, 0, 2:5, 1].tolist() == [1000 * layer + c + 0.5 for c in range(3, 6)]


def test_keep_trims_to_the_shortest_remaining_padding() -> None:
    kv = _kv([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kv.keep([0])
    assert kv.length == 3
    assert kv.mask.tolist() == [[1, 1, 1]]
    assert kv.positions.tolist() == [3]
    assert kv.k[1][0, 0, :3, 0].tolist() == [1003, 1004, 1005]


def test_keep_without_trim_when_a_row_uses_every_column() -> None:
    kv = _kv([[0, 0, 1, 1], [1, 1, 1, 1]])
    kv.keep([0, 1])
    assert kv.length == 4
    assert kv.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_keep_nothing_empties_the_batch() -> None:
    kv = _kv([[0, 1], [1, 1]])
    kv.keep([])
    assert kv.rows == 0 and kv.length == 0 and kv.k == [] and kv.capacity == 0


def test_merge_right_aligns_both_batches() -> None:
    a = _kv([[1, 1, 1]])  # length 3
    b = _kv([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])  # length 5
    for layer in range(2):  # make b's values distinguishable from a's
        b.k[layer] += 10_000
        b.v[layer] += 10_000
    a.merge(b)
    assert a.length == 5 and a.rows == 3
    assert a.mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert a.positions.tolist() == [3, 4, 5]
    assert a.capacity >= 5
    for layer in range(2):
        assert a.k[layer][0, 0, :5, 0].tolist() == [0, 0] + [1000 * layer + c for c in range(3)]
        assert a.k[layer][2, 0, :5, 1].tolist() == [10_000 + 1000 * layer + 100 + c for c in range(5)]
        assert a.v[layer][0, 0, 2:5, 0].tolist() == [1000 * layer + c + 0.5 for c in range(3)]


def test_merge_shorter_newcomer_gets_left_padding() -> None:
    a = _kv([[0, 1, 1, 1], [1, 1, 1, 1]])
    b = _kv([[1, 1]])
    a.merge(b)
    assert a.length == 4
    assert a.mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]
    assert a.positions.tolist() == [3, 4, 2]
    assert a.k[0][2, 0, :4, 0].tolist() == [0, 0, 0, 1]


def test_merge_into_empty_batch_adopts_the_other() -> None:
    a = BatchKV(2)
    b = _kv([[1, 1, 1]])
    a.merge(b)
    assert a.rows == 1 and a.length == 3 and a.k[0] is b.k[0]


def test_write_and_advance_grow_capacity_and_keep_contents() -> None:
    kv = BatchKV(2)
    first = torch.arange(2 * 1 * 60 * 3, dtype=torch.float32).reshape(2, 1, 60, 3)
    for layer in range(2):
        k_out, v_out = kv.write(layer, first + layer, -first - layer)
        assert k_out.shape == (2, 1, 60, 3)
    kv.advance(60, torch.ones(2, 60, dtype=torch.long))
    assert kv.capacity == 64
    assert kv.positions.tolist() == [60, 60]
    more = torch.full((2, 1, 10, 3), 7.0)
    for layer in range(2):
        k_out, v_out = kv.write(layer, more, -more)
        assert k_out.shape == (2, 1, 70, 3)
        assert torch.equal(k_out[:, :, :60], first + layer)  # old contents survived the growth
        assert torch.equal(v_out[:, :, :60], -first - layer)
        assert torch.equal(k_out[:, :, 60:], more)
    kv.advance(10, torch.ones(2, 10, dtype=torch.long))
    assert kv.capacity == 128  # doubled
    assert kv.length == 70
    assert kv.mask.shape == (2, 70)
    assert kv.positions.tolist() == [70, 70]


def test_as_cache_reports_length() -> None:
    kv = _kv([[0, 1, 1], [1, 1, 1]])
    cache = kv.as_cache()
    assert cache.get_seq_length() == 3
    assert len(cache.layers) == 2


# ---- engine correctness ---------------------------------------------------------------------

PROMPTS = [
    "Hello",
    "The weather in Paris is sunny and",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}\n</tool_call> and then',
    "1 + 2 = 3; what is the time now in London",
]
MAX_NEW = [12, 20, 4, 9]  # the longest prompt finishes first: its padding columns get trimmed


@pytest.fixture(scope="module")
def ref_model(ctx_model_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(ctx_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def reference(model: Any, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=None,  # like ignore_eos: run the full length
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def greedy(ids: list[int], n: int, **kw: Any) -> GenerateRequest:
    return GenerateRequest(f"r{len(ids)}-{n}", tuple(ids), SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw))


def with_engine(path: Path, body: Callable[[EmbeddedEngine], Awaitable[Any]], **kw: Any) -> Any:
    async def main() -> Any:
        engine = EmbeddedEngine(path, model_id="tiny", dtype="float32", **kw)
        await engine.start()
        try:
            return await asyncio.wait_for(body(engine), 60)
        finally:
            await engine.close()

    return asyncio.run(main())


class StepLog:
    """``on_step`` hook: records batch sizes and slows each forward a little so requests overlap."""

    def __init__(self, delay: float = 0.003) -> None:
        self.rows: list[int] = []
        self.delay = delay

    def __call__(self, rows: int) -> None:
        self.rows.append(rows)
        time.sleep(self.delay)


def test_reference_model_is_context_sensitive(ref_model: Any, tok: Any) -> None:
    ids = tok.encode(PROMPTS[1], add_special_tokens=False)
    a = reference(ref_model, ids, 6)
    b = reference(ref_model, tok.encode("x " + PROMPTS[1], add_special_tokens=False), 6)
    assert a != b  # the earliest token changes the continuation: a wrong KV would show
    assert len(set(a)) > 1


def test_concurrent_requests_match_generate_alone(ctx_model_path: Path, ref_model: Any, tok: Any) -> None:
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 4
    expected = [reference(ref_model, p, n) for p, n in zip(prompts, MAX_NEW, strict=True)]
    steps = StepLog()

    async def body(engine: EmbeddedEngine) -> list[GenerateResult]:
        return await asyncio.gather(*(engine.generate(greedy(p, n)) for p, n in zip(prompts, MAX_NEW, strict=True)))

    results = with_engine(ctx_model_path, body, on_step=steps)
    for res, exp, n in zip(results, expected, MAX_NEW, strict=True):
        assert list(res.output_ids) == exp
        assert res.finish_reason == "length"
        assert len(res.output_ids) == n
    assert max(steps.rows) == 4  # all four were decoded in one batch at some point


def test_staggered_arrivals_match_generate_alone(ctx_model_path: Path, ref_model: Any, tok: Any) -> None:
    first = [tok.encode(PROMPTS[0], add_special_tokens=False), tok.encode(PROMPTS[1], add_special_tokens=False)]
    second = [tok.encode(PROMPTS[2], add_special_tokens=False), tok.encode("Tokyo", add_special_tokens=False)]
    first_n, second_n = [30, 24], [6, 10]
    expected = [reference(ref_model, p, n) for p, n in zip(first + second, first_n + second_n, strict=True)]
    steps = StepLog()

    async def body(engine: EmbeddedEngine) -> list[list[int]]:
        got_three = asyncio.Event()

        async def consume(req: GenerateRequest, signal: bool) -> list[int]:
            ids: list[int] = []
            async for chunk in engine.stream(req):
                ids.extend(chunk.token_ids)
                if signal and len(ids) == 3:
                    got_three.set()
            return ids

        early = [asyncio.create_task(consume(greedy(p, n), i == 0)) for i, (p, n) in enumerate(zip(first, first_n, strict=True))]
        await got_three.wait()
        assert engine.stats()["running"] == 2.0
        late = [asyncio.create_task(consume(greedy(p, n), False)) for p, n in zip(second, second_n, strict=True)]
        return list(await asyncio.gather(*early, *late))

    outs = with_engine(ctx_model_path, body, on_step=steps)
    assert outs == expected
    assert max(steps.rows) == 4  # the late requests joined the running batch


def test_grammar_constrained_json(tiny_model_path: Path) -> None:
    schema = '{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}'

    async def body(engine: EmbeddedEngine) -> list[GenerateResult]:
        reqs = [
            GenerateRequest(
                f"g{seed}", (5, 6, 7), SamplingParams(max_new_tokens=40, temperature=1.0, seed=seed, grammar=Grammar("json_schema", schema))
            )
            for seed in range(3)
        ]
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    for res in with_engine(tiny_model_path, body):
        assert res.finish_reason == "stop"
        assert json.loads(res.text) in ({"ok": True}, {"ok": False})
        assert res.output_ids[-1] == 2  # ended by eos, which the grammar allowed only after the object
        assert res.matched_stop == 2


def test_stop_token_ids_are_honoured(tiny_model_path: Path, tok: Any) -> None:
    prompt = tok.encode("Hello", add_special_tokens=False)

    async def body(engine: EmbeddedEngine) -> tuple[GenerateResult, GenerateResult]:
        free = await engine.generate(greedy(prompt, 5))
        stop_at = free.output_ids[0]
        stopped = await engine.generate(greedy(prompt, 5, stop_token_ids=(stop_at,)))
        return free, stopped

    free, stopped = with_engine(tiny_model_path, body)
    assert len(free.output_ids) == 5 and free.finish_reason == "length"
    assert stopped.output_ids == free.output_ids[:1]
    assert stopped.finish_reason == "stop"
    assert stopped.matched_stop == free.output_ids[0]
    assert stopped.text == ""  # the stop token's text is not shown


def test_max_new_tokens_gives_length_with_exactly_that_many(tiny_model_path: Path) -> None:
    async def body(engine: EmbeddedEngine) -> list[GenerateResult]:
        return await asyncio.gather(*(engine.generate(greedy([5, 6, 7], n)) for n in (1, 7, 33)))

    for res, n in zip(with_engine(tiny_model_path, body), (1, 7, 33), strict=True):
        assert res.finish_reason == "length"
        assert len(res.output_ids) == n
        assert res.prompt_ids == (5, 6, 7)


def test_cancellation_frees_the_row(tiny_model_path: Path) -> None:
    async def body(engine: EmbeddedEngine) -> tuple[float, float, int]:
        stream = engine.stream(greedy([5, 6, 7], 1500))
        chunks: list[StreamChunk] = [await stream.__anext__(), await stream.__anext__()]
        assert all(c.finish_reason is None for c in chunks)
        for _ in range(100):
            if engine.stats()["running"] == 1.0:
                break
            await asyncio.sleep(0.01)
        running_before = engine.stats()["running"]
        await stream.aclose()
        for _ in range(200):
            if engine.stats()["running"] == 0.0:
                break
            await asyncio.sleep(0.01)
        running_after = engine.stats()["running"]
        generated = engine.tokens_generated
        await asyncio.sleep(0.1)
        assert engine.tokens_generated == generated  # nothing decodes for it any more
        return running_before, running_after, generated

    before, after, generated = with_engine(tiny_model_path, body, on_step=StepLog(0.005))
    assert before == 1.0
    assert after == 0.0
    assert generated < 1500


def test_overloaded_when_queue_and_batch_are_full(tiny_model_path: Path) -> None:
    async def body(engine: EmbeddedEngine) -> None:
        first = engine.stream(greedy([5, 6, 7], 1500))
        await first.__anext__()  # admitted and running
        for _ in range(100):
            if engine.stats()["running"] == 1.0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats()["running"] == 1.0
        second = engine.stream(greedy([5, 6], 3))
        with pytest.raises(EngineOverloaded) as ei:
            await second.__anext__()
        assert ei.value.retry_after == 1.0
        await first.aclose()
        for _ in range(200):
            if engine.stats()["running"] == 0.0:
                break
            await asyncio.sleep(0.01)
        # the slot is free again: a new request is served
        res = await engine.generate(greedy([5, 6], 3))
        assert len(res.output_ids) == 3

    with_engine(tiny_model_path, body, max_queue=0, max_batch_size=1, on_step=StepLog(0.005))


def test_prompt_plus_completion_beyond_context_is_invalid(tiny_model_path: Path) -> None:
    async def body(engine: EmbeddedEngine) -> None:
        assert engine.info.max_model_len == 64
        with pytest.raises(InvalidRequest) as ei:
            await engine.generate(greedy(list(range(5, 65)), 5))  # 60 + 5 > 64
        assert ei.value.param == "messages"
        assert ei.value.code == "context_length_exceeded"
        res = await engine.generate(greedy(list(range(5, 65)), 4))  # 60 + 4 == 64 fits
        assert len(res.output_ids) == 4

    with_engine(tiny_model_path, body, max_model_len=64)


def test_invalid_grammar_is_invalid_request(tiny_model_path: Path) -> None:
    async def body(engine: EmbeddedEngine) -> list[InvalidRequest]:
        errors = []
        for g in (Grammar("ebnf", 'root ::= "a" | '), Grammar("ebnf", "root ::= undefined_rule"), Grammar("json_schema", "{not json")):
            with pytest.raises(InvalidRequest) as ei:
                await engine.generate(GenerateRequest("bad", (5, 6), SamplingParams(grammar=g)))
            errors.append(ei.value)
        # the engine keeps serving afterwards
        assert len((await engine.generate(greedy([5, 6], 2))).output_ids) == 2
        return errors

    errors = with_engine(tiny_model_path, body)
    assert [e.param for e in errors] == ["response_format"] * 3
    assert "invalid ebnf constraint" in str(errors[0])
    assert "undefined_rule" in str(errors[1])


@pytest.mark.parametrize("runner", ["llama", "transformers"])
def test_an_idle_engine_feeds_a_long_prompt_in_bigger_pieces_and_a_busy_one_in_chunks(ctx_model_path: Path, ref_model: Any, runner: str) -> None:
    """``prefill_chunk`` bounds a step's prompt tokens while some request decodes (its token gap); with none decoding,
    the oldest prompt goes in pieces of up to 4 chunks (``--prefill-chunk``'s help says so). Either way the tokens are
    transformers'."""
    chunk, big = 16, 64
    g = torch.Generator().manual_seed(3)
    long_a = torch.randint(3, 200, (2 * big + 9,), generator=g).tolist()
    long_b = torch.randint(3, 200, (70,), generator=g).tolist()
    short = torch.randint(3, 200, (5,), generator=g).tolist()
    steps: list[tuple[int, list[int]]] = []  # (decode rows, prompt tokens of each chunk) per forward

    async def body(engine: EmbeddedEngine) -> tuple[list[int], list[int], list[int]]:
        assert engine._runner is not None
        inner = engine._runner.step

        def spy(decode: Any, chunks: Any) -> Any:
            steps.append((len(decode), [len(c.ids) for c in chunks]))
            return inner(decode, chunks)

        engine._runner.step = spy  # type: ignore[method-assign]
        alone = (await engine.generate(greedy(long_a, 3))).output_ids
        decoding = asyncio.Event()

        async def decoder() -> list[int]:
            ids: list[int] = []
            async for c in engine.stream(greedy(short, 40)):
                ids.extend(c.token_ids)
                if len(ids) >= 2:
                    decoding.set()
            return ids

        task = asyncio.create_task(decoder())
        await decoding.wait()
        beside = (await engine.generate(greedy(long_b, 3))).output_ids
        return list(alone), list(beside), await task

    alone, beside, short_out = with_engine(ctx_model_path, body, prefill_chunk=chunk, runner=runner)
    assert alone == reference(ref_model, long_a, 3)
    assert beside == reference(ref_model, long_b, 3)
    assert short_out == reference(ref_model, short, 40)
    idle = [sizes for rows, sizes in steps if rows == 0 and sizes]
    assert idle[:3] == [[big], [big], [len(long_a) - 2 * big]]  # the first prompt, alone: three pieces, not nine chunks
    busy = [sizes for rows, sizes in steps if rows > 0 and sizes]
    assert all(sum(sizes) <= chunk for sizes in busy)  # beside a decoding request: chunks of 16
    assert sum(sum(sizes) for sizes in busy) == len(long_b)  # every piece of the second prompt ran beside the decoder
