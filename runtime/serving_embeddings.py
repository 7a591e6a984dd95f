"""``POST /v1/embeddings``: hidden states of the served base model, pooled per input.

Each input (a string, a list of strings, a list of token ids or a list of such lists; at most 2048
inputs, each at most the model's context length) is tokenized as the tokenizer does by default and
run through the base model (never an adapter) by the engine (:class:`runtime.engine.Embedder`). The
embedding is the model's final hidden state (after its last norm) pooled over the input's tokens:
``mean`` by default, or ``last`` (the last token's state) with the loopwise extension field
``pooling``; then scaled to unit length, as OpenAI's embeddings are. ``encoding_format: "base64"``
returns little-endian float32 bytes (what the openai SDK asks for by default); ``float``, left out or ``null`` (as
litellm sends it) returns lists of floats. A chat model's hidden
states are not trained as sentence embeddings: fine for clustering and retrieval experiments, not a
replacement for a dedicated embedding model.

``model`` must be the base model's id; ``dimensions`` other than the model's hidden size is a 400
(the states cannot be shortened meaningfully). On the external backends (vLLM, SGLang, whose servers pool nothing
for a generative model) the same states come from a local CPU copy of the base model, loaded on the first request
(``runtime/engines/local_embedder.py``; a 501 when its weights are too large for that).

Not here: the forward pass (the engine's ``embed``).
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field, ValidationError, model_validator

from runtime.engine import Embedder, InvalidRequest, NotSupported
from runtime.errors import APIError, from_engine, from_validation
from runtime.http_body import read_json
from runtime.openai_schemas import FieldError, _In
from runtime.serving import Gateway

MAX_INPUTS = 2048
MAX_TOTAL_TOKENS = 65_536  # per request: bounds how long one request holds the engine


class EmbeddingRequest(_In):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None  # null (litellm sends it) is the default, float
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    pooling: Literal["mean", "last"] = "mean"

    @model_validator(mode="after")
    def _non_empty(self) -> EmbeddingRequest:
        if self.input == "" or self.input == [] or (isinstance(self.input, list) and any(x in ("", []) for x in self.input)):
            raise FieldError("input", "input must not be empty (nor contain empty strings or empty token lists)")
        return self

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if all(isinstance(v, int) for v in x):
            return [list(x)]  # type: ignore[arg-type]
        return list(x)  # type: ignore[arg-type]


def install_embeddings_routes(app: FastAPI, gateway: Gateway, model_id: str, max_body: int, fallback: Embedder | None = None) -> None:
    """The route; ``fallback`` embeds for an engine that cannot (``runtime/engines/local_embedder.py``)."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        body = await read_json(request, max_body)
        try:
            req = EmbeddingRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc) from None
        if req.model != model_id:
            raise APIError(
                400,
                f"Embeddings come from the base model's hidden states; set model to `{model_id}` (adapters and agents have no embeddings here).",
                param="model",
                code="model_not_supported",
            )
        served = gateway.engine()
        engine = served if isinstance(served, Embedder) else fallback
        if engine is None:
            raise from_engine(NotSupported(f"embeddings are not supported by the {served.info.backend} backend"))
        inputs = req.inputs()
        if len(inputs) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} inputs per request", param="input")
        tokenizer, vocab, max_len = gateway.tokenizer(), gateway.vocab_size(), engine.info.max_model_len
        ids: list[tuple[int, ...]] = []
        for i, x in enumerate(inputs):
            param = "input" if len(inputs) == 1 else f"input[{i}]"
            seq = tuple(tokenizer(x)["input_ids"]) if isinstance(x, str) else tuple(x)
            if isinstance(x, list) and (bad := next((t for t in x if not 0 <= t < vocab), None)) is not None:
                raise APIError(400, f"token id {bad} is outside this model's vocabulary (0 to {vocab - 1})", param=param)
            if len(seq) > max_len:
                raise APIError(400, f"input has {len(seq)} tokens; this model's maximum context length is {max_len}", param=param)
            ids.append(seq)
        total = sum(len(s) for s in ids)
        if total > MAX_TOTAL_TOKENS:
            raise APIError(400, f"the inputs hold {total} tokens; at most {MAX_TOTAL_TOKENS} per request", param="input")
        try:
            vectors = await engine.embed(ids, req.pooling)
        except (InvalidRequest, NotSupported) as exc:
            raise from_engine(exc) from exc
        if req.dimensions is not None and vectors and req.dimensions != len(vectors[0]):
            raise APIError(400, f"dimensions must be {len(vectors[0])} (this model's hidden size) or left out", param="dimensions")
        data = []
        for i, v in enumerate(vectors):
            norm = math.sqrt(sum(x * x for x in v)) or 1.0
            unit = [x / norm for x in v]
            value: Any = base64.b64encode(struct.pack(f"<{len(unit)}f", *unit)).decode() if req.encoding_format == "base64" else unit
            data.append({"object": "embedding", "index": i, "embedding": value})
        return {"object": "list", "model": req.model, "data": data, "usage": {"prompt_tokens": total, "total_tokens": total}}
