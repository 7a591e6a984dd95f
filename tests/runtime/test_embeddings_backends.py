"""``POST /v1/embeddings`` on every backend: the embedded engine's own forward pass, and on the external backends
(SGLang here, behind its protocol fake; vLLM with ``make test-engines``) a local CPU copy of the base model
(``runtime/engines/local_embedder.py``). Both give the base model's pooled final hidden states, checked against
transformers' ``AutoModel`` on the same tokens."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from runtime.engine import NotSupported
from runtime.engines.local_embedder import LocalEmbedder
from tests.runtime._client import MODEL, client

TEXTS = ["The cat sat on the mat.", "Stocks fell sharply on Monday."]


def test_embeddings_answer_on_every_backend(served: Any, tiny_model_path: Any) -> None:
    c = client(served)
    got = c.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    last = c.embeddings.create(model=MODEL, input=TEXTS[:1], encoding_format="float", extra_body={"pooling": "last"})
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModel.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
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
