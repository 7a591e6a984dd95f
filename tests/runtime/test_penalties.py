"""presence_penalty, frequency_penalty and logit_bias: the sampler's math on hand-made logits, the backends' request
bodies, and the OpenAI surface (chat and legacy completions) against ``serve.py``'s app on a real port (tiny model).

The server tests run on the embedded engine (its sampler applies them); the logprobs they return and record are of
the penalized, biased distribution (``runtime/engine.py``), and the recorded turn says so, so the learner leaves it out.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import httpx
import openai
import pytest
import torch

from learner.samples import sampled_with_penalties
from runtime.api.chat import to_internal as chat_internal
from runtime.api.completions import CompletionRequest
from runtime.api.openai_schemas import ChatCompletionRequest
from runtime.engine import GenerateRequest, SamplingParams
from runtime.engines.http_engine import LocalModel
from runtime.engines.sampling import Penalties, RowSampling, penalize, sample_next
from runtime.engines.sglang import SGLangEngine
from runtime.engines.vllm import VLLMEngine
from runtime.settings import SGLangSettings, VLLMSettings
from tests.runtime._client import assert_error, client, stream_chat

ADMIN = "admin-secret"
MODEL = "tiny"
USER = [{"role": "user", "content": "Tell me something about the weather."}]

LOGITS = torch.tensor(
    [
        [1.0, 3.0, 2.0, -1.0, 0.5],
        [0.0, -2.0, 0.1, 4.0, 3.9],
    ]
)


def row(temperature: float = 0.0, penalties: Penalties | None = None, top_logprobs: int = 0, seed: int | None = None) -> RowSampling:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return RowSampling(temperature=temperature, top_p=1.0, generator=gen, top_logprobs=top_logprobs, penalties=penalties)


def seen(p: Penalties, *tokens: int) -> Penalties:
    for t in tokens:
        p.seen(t)
    return p


# ---- the sampler ----------------------------------------------------------------------------------


def test_penalties_and_bias_hand_computed() -> None:
    # row 0 generated token 1 twice and token 2 once; frequency 0.5, presence 1.0, bias +2 on token 4
    p = seen(Penalties(presence=1.0, frequency=0.5, bias=((4, 2.0),)), 1, 1, 2)
    adjusted = penalize(LOGITS.clone(), [row(penalties=p), row()])
    # t0: 1 (never generated); t1: 3 - 0.5*2 - 1 = 1; t2: 2 - 0.5*1 - 1 = 0.5; t3: -1; t4: 0.5 + 2 = 2.5
    assert adjusted[0].tolist() == pytest.approx([1.0, 1.0, 0.5, -1.0, 2.5], abs=1e-6)
    assert torch.equal(adjusted[1], LOGITS[1])  # a row without penalties is untouched
    out = sample_next(LOGITS.clone(), [row(penalties=p), row()])
    assert out.token_ids == [4, 3]  # without the penalties row 0's argmax would be token 1
    denom = sum(math.exp(x) for x in [1.0, 1.0, 0.5, -1.0, 2.5])
    assert out.logprobs[0] == pytest.approx(2.5 - math.log(denom), abs=1e-6)  # the processed distribution's logprob
    assert out.logprobs[1] == pytest.approx(torch.log_softmax(LOGITS[1], -1)[3].item(), abs=1e-6)


def test_counts_are_the_rows_own_outputs_step_by_step() -> None:
    p = Penalties(presence=1.0, frequency=0.5)
    assert penalize(LOGITS[:1].clone(), [row(penalties=p)])[0].tolist() == pytest.approx(LOGITS[0].tolist())  # nothing generated yet
    p.seen(1)
    step2 = penalize(LOGITS[:1].clone(), [row(penalties=p)])[0]
    assert step2.tolist() == pytest.approx([1.0, 3.0 - 1.5, 2.0, -1.0, 0.5])
    p.seen(1)
    p.seen(3)
    step3 = penalize(LOGITS[:1].clone(), [row(penalties=p)])[0]
    assert step3.tolist() == pytest.approx([1.0, 3.0 - 2.0, 2.0, -1.0 - 1.5, 0.5])


def test_temperature_divides_the_penalized_logits_and_top_logprobs_follow() -> None:
    p = seen(Penalties(frequency=1.0, bias=((0, -3.0),)), 1)
    out = sample_next(LOGITS[:1].clone(), [row(temperature=0.5, penalties=p, top_logprobs=5, seed=0)])
    processed = torch.tensor([1.0 - 3.0, 3.0 - 1.0, 2.0, -1.0, 0.5]) / 0.5
    lp = torch.log_softmax(processed, -1)
    assert out.logprobs[0] == pytest.approx(lp[out.token_ids[0]].item(), abs=1e-6)
    assert [v for _, v in out.top[0]] == pytest.approx(sorted(lp.tolist(), reverse=True), abs=1e-6)


def test_negative_penalties_encourage_repetition_and_bias_cannot_unmask() -> None:
    p = seen(Penalties(presence=-2.0, bias=((4, 100.0),)), 2)
    logits = LOGITS[:1].clone()
    logits[0, 4] = -math.inf  # a grammar mask: a bias never lets a forbidden token back in
    out = sample_next(logits, [row(penalties=p)])
    assert out.token_ids == [2]  # 2 + 2 = 4 beats token 1's 3
    assert not out.failed[0]


def test_a_batch_without_penalties_pays_nothing() -> None:
    logits = LOGITS.clone()
    assert penalize(logits, [row(), row(temperature=1.0)]) is logits  # the same tensor: no clone, no arithmetic


def test_several_penalized_rows_in_one_batch() -> None:
    logits = torch.zeros(3, 6)
    a = seen(Penalties(frequency=1.0), 0, 0, 5)
    b = Penalties(bias=((2, 1.5), (2, 0.5)))  # the same id twice adds up, as an index_put with accumulate does
    adjusted = penalize(logits, [row(penalties=a), row(), row(penalties=b)])
    assert adjusted.tolist() == [[-2.0, 0.0, 0.0, 0.0, 0.0, -1.0], [0.0] * 6, [0.0, 0.0, 2.0, 0.0, 0.0, 0.0]]
    assert logits.abs().sum() == 0  # the input is not modified


def test_zero_penalties_and_zero_bias_are_not_penalized() -> None:
    assert not SamplingParams().penalized
    assert not SamplingParams(logit_bias=((5, 0.0),)).penalized
    assert SamplingParams(presence_penalty=0.1).penalized and SamplingParams(frequency_penalty=-0.1).penalized
    assert SamplingParams(logit_bias=((5, -1.0),)).penalized


# ---- the schemas ----------------------------------------------------------------------------------


def test_schemas_take_penalties_and_normalise_the_bias() -> None:
    chat = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": USER, "presence_penalty": -2, "frequency_penalty": 2, "logit_bias": {"007": 5, "9": -100}}
    )
    internal = chat_internal(chat)
    assert (internal.presence_penalty, internal.frequency_penalty, internal.logit_bias) == (-2.0, 2.0, {7: 5.0, 9: -100.0})
    plain = chat_internal(ChatCompletionRequest.model_validate({"model": MODEL, "messages": USER}))
    assert (plain.presence_penalty, plain.frequency_penalty, plain.logit_bias) == (0.0, 0.0, {})
    legacy = CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", "frequency_penalty": 1.5, "logit_bias": {"3": 1}})
    assert legacy.frequency_penalty == 1.5 and legacy.logit_bias == {"3": 1.0}


# ---- the backends' request bodies -----------------------------------------------------------------


@pytest.fixture(scope="module")
def local(tiny_model_path) -> LocalModel:
    from transformers import AutoTokenizer

    return LocalModel(tiny_model_path, AutoTokenizer.from_pretrained(tiny_model_path), None, 2048, 2000, (2,))


PENALIZED = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, logit_bias=((7, 100.0), (9, -5.0)))


def test_vllm_body_carries_the_penalties_and_bias(tiny_model_path, local) -> None:
    engine = VLLMEngine("http://x", tiny_model_path, model_id="tiny", settings=VLLMSettings(), local=local)
    engine.served = "base"
    body = engine._body(GenerateRequest("r", (5,), PENALIZED), "e", stream=False)
    assert (body["presence_penalty"], body["frequency_penalty"], body["logit_bias"]) == (0.5, -0.25, {"7": 100.0, "9": -5.0})
    plain = engine._body(GenerateRequest("r", (5,), SamplingParams()), "e", stream=False)
    assert (plain["presence_penalty"], plain["frequency_penalty"]) == (0.0, 0.0) and "logit_bias" not in plain  # explicit off


def test_sglang_body_carries_the_penalties_and_bias_only_when_set(tiny_model_path, local) -> None:
    engine = SGLangEngine("http://x", tiny_model_path, model_id="tiny", settings=SGLangSettings(), local=local)
    params = engine._body(GenerateRequest("r", (5,), PENALIZED), "e", stream=False)["sampling_params"]
    assert (params["presence_penalty"], params["frequency_penalty"], params["logit_bias"]) == (0.5, -0.25, {"7": 100.0, "9": -5.0})
    plain = engine._body(GenerateRequest("r", (5,), SamplingParams()), "e", stream=False)["sampling_params"]
    assert not {"presence_penalty", "frequency_penalty", "logit_bias"} & set(plain)


# ---- the OpenAI surface ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pen_server(start_server):
    return start_server("--admin-key", ADMIN)


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def vocab(tiny_model_path) -> int:
    """The served model's vocabulary size (its config's: the ids a logit bias may name)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(tiny_model_path).vocab_size)


@pytest.fixture(scope="module")
def word_id(tok) -> int:
    """An ordinary (non-special, alphabetic) token of the tiny model's vocabulary."""
    special = set(tok.all_special_ids)
    return next(i for i in range(100, len(tok)) if i not in special and tok.decode([i]).strip().isalpha())


def turn_of(server: Any, trajectory_id: str) -> dict[str, Any]:
    r = httpx.get(server.base_url + f"/admin/trajectories/{trajectory_id}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert r.status_code == 200, r.text
    [turn] = r.json()["turns"]
    return turn


def test_penalties_accepted_by_the_openai_client_and_recorded(pen_server) -> None:
    c = client(pen_server)
    r = c.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, temperature=0.8, seed=1, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={"100": -2}
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    turn = turn_of(pen_server, r.model_extra["loopwise"]["trajectory_id"])
    s = turn["sampling"]
    assert (s["presence_penalty"], s["frequency_penalty"], s["logit_bias"]) == (0.6, 0.4, {"100": -2.0})
    assert sampled_with_penalties(s)  # what the learner reads: this turn never trains
    plain = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0.8, seed=1)
    s = turn_of(pen_server, plain.model_extra["loopwise"]["trajectory_id"])["sampling"]
    assert (s["presence_penalty"], s["frequency_penalty"], s["logit_bias"]) == (0.0, 0.0, None) and not sampled_with_penalties(s)
    # null is "not set", as OpenAI's spec has it
    r = httpx.post(
        pen_server.url + "/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": 2, "presence_penalty": None, "frequency_penalty": None, "logit_bias": None},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_logit_bias_100_makes_greedy_output_that_token(pen_server, word_id) -> None:
    c = client(pen_server)
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0, logit_bias={str(word_id): 100}, logprobs=True)
    turn = turn_of(pen_server, r.model_extra["loopwise"]["trajectory_id"])
    assert turn["output_ids"] == [word_id] * 6 and r.choices[0].finish_reason == "length"
    # the logprobs (returned and recorded) are of the biased distribution: the token is certain there, not under the raw logits
    assert all(lp > -1e-3 for lp in turn["logprobs"]), turn["logprobs"]
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(turn["logprobs"], abs=1e-4)
    # and -100 keeps a token out entirely, whatever it was before
    first = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    ids = turn_of(pen_server, first.model_extra["loopwise"]["trajectory_id"])["output_ids"]
    banned = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0, logit_bias={str(ids[0]): -100})
    assert ids[0] not in turn_of(pen_server, banned.model_extra["loopwise"]["trajectory_id"])["output_ids"]


def _greedy_ids(server: Any, **kw: Any) -> list[int]:
    r = client(server).completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=32, temperature=0, **kw)
    return turn_of(server, r.model_extra["loopwise"]["trajectory_id"])["output_ids"]


def test_frequency_penalty_stops_the_repetition_greedy_decoding_has(pen_server) -> None:
    plain = _greedy_ids(pen_server)
    most = Counter(plain).most_common(1)[0][1]
    assert most >= 4, f"the tiny model's greedy output should repeat a token: {plain}"
    penalized = _greedy_ids(pen_server, frequency_penalty=2.0)
    assert Counter(penalized).most_common(1)[0][1] < most, (plain, penalized)
    presence = _greedy_ids(pen_server, presence_penalty=2.0)
    assert Counter(presence).most_common(1)[0][1] < most or len(set(presence)) > len(set(plain)), (plain, presence)
    assert _greedy_ids(pen_server) == plain  # the same request without penalties is unchanged: greedy is deterministic


def test_completions_logit_bias_and_streamed_chat(pen_server, word_id) -> None:
    r = client(pen_server).completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(word_id): 100})
    assert turn_of(pen_server, r.model_extra["loopwise"]["trajectory_id"])["output_ids"] == [word_id] * 3
    body = {"model": MODEL, "messages": USER, "max_tokens": 3, "temperature": 0, "logit_bias": {str(word_id): 100}, "frequency_penalty": 0.1}
    sse = stream_chat(pen_server, body)
    assert sse.status == 200 and sse.done
    [ids] = [e["loopwise"] for e in sse.events if e.get("loopwise")]
    assert turn_of(pen_server, ids["trajectory_id"])["output_ids"] == [word_id] * 3


def _bad_bias_cases(vocab: int) -> list[tuple[dict[str, Any], str]]:
    return [
        ({"logit_bias": {str(vocab): 1.0}}, "logit_bias"),  # outside the vocabulary
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "high"}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_invalid_penalties_and_logit_bias_are_400_naming_the_field(pen_server, vocab, route) -> None:
    base = {"model": MODEL, "max_tokens": 2}
    base |= {"messages": USER} if route == "chat" else {"prompt": "Hello"}
    path = "/chat/completions" if route == "chat" else "/completions"
    for fields, param in _bad_bias_cases(vocab):
        r = httpx.post(pen_server.url + path, json={**base, **fields}, timeout=60)
        err = assert_error(r, 400, param=param)
        assert param in err["message"], err
    ok = httpx.post(pen_server.url + path, json={**base, "logit_bias": {str(i): 1 for i in range(300)}}, timeout=60)
    assert ok.status_code == 200, ok.text  # OpenAI's limit is 300 entries
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client(pen_server).chat.completions.create(model=MODEL, messages=USER, max_tokens=2, logit_bias={str(vocab): 1})
        else:
            client(pen_server).completions.create(model=MODEL, prompt="Hello", max_tokens=2, logit_bias={str(vocab): 1})
    assert info.value.body["param"] == "logit_bias"


def test_pydantic_ai_chat_model_sends_penalties_and_bias(pen_server, tok, word_id) -> None:
    """A framework's own client (pydantic-ai's chat model passes these settings through; litellm and langchain are not
    installed here)."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=pen_server.url, api_key="unused"))
    settings = {"max_tokens": 4, "temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {str(word_id): 100}}
    result = Agent(model, model_settings=settings).run_sync("Say something.")
    assert result.output.replace(" ", "") == tok.decode([word_id]).strip() * 4
