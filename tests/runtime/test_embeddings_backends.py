"""``POST /v1/embeddings`` on every backend: the embedded engine's own forward pass, and on the external backends
(SGLang here, behind its protocol fake; vLLM with ``make test-engines``) a local CPU copy of the base model
(``runtime/engines/local_embedder.py``). Both give the base model's pooled final hidden states, checked against
transformers' ``AutoModel`` on the same tokens.

Where the external engine serves a pooling (embedding) model (vLLM ``--runner pooling``, behind the protocol fake of
``tests/fakes/vllm_server.py``; SGLang ``--is-embedding``, behind its fake's flag), the vectors are the engine's own:
the same as its ``/v1/embeddings`` answers for the same token ids (its model pools the last token, not loopwise's
mean), and the response's ``loopwise`` object says which source, backend and pooling gave them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from runtime.engine import NotSupported
from runtime.engines.local_embedder import LocalEmbedder
from tests.fakes.sglang_process import FakeSGLang
from tests.fakes.vllm_process import FakeVLLMPooling
from tests.runtime._client import MODEL, USER, client

TEXTS = ["The cat sat on the mat.", "Stocks fell sharply on Monday."]


def test_embeddings_answer_on_every_backend(served: Any, backend: str, served_model_path: Any) -> None:
    c = client(served)
    got = c.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    last = c.embeddings.create(model=MODEL, input=TEXTS[:1], encoding_format="float", extra_body={"pooling": "last"})
    # the embedded engine's own forward; on SGLang and vLLM serving a generative model, this server's local copy
    source = "embedded" if backend == "embedded" else "local"
    assert got.model_extra["loopwise"] == {"source": source, "backend": backend, "pooling": "mean"}
    assert last.model_extra["loopwise"]["pooling"] == "last"
    tok = AutoTokenizer.from_pretrained(served_model_path)
    model = AutoModel.from_pretrained(served_model_path, dtype=torch.float32).eval()
    for i, text in enumerate(TEXTS):
        with torch.no_grad():
            h = model(input_ids=torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0].double().numpy()
        for v, want in [(got.data[i].embedding, h.mean(0))] + ([(last.data[0].embedding, h[-1])] if i == 0 else []):
            v = np.array(v)
            assert abs(np.linalg.norm(v) - 1) < 1e-4
            # bf16 where the CPU has native bf16 (the engine's and the local copy's --dtype auto), else fp32
            assert float(v @ want / np.linalg.norm(want)) > 0.99
    assert got.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)


def test_a_model_too_large_for_the_local_copy_is_a_clear_not_supported(tiny_model_path: Any) -> None:
    engine = SimpleNamespace(info=SimpleNamespace(backend="vllm", max_model_len=64))
    embedder = LocalEmbedder(tiny_model_path, engine, max_bytes=1)
    with pytest.raises(NotSupported, match="exceed the"):
        asyncio.run(embedder.embed([(1, 2, 3)], "mean"))
    assert embedder._model is None  # nothing was loaded


def test_the_local_copy_matches_the_models_own_states(tiny_model_path: Any) -> None:
    engine = SimpleNamespace(info=SimpleNamespace(backend="sglang", max_model_len=64))
    embedder = LocalEmbedder(tiny_model_path, engine)
    ids = (1, 5, 9, 2)
    [mean], [last] = asyncio.run(embedder.embed([ids], "mean")), asyncio.run(embedder.embed([ids], "last"))
    model = AutoModel.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        h = model(input_ids=torch.tensor([ids])).last_hidden_state[0].double().numpy()
    for v, want in ((mean, h.mean(0)), (last, h[-1])):
        v = np.array(v)
        assert float(v @ want / (np.linalg.norm(v) * np.linalg.norm(want))) > 0.99


# ---- an external engine serving a pooling model ------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_pooling(tiny_model_path: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    fake = FakeVLLMPooling(tiny_model_path, tmp_path_factory.mktemp("fake-vllm"))
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def sglang_embedding(tiny_model_path: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    fake = FakeSGLang(tiny_model_path, tmp_path_factory.mktemp("fake-sglang-embedding"), "--is-embedding")
    yield fake
    fake.stop()


def _last_token_states(tiny_model_path: Any, ids: list[list[int]]) -> list[np.ndarray]:
    model = AutoModel.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([x])).last_hidden_state[0].double().numpy() for x in ids]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_embeddings_come_from_an_engine_that_serves_a_pooling_model(engine, request, start_server, tiny_model_path):
    fake = request.getfixturevalue("vllm_pooling" if engine == "vllm" else "sglang_embedding")
    flags = ("--backend", "vllm", "--engine-url", fake.url) if engine == "vllm" else ("--backend", "sglang", "--sglang-url", fake.url)
    srv = start_server(*flags)
    c = client(srv)
    got = c.embeddings.create(model=MODEL, input=TEXTS)  # the SDK's default: base64, decoded to floats by the SDK
    floats = c.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    pooling = {"source": "engine", "backend": engine, "pooling": "model_defined", "normalized": None if engine == "vllm" else True}
    assert got.model_extra["loopwise"] == floats.model_extra["loopwise"] == pooling
    # exactly the engine's own answer for the same token ids
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    own = httpx.post(fake.url + "/v1/embeddings", json={"model": MODEL, "input": ids, "encoding_format": "float"}, timeout=60)
    assert own.status_code == 200, own.text
    want = [d["embedding"] for d in sorted(own.json()["data"], key=lambda d: d["index"])]
    assert [d.embedding for d in floats.data] == want
    assert np.allclose([d.embedding for d in got.data], want, atol=1e-6)  # float32 on the wire
    assert floats.usage.prompt_tokens == sum(map(len, ids))
    # the engine's model pools the last token (not loopwise's mean of the base model's states)
    for v, h in zip(want, _last_token_states(tiny_model_path, ids), strict=True):
        v = np.array(v)
        assert abs(np.linalg.norm(v) - 1) < 1e-4
        assert float(v @ h[-1] / np.linalg.norm(h[-1])) > 0.99
        assert float(v @ h.mean(0) / np.linalg.norm(h.mean(0))) < 0.99
    # token ids in, and the loopwise pooling field, which an engine's model does not take
    assert c.embeddings.create(model=MODEL, input=ids[0], encoding_format="float").data[0].embedding == want[0]
    with pytest.raises(openai.BadRequestError) as ei:
        c.embeddings.create(model=MODEL, input=TEXTS, extra_body={"pooling": "last"})
    assert ei.value.body["param"] == "pooling" and "pooling model" in ei.value.body["message"]
    # dimensions are the engine's to refuse (this model is not Matryoshka)
    with pytest.raises(openai.BadRequestError) as ei:
        c.embeddings.create(model=MODEL, input=TEXTS, dimensions=8)
    assert ei.value.body["param"] == "dimensions" and "matryoshka" in ei.value.body["message"]
    # such a server cannot generate: a clear 501, not the server's 404; /health embeds instead
    with pytest.raises(openai.APIStatusError) as ei:
        c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    assert ei.value.status_code == 501 and "pooling (embedding) model" in ei.value.body["message"]
    assert httpx.get(srv.base_url + "/health", timeout=60).status_code == 200
