"""``POST /v1/embeddings``: the served model's embeddings, from the engine that serves it where it pools, else the base
model's hidden states pooled per input.

Each input (a string, a list of strings, a list of token ids or a list of such lists; at most 2048
inputs, each at most the model's context length) is tokenized as the tokenizer does by default. Where the vectors
come from, in this order (the response's ``loopwise`` object says which: ``source``, ``backend``, ``pooling``):

- ``engine``: on the vLLM and SGLang backends, when the external engine serves a pooling (embedding) model (vLLM
  ``--runner pooling``, SGLang ``--is-embedding``; detected when loopwise connects, ``runtime/engines/http_engine.py``),
  the token ids go to the engine's own ``POST /v1/embeddings`` and its vectors come back as it computed them (its
  model's pooling and normalization: ``pooling`` says what the engine reports, ``model_defined`` where it does not).
  The loopwise field ``pooling`` cannot change how an engine's model pools (400); ``dimensions`` is passed on (the
  engine accepts it for a Matryoshka model and refuses it otherwise);
- ``embedded``: on the embedded backend, the engine's own forward pass (:class:`runtime.engine.Embedder`);
- ``local``: on the vLLM and SGLang backends when the engine serves a generative model (whose servers pool nothing
  for it), a local CPU copy of the base model this server loads on the first request
  (``runtime/engines/local_embedder.py``; a 501 when its weights are too large for that).

For ``embedded`` and ``local`` the embedding is the base model's (never an adapter's) final hidden state (after its
last norm) pooled over the input's tokens: ``mean`` by default, or ``last`` (the last token's state) with the loopwise
extension field ``pooling``; then scaled to unit length, as OpenAI's embeddings are. A chat model's hidden states are
not trained as sentence embeddings: fine for clustering and retrieval experiments, not a replacement for a dedicated
embedding model (which is what an engine's pooling model is). ``dimensions`` other than the hidden size is a 400 there
(the states cannot be shortened meaningfully).

``encoding_format: "base64"`` returns little-endian float32 bytes (what the openai SDK asks for by default); ``float``,
left out or ``null`` (as litellm sends it) returns lists of floats. ``model`` must be the served model's id.

Not here: the forward passes (the engines' ``embed`` / ``pool``).
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import Field, model_validator

from runtime.admission import MAX_CHARS_PER_TOKEN
from runtime.api.openai_schemas import FieldError, _In
from runtime.engine import Embedder, EngineError, NotSupported, PoolingEngine
from runtime.errors import APIError, from_engine
from runtime.http_body import json_body
from runtime.services import services

router = APIRouter()

MAX_INPUTS = 2048
MAX_TOTAL_TOKENS = 65_536  # per request: bounds how long one request holds the engine


class EmbeddingRequest(_In):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None  # null (litellm sends it) is the default, float
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    pooling: Literal["mean", "last"] | None = None  # loopwise's extension, for the base model's states (default mean)

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


@router.post("/v1/embeddings")
async def embeddings(request: Request, req: Annotated[EmbeddingRequest, Depends(json_body(EmbeddingRequest))]) -> dict[str, Any]:
    """``services.embedder`` embeds for an engine that cannot (``runtime/engines/local_embedder.py``)."""
    s = services(request)
    model_id, gateway, fallback = s.model_id, s.gateway, s.embedder
    if req.model != model_id:
        raise APIError(
            400,
            f"Embeddings come from the served model; set model to `{model_id}` (adapters and agents have no embeddings here).",
            param="model",
            code="model_not_supported",
        )
    served = gateway.engine()
    pooled = served.pooling_model if isinstance(served, PoolingEngine) else None
    engine: Embedder | PoolingEngine | None = served if pooled is not None or isinstance(served, Embedder) else fallback
    if engine is None:
        raise from_engine(NotSupported(f"embeddings are not supported by the {served.info.backend} backend"))
    source = "engine" if pooled is not None else "embedded" if engine is served else "local"
    if pooled is not None and req.pooling is not None:
        raise APIError(
            400,
            f"the {pooled.backend} engine serves a pooling model, which pools as it was built to ({pooled.pooling}); leave pooling out",
            param="pooling",
        )
    inputs = req.inputs()
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs per request", param="input")
    tokenizer, vocab, max_len = gateway.tokenizer(), gateway.vocab_size(), served.info.max_model_len
    chars = 0
    for i, x in enumerate(inputs):  # text that could never fit is refused before any tokenizing
        chars += len(x)
        if isinstance(x, str) and len(x) > max_len * MAX_CHARS_PER_TOKEN:
            msg = f"input holds {len(x)} characters, more than this model's context of {max_len} tokens could ever hold"
            raise APIError(400, msg, param="input" if len(inputs) == 1 else f"input[{i}]")
    if chars > MAX_TOTAL_TOKENS * MAX_CHARS_PER_TOKEN:
        raise APIError(400, f"the inputs hold {chars} characters, more than {MAX_TOTAL_TOKENS} tokens could ever hold", param="input")

    def tokenized() -> list[tuple[int, ...]]:  # on the admission's preparation pool: megabytes of text take seconds
        ids: list[tuple[int, ...]] = []
        for i, x in enumerate(inputs):
            param = "input" if len(inputs) == 1 else f"input[{i}]"
            seq = tuple(tokenizer(x)["input_ids"]) if isinstance(x, str) else tuple(x)
            if isinstance(x, list) and (bad := next((t for t in x if not 0 <= t < vocab), None)) is not None:
                raise APIError(400, f"token id {bad} is outside this model's vocabulary (0 to {vocab - 1})", param=param)
            if len(seq) > max_len:
                raise APIError(400, f"input has {len(seq)} tokens; this model's maximum context length is {max_len}", param=param)
            ids.append(seq)
        return ids

    ids = await gateway.admission.prepare(tokenized)
    total = sum(len(s) for s in ids)
    if total > MAX_TOTAL_TOKENS:
        raise APIError(400, f"the inputs hold {total} tokens; at most {MAX_TOTAL_TOKENS} per request", param="input")
    pooling = req.pooling or "mean"
    try:
        if pooled is not None:
            assert isinstance(engine, PoolingEngine)
            vectors = await engine.pool(ids, req.dimensions)
        else:
            assert isinstance(engine, Embedder)
            vectors = await engine.embed(ids, pooling)
            if req.dimensions is not None and vectors and req.dimensions != len(vectors[0]):
                raise APIError(400, f"dimensions must be {len(vectors[0])} (this model's hidden size) or left out", param="dimensions")
            vectors = [_unit(v) for v in vectors]
    except EngineError as exc:
        raise from_engine(exc) from exc
    data = []
    for i, v in enumerate(vectors):
        value: Any = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if req.encoding_format == "base64" else v
        data.append({"object": "embedding", "index": i, "embedding": value})
    origin: dict[str, Any] = {"source": source, "backend": served.info.backend, "pooling": pooled.pooling if pooled is not None else pooling}
    if pooled is not None:
        origin["normalized"] = pooled.normalized
    return {
        "object": "list",
        "model": req.model,
        "data": data,
        "usage": {"prompt_tokens": total, "total_tokens": total},
        "loopwise": origin,
    }


def _unit(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]
