"""Prompt logprobs: ``/v1/completions`` with ``echo`` + ``logprobs`` (and vLLM's ``prompt_logprobs``), as evaluation harnesses call it.

Expected numbers come from the definition, computed here with transformers: ``log_softmax`` of
``AutoModelForCausalLM``'s logits at position i - 1, read at prompt token i. The engine tests run both
embedded runners with small prefill chunks next to a decoding request (so scored chunks share forwards
with decode rows); the API tests use the real ``openai`` client against ``serve.py``'s app (fp32, the
context-dependent tiny model). The vLLM and SGLang wire formats are checked on hand-made answers, and
SGLang's end to end through the fake server the backend-parametrized tests use.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import openai
import pytest
import torch

from runtime.engine import EngineError, GenerateRequest, SamplingParams, TokenLogprob
from runtime.engines.embedded import EmbeddedEngine
from runtime.engines.http_engine import LocalModel
from runtime.engines.prompt_scoring import score_prompt, score_rows
from runtime.engines.sglang import SGLangEngine
from runtime.engines.sglang import _Decoder as SGLangDecoder
from runtime.engines.vllm import VLLMEngine
from runtime.engines.vllm import _Decoder as VLLMDecoder
from runtime.settings import SGLangSettings, VLLMSettings
from tests.runtime._client import assert_error, client
from tests.runtime._inproc import InProc, scripted_app

ADMIN = "admin-secret"
PROMPT = (
    "The quick brown fox jumps over the lazy dog, then it runs far away into the deep green forest. "
    "Nobody saw where it went, and the farmer went back to his house to sleep."
)
TOL = {"rel": 1e-4, "abs": 1e-3}  # fp32 against fp32: rounding only


# ---- the definition, with transformers ------------------------------------------------------------


class Reference:
    """A model's next-token log-probabilities straight from transformers (fp32)."""

    def __init__(self, path: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def rows(self, ids: list[int]) -> torch.Tensor:
        """``(n, V)``: row i is the log-distribution of token i + 1 given tokens 0..i."""
        with torch.no_grad():
            return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)

    def text(self, tid: int) -> str:
        return str(self.tok.decode([tid]))


def top_ids(row: torch.Tensor, k: int) -> list[int] | None:
    """The top ``k`` token ids of a row, best first; None when the k-th and the next are too close to call."""
    vals, idx = row.topk(k + 1)
    return idx[:k].tolist() if float(vals[k - 1] - vals[k]) > 1e-3 else None


def rank_of(row: torch.Tensor, tid: int) -> int:
    return int((row > row[tid]).sum()) + 1


@pytest.fixture(scope="module")
def ref(ctx_model_path) -> Reference:
    return Reference(ctx_model_path)


@pytest.fixture(scope="module")
def ids(ref) -> list[int]:
    out = ref.tok(PROMPT)["input_ids"]
    assert len(out) > 40, "the prompt must span several 16-token prefill chunks"
    return list(out)


# ---- the scoring math -------------------------------------------------------------------------------


def test_score_rows_hand_computed() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.5, 0.7, 4.0]])
    got = score_rows(logits, [2, 0], k=2)
    lse0 = math.log(sum(math.exp(x) for x in (1.0, 3.0, 2.0, -1.0)))
    lse1 = math.log(sum(math.exp(x) for x in (0.0, 0.5, 0.7, 4.0)))
    assert got[0].token_id == 2 and got[0].logprob == pytest.approx(2.0 - lse0, abs=1e-6) and got[0].rank == 2
    assert [t for t, _ in got[0].top] == [1, 2] and [v for _, v in got[0].top] == pytest.approx([3.0 - lse0, 2.0 - lse0], abs=1e-6)
    assert got[1].token_id == 0 and got[1].logprob == pytest.approx(-lse1, abs=1e-6) and got[1].rank == 4
    assert [t for t, _ in got[1].top] == [3, 2]
    assert score_rows(logits, [2, 0], k=0)[0].top == ()


def test_score_prompt_materialises_at_most_a_slice_of_positions() -> None:
    logits = torch.randn(7, 11, generator=torch.Generator().manual_seed(0))
    asked: list[tuple[int, int]] = []

    def logits_of(lo: int, hi: int) -> torch.Tensor:
        asked.append((lo, hi))
        return logits[lo:hi]

    targets = [3, 1, 4, 1, 5, 9, 2]
    sliced, whole = score_prompt(logits_of, 7, targets, 3, slice_rows=2), score_rows(logits, targets, 3)
    assert [(s.token_id, s.rank, [t for t, _ in s.top]) for s in sliced] == [(s.token_id, s.rank, [t for t, _ in s.top]) for s in whole]
    assert [s.logprob for s in sliced] == pytest.approx([s.logprob for s in whole], abs=1e-6)
    assert asked == [(0, 2), (2, 4), (4, 6), (6, 7)]
    with pytest.raises(ValueError):
        score_prompt(logits_of, 7, targets[:3], 3)


# ---- the embedded engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("runner", ["llama", "transformers"])
def test_embedded_prompt_logprobs_match_transformers_in_mixed_chunked_batches(ctx_model_path, ref, ids, runner) -> None:
    expected = ref.rows(ids)
    short = ids[:5]

    async def main() -> None:
        eng = EmbeddedEngine(ctx_model_path, model_id="ctx", dtype="float32", prefill_chunk=16, runner=runner)
        await eng.start()
        try:
            decode_sp = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
            alone = await eng.generate(GenerateRequest("alone", tuple(short), decode_sp))
            # admitted together: the short prompt decodes while the long ones are still fed 16 tokens a step
            neighbour, scored, scored_one = await asyncio.gather(
                eng.generate(GenerateRequest("n", tuple(short), decode_sp)),
                eng.generate(GenerateRequest("s", tuple(ids), SamplingParams(max_new_tokens=0, logprobs=True, prompt_logprobs=3))),
                eng.generate(GenerateRequest("g", tuple(ids), SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=2))),
            )
        finally:
            await eng.close()
        assert neighbour.output_ids == alone.output_ids and alone.prompt_logprobs is None  # not asked: none computed
        assert scored.output_ids == () and scored.finish_reason == "length" and scored.text == ""  # scoring only: no token
        assert len(scored_one.output_ids) == 1 and scored_one.output_ids[0] == int(expected[-1].argmax())
        assert scored.prompt_logprobs is not None and scored_one.prompt_logprobs is not None
        assert len(scored.prompt_logprobs) == len(ids) - 1 == len(scored_one.prompt_logprobs)
        for i, (a, b) in enumerate(zip(scored.prompt_logprobs, scored_one.prompt_logprobs, strict=True), start=1):
            row = expected[i - 1]
            assert a.token_id == b.token_id == ids[i]
            assert a.logprob == pytest.approx(float(row[ids[i]]), **TOL) and b.logprob == pytest.approx(a.logprob, **TOL)
            assert a.rank == rank_of(row, ids[i])
            assert len(a.top) == 3 and len(b.top) == 2
            assert [v for _, v in a.top] == pytest.approx(row.topk(3).values.tolist(), **TOL)
            want = top_ids(row, 3)
            if want is not None:
                assert [t for t, _ in a.top] == want

    asyncio.run(main())


# ---- the OpenAI surface (embedded engine, fp32) -------------------------------------------------------


@pytest.fixture(scope="module")
def srv(start_server, ctx_model_path):
    return start_server("--dtype", "float32", "--prefill-chunk", "16", "--admin-key", ADMIN, model=ctx_model_path, name="ctx")


def turn_of(server: Any, trajectory_id: str) -> dict[str, Any]:
    r = httpx.get(server.base_url + f"/admin/trajectories/{trajectory_id}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert r.status_code == 200, r.text
    [turn] = r.json()["turns"]
    return turn


def check_prompt_part(lp: Any, ids: list[int], ref: Reference, k: int) -> None:
    """The first ``len(ids)`` entries of a legacy ``logprobs`` object are the prompt's, as the definition has them."""
    n = len(ids)
    expected = ref.rows(ids)
    assert lp.tokens[:n] == [ref.text(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    for i in range(1, n):
        row = expected[i - 1]
        assert lp.token_logprobs[i] == pytest.approx(float(row[ids[i]]), **TOL), i
        top = lp.top_logprobs[i]
        best = row.topk(k)
        want = {ref.text(t): v for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)}
        assert len(top) == len(want) and set(top) == set(want), (i, top, want)  # k entries (fewer only if two decode alike)
        assert [top[s] for s in want] == pytest.approx(list(want.values()), **TOL)
        if ids[i] in best.indices.tolist():  # the actual token is listed with its own logprob when it is in the top k
            assert top[ref.text(ids[i])] == pytest.approx(lp.token_logprobs[i], abs=1e-6)
    offsets = lp.text_offset
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp.tokens, strict=False))


def test_echo_logprobs_with_one_token_is_the_prompt_then_the_completion(srv, ref, ids) -> None:
    r = client(srv).completions.create(model="ctx", prompt=PROMPT, echo=True, logprobs=2, max_tokens=1, temperature=0)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    check_prompt_part(lp, ids, ref, 2)
    last = ref.rows(ids)[-1]
    greedy = int(last.argmax())
    assert lp.tokens[-1] == ref.text(greedy) and lp.token_logprobs[-1] == pytest.approx(float(last[greedy]), **TOL)
    eos = greedy == ref.tok.eos_token_id  # an eos has no text but keeps its entry (as vLLM's): harnesses slice by count
    assert len(lp.top_logprobs[-1]) <= 2 and choice.text == PROMPT + ("" if eos else ref.text(greedy))
    assert choice.finish_reason == ("stop" if eos else "length")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    turn = turn_of(srv, r.model_extra["loopwise"]["trajectory_id"])  # recorded with its exact tokens, as any turn
    assert turn["context_ids"] == ids and turn["output_ids"] == [greedy] and len(turn["logprobs"]) == 1


def test_a_final_eos_keeps_its_entry_after_the_echoed_prompt(srv, ref, ids) -> None:
    eos = ref.tok.eos_token_id
    c = client(srv)
    r = c.completions.create(model="ctx", prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, logit_bias={str(eos): 100})
    lp = r.choices[0].logprobs
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == PROMPT
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[-1] == ref.text(eos) and lp.token_logprobs[-1] > -1e-3  # certain under the bias
    chunks = list(c.completions.create(model="ctx", prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, logit_bias={str(eos): 100}, stream=True))
    assert [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens] == lp.tokens
    plain = c.completions.create(model="ctx", prompt=PROMPT, logprobs=1, max_tokens=1, logit_bias={str(eos): 100})
    assert plain.choices[0].logprobs.tokens == []  # without echo the stop token stays out, as before


def test_max_tokens_0_scores_the_prompt_only(srv, ref, ids) -> None:
    c = client(srv)
    r = c.completions.create(model="ctx", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and len(choice.logprobs.tokens) == len(ids)
    check_prompt_part(choice.logprobs, ids, ref, 1)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    turn = turn_of(srv, r.model_extra["loopwise"]["trajectory_id"])
    assert turn["context_ids"] == ids and turn["output_ids"] == [] and turn["finish_reason"] == "length"
    # the same prompt as token ids scores the same; a batch of prompts scores each
    by_ids = c.completions.create(model="ctx", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert by_ids.choices[0].logprobs.token_logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
    other = ids[3:20]
    batch = c.completions.create(model="ctx", prompt=[ids, other], echo=True, logprobs=1, max_tokens=0)
    assert [ch.index for ch in batch.choices] == [0, 1]
    check_prompt_part(batch.choices[1].logprobs, other, ref, 1)
    assert len(batch.choices[1].logprobs.tokens) == len(other)


def test_echo_without_logprobs_and_logprobs_without_echo_are_unchanged(srv, ref, ids) -> None:
    c = client(srv)
    r = c.completions.create(model="ctx", prompt=PROMPT, echo=True, max_tokens=3, temperature=0)
    assert r.choices[0].text.startswith(PROMPT) and r.choices[0].logprobs is None
    r = c.completions.create(model="ctx", prompt=PROMPT, echo=True, max_tokens=0)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None
    r = c.completions.create(model="ctx", prompt=PROMPT, logprobs=2, max_tokens=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) <= 2 and lp.text_offset[:1] in ([], [0])  # the completion's tokens only, no prompt


def test_vllm_prompt_logprobs_field(srv, ref, ids) -> None:
    r = client(srv).completions.create(model="ctx", prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 3})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    expected = ref.rows(ids)
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        row = expected[i - 1]
        mine = plp[i][str(ids[i])]
        assert mine["logprob"] == pytest.approx(float(row[ids[i]]), **TOL) and mine["rank"] == rank_of(row, ids[i])
        assert mine["decoded_token"] == ref.text(ids[i])
        assert {str(t) for t in row.topk(3).indices.tolist()} <= set(plp[i]) and len(plp[i]) in (3, 4)
    assert r.choices[0].logprobs is None and not r.choices[0].text.startswith(PROMPT)  # no echo asked


def test_streamed_echo_sends_the_prompt_logprobs_first(srv, ref, ids) -> None:
    c = client(srv)
    whole = c.completions.create(model="ctx", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    chunks = [ch for ch in c.completions.create(model="ctx", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0, stream=True)]
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.tokens == whole.choices[0].logprobs.tokens[: len(ids)]
    assert first.logprobs.token_logprobs[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1 : len(ids)], abs=1e-5)
    tokens = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens and offsets == whole.choices[0].logprobs.text_offset  # offsets continue after the prompt
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text


def test_n_choices_share_the_prompt_part(srv, ids) -> None:
    r = client(srv).completions.create(model="ctx", prompt=PROMPT, echo=True, logprobs=1, max_tokens=2, n=2, temperature=1.0, seed=3)
    a, b = (ch.logprobs for ch in r.choices)
    assert a.tokens[: len(ids)] == b.tokens[: len(ids)] and a.token_logprobs[: len(ids)] == b.token_logprobs[: len(ids)]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"echo": True, "logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"prompt": [[5] * 100] * 10, "n": 16, "echo": True, "logprobs": 20, "max_tokens": 0}, "logprobs"),  # over MAX_PROMPT_SCORES
    ],
)
def test_bad_combinations_are_400_in_openai_envelope(srv, body, param) -> None:
    r = httpx.post(srv.url + "/completions", json={"model": "ctx", "prompt": PROMPT, **body}, timeout=60)
    assert_error(r, 400, param=param)


# ---- an engine without prompt logprobs ---------------------------------------------------------------


def test_an_engine_without_prompt_logprobs_answers_a_clear_400(tiny_model_path, tmp_path) -> None:
    from transformers import AutoTokenizer

    app, _, _ = scripted_app(AutoTokenizer.from_pretrained(tiny_model_path), lambda req: "ok", tmp_path)
    srv = InProc(app)
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="x", http_client=srv.client, max_retries=0)
        with pytest.raises(openai.BadRequestError) as ei:
            c.completions.create(model="tiny", prompt="hi", echo=True, logprobs=1, max_tokens=1)
        assert ei.value.body["param"] == "logprobs" and "prompt logprobs" in ei.value.body["message"]
        with pytest.raises(openai.BadRequestError) as ei:
            c.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body={"prompt_logprobs": 1})
        assert ei.value.body["param"] == "prompt_logprobs"
        assert c.completions.create(model="tiny", prompt="hi", echo=True, max_tokens=2).choices[0].text.startswith("hi")
    finally:
        srv.close()


# ---- every backend (embedded, SGLang through its fake; vLLM under make test-engines) ------------------


@pytest.fixture(scope="module")
def served_ref(served_model_path) -> Reference:
    return Reference(served_model_path)


def test_each_backend_returns_prompt_logprobs(served, served_ref) -> None:
    """The shared server of each backend (its default dtype: bf16 on CPUs with native bf16, so a looser tolerance)."""
    ids = served_ref.tok(PROMPT)["input_ids"]
    expected = served_ref.rows(ids)
    c = client(served)
    for stream in (False, True):
        if stream:
            chunks = list(c.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=1, temperature=0, stream=True))
            lp = chunks[0].choices[0].logprobs
            assert chunks[0].choices[0].text == PROMPT
        else:
            lp = c.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=0).choices[0].logprobs
        assert lp.tokens[: len(ids)] == [served_ref.text(t) for t in ids] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [float(expected[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=0.05)
        assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1 : len(ids)])  # 2 alternatives (1 only where two decode alike)
    plp = c.completions.create(model="tiny", prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 1}).choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and [e[str(t)]["logprob"] for e, t in zip(plp[1:], ids[1:], strict=True)] == pytest.approx(want, abs=0.05)


# ---- the vLLM and SGLang wire formats -----------------------------------------------------------------


@pytest.fixture(scope="module")
def local(tiny_model_path) -> LocalModel:
    from transformers import AutoTokenizer

    return LocalModel(tiny_model_path, AutoTokenizer.from_pretrained(tiny_model_path), None, 2048, 2000, (2,))


VLLM_PROMPT_LOGPROBS = [
    None,
    {
        "6": {"logprob": -1.5, "rank": 3, "decoded_token": "a"},
        "7": {"logprob": -0.5, "rank": 1, "decoded_token": "b"},
        "8": {"logprob": -1.0, "rank": 2},
    },
    {"9": {"logprob": -9999.0, "rank": 40, "decoded_token": "c"}, "7": {"logprob": -0.25, "rank": 1, "decoded_token": "b"}},
]


def _vllm_answer(token_ids: list[int], prompt_logprobs: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": "x", "finish_reason": "length", "stop_reason": None, "token_ids": token_ids, "logprobs": None}
    return {"choices": [{**choice, "prompt_logprobs": prompt_logprobs}]}


def test_vllm_body_and_prompt_logprobs_decoding(tiny_model_path, local) -> None:
    engine = VLLMEngine("http://x", tiny_model_path, model_id="tiny", settings=VLLMSettings(), local=local)
    engine.served = "base"
    body = engine._body(GenerateRequest("r", (5, 6, 9), SamplingParams(max_new_tokens=0, prompt_logprobs=2)), "e", stream=False)
    assert body["prompt_logprobs"] == 2 and body["max_tokens"] == 1  # vLLM generates at least one token: the decoder drops it
    assert "prompt_logprobs" not in engine._body(GenerateRequest("r", (5,), SamplingParams()), "e", stream=False)
    assert engine._streams(GenerateRequest("r", (5,), SamplingParams(prompt_logprobs=0))) is False  # vLLM refuses them on a stream
    req = GenerateRequest("r", (5, 6, 9), SamplingParams(max_new_tokens=0, prompt_logprobs=2))
    chunk = VLLMDecoder(req, local.tokenizer, frozenset({2})).feed(_vllm_answer([11], VLLM_PROMPT_LOGPROBS))
    assert chunk is not None and chunk.token_ids == () and chunk.finish_reason == "length" and chunk.text == ""
    assert chunk.prompt_logprobs == (
        TokenLogprob(6, -1.5, ((7, -0.5), (8, -1.0)), 3),
        TokenLogprob(9, -math.inf, ((7, -0.25), (9, -math.inf)), 40),
    )
    one = GenerateRequest("r", (5, 6, 9), SamplingParams(max_new_tokens=1, prompt_logprobs=1))
    chunk = VLLMDecoder(one, local.tokenizer, frozenset({2})).feed(_vllm_answer([11], VLLM_PROMPT_LOGPROBS))
    assert chunk is not None and chunk.token_ids == (11,) and chunk.prompt_logprobs is not None and chunk.prompt_logprobs[0].top == ((7, -0.5),)
    with pytest.raises(EngineError, match="2 prompt logprobs for a prompt of 3"):
        VLLMDecoder(one, local.tokenizer, frozenset({2})).feed(_vllm_answer([11], VLLM_PROMPT_LOGPROBS[:2]))


def test_vllm_streamed_prompt_logprobs_are_one_non_streamed_call(tiny_model_path, local) -> None:
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=_vllm_answer([11, 12], VLLM_PROMPT_LOGPROBS))

    async def main() -> list[Any]:
        engine = VLLMEngine("http://x", tiny_model_path, model_id="tiny", settings=VLLMSettings(), local=local)
        engine.served = "base"
        engine._client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x")
        req = GenerateRequest("r", (5, 6, 9), SamplingParams(max_new_tokens=2, prompt_logprobs=2))
        try:
            return [c async for c in engine.stream(req)]
        finally:
            await engine._client.aclose()

    chunks = asyncio.run(main())
    assert len(sent) == 1 and sent[0]["stream"] is False and sent[0]["prompt_logprobs"] == 2
    [chunk] = chunks
    assert chunk.token_ids == (11, 12) and chunk.finish_reason == "length" and chunk.prompt_logprobs is not None and len(chunk.prompt_logprobs) == 2


def _sglang_answer(ids: list[int], finish: Any, inputs: Any, tops: Any) -> dict[str, Any]:
    meta = {
        "id": "x",
        "finish_reason": finish,
        "output_token_logprobs": [[-0.1, t, None] for t in ids],
        "output_top_logprobs": [[[-0.1, t, None], [-0.2, 3, None]] for t in ids],
    }
    return {"text": "", "output_ids": ids, "meta_info": {**meta, "input_token_logprobs": inputs, "input_top_logprobs": tops}}


def test_sglang_body_and_input_logprobs_decoding(tiny_model_path, local) -> None:
    engine = SGLangEngine("http://x", tiny_model_path, model_id="tiny", settings=SGLangSettings(), local=local)
    sp = SamplingParams(max_new_tokens=0, logprobs=True, top_logprobs=1, prompt_logprobs=3)
    body = engine._body(GenerateRequest("r", (5, 6, 9), sp), "e", stream=False)
    assert (body["return_logprob"], body["logprob_start_len"], body["top_logprobs_num"]) == (True, 0, 3)
    assert body["sampling_params"]["max_new_tokens"] == 0  # SGLang's prefill-only request
    assert "logprob_start_len" not in engine._body(GenerateRequest("r", (5,), SamplingParams(logprobs=True)), "e", stream=False)
    inputs = [[None, 5, None], [-1.25, 6, None], [-2.5, 9, None]]
    tops = [None, [[-0.5, 7, None], [-1.0, 8, None], [-1.25, 6, None]], [[-0.75, 7, None], [-1.5, 8, None], [-2.0, 4, None]]]
    req = GenerateRequest("r", (5, 6, 9), sp)
    chunk = SGLangDecoder(req, local.tokenizer, False).feed(_sglang_answer([], {"type": "length", "length": 0}, inputs, tops))
    assert chunk is not None and chunk.token_ids == () and chunk.finish_reason == "length"
    assert chunk.prompt_logprobs == (
        TokenLogprob(6, -1.25, ((7, -0.5), (8, -1.0), (6, -1.25))),
        TokenLogprob(9, -2.5, ((7, -0.75), (8, -1.5), (4, -2.0))),
    )
    # an incremental stream sends the prompt's logprobs with its first event only; they ride on the first chunk
    dec = SGLangDecoder(GenerateRequest("r", (5, 6, 9), SamplingParams(max_new_tokens=2, logprobs=True, prompt_logprobs=1)), local.tokenizer, True)
    first = dec.feed(_sglang_answer([11], None, inputs, tops))
    second = dec.feed(_sglang_answer([12], {"type": "length", "length": 2}, None, None))
    assert first is not None and first.prompt_logprobs is not None and first.prompt_logprobs[0].top == ((7, -0.5),)
    assert second is not None and second.prompt_logprobs is None and second.logprobs[0].top == ()  # output tops cut to their own k (0)
    with pytest.raises(EngineError, match="not prompt token 9"):
        SGLangDecoder(req, local.tokenizer, False).feed(_sglang_answer([], {"type": "length"}, [inputs[0], inputs[1], [-1.0, 8, None]], tops))
