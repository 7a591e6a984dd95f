"""A protocol-faithful fake of vLLM's OpenAI-compatible server serving a *pooling* (embedding) model, backed by
loopwise's embedded engine.

Run it like ``vllm serve``::

    python -m tests.fakes.vllm_server MODEL_DIR --port 8000 --runner pooling --convert embed --served-model-name tiny

Only the pooling case is faked (the generative vLLM server is tested for real, ``make test-engines``): vLLM registers
its routes by the model's tasks, so a server whose model pools has these and no generation routes
(``vllm/entrypoints/pooling/factories.py``: ``/v1/embeddings`` only when the pooling task is ``embed``, ``/pooling``
for any pooling task; ``/v1/completions``, ``/v1/chat/completions`` and the LoRA routes are not there, so they answer
FastAPI's 404 ``{"detail": "Not Found"}``):

- ``POST /v1/embeddings`` (vLLM's ``EmbeddingCompletionRequest``): ``model`` (the served name; another is 404
  ``NotFoundError``), ``input`` a string, strings, token ids or lists of token ids (ids are not re-tokenized),
  ``encoding_format`` ``float`` (the default) or ``base64`` (little-endian float32), ``dimensions`` (refused: the model
  is not Matryoshka), ``add_special_tokens`` (default true), ``truncate_prompt_tokens``, ``user``. The answer is vLLM's
  ``EmbeddingResponse``: ``{"id": "embd-…", "object": "list", "created", "model", "data": [{"index", "object":
  "embedding", "embedding"}], "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0,
  "prompt_tokens_details": null}}``. The vectors are what vLLM's ``--convert embed`` pooler computes for a decoder:
  the last token's final hidden state, L2-normalized.
- ``POST /pooling`` (vLLM's ``PoolingResponse``: ``data`` of ``{"index", "object": "pooling", "data"}``), the same vectors.
- ``GET /v1/models`` (the served model: ``root``, ``parent: null``, ``max_model_len``), ``GET /version``,
  ``GET /health`` (200, empty), ``POST /tokenize`` (``{"count", "max_model_len", "tokens", "token_strs"}``).
- Errors: vLLM's ``{"error": {"message", "type", "param", "code"}}``; an input over the context length is a 400 with
  vLLM's "This model's maximum context length is N tokens. However, you requested M tokens in the input for
  embedding generation. Please reduce the length of the input.".

Not faithful (not needed here): chat-style ``messages`` inputs, Cohere's ``/v2/embed``, ``/score``, ``/rerank``,
``/classify``, API keys, the generative server.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import logging
import math
import os
import struct
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runtime.engines.embedded import EmbeddedEngine

log = logging.getLogger("fake-vllm")

FAKE_VERSION = "0.32.0-fake"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fake vllm serve")
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--runner", default="auto")
    p.add_argument("--convert", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    if args.runner != "pooling" or args.convert != "embed":
        p.error("the fake serves a decoder converted to an embedding model only: --runner pooling --convert embed")
    return args


def build_app(args: argparse.Namespace) -> FastAPI:
    engine = EmbeddedEngine(Path(args.model), model_id=args.served_model_name or args.model, max_model_len=args.max_model_len)
    served = args.served_model_name or args.model
    created = int(time.time())
    calls = {"embeddings": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        print("Application startup complete.", flush=True)  # uvicorn's line, which vLLM's launch waits for
        yield
        await engine.close()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": FAKE_VERSION}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": args.model,
            "parent": None,
            "max_model_len": engine.info.max_model_len,
            "permission": [],
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        ids = engine.tokenizer(body.get("prompt", ""), add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"]
        return JSONResponse({"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids, "token_strs": None})

    async def pooled(body: dict[str, Any]) -> tuple[list[list[float]], int] | JSONResponse:
        """The request's vectors and prompt tokens, or vLLM's error answer."""
        model = body.get("model")
        if model is not None and model != served:
            return _error(f"The model `{model}` does not exist.", "NotFoundError", 404, param="model")
        if body.get("dimensions") is not None:
            return _error(f'Model "{served}" does not support matryoshka representation, changing output dimensions will lead to poor results.')
        x = body.get("input")
        special = bool(body.get("add_special_tokens", True))
        tok = engine.tokenizer
        if isinstance(x, str):
            seqs = [tok(x, add_special_tokens=special)["input_ids"]]
        elif isinstance(x, list) and x and all(isinstance(v, int) for v in x):
            seqs = [list(x)]
        elif isinstance(x, list) and x and all(isinstance(v, str) for v in x):
            seqs = [tok(v, add_special_tokens=special)["input_ids"] for v in x]
        elif isinstance(x, list) and x and all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in x):
            seqs = [list(v) for v in x]
        else:
            return _error("Input should be a valid string, a list of strings, a list of token ids or a list of lists of token ids", param="input")
        cut = body.get("truncate_prompt_tokens")
        if isinstance(cut, int) and cut > 0:
            seqs = [s[-cut:] for s in seqs]
        limit = engine.info.max_model_len
        for s in seqs:
            if not s:
                return _error("The prompt is empty", param="input")
            if len(s) > limit:
                return _error(
                    f"This model's maximum context length is {limit} tokens. However, you requested {len(s)} tokens in the input "
                    "for embedding generation. Please reduce the length of the input.",
                    param="input_tokens",
                )
            if (bad := next((t for t in s if not 0 <= t < engine.info.vocab_size), None)) is not None:
                return _error(f"Token id {bad} is out of vocabulary", param="input")
        calls["embeddings"] += 1
        states = await engine.embed([tuple(s) for s in seqs], "last")  # --convert embed on a decoder: LAST pooling, normalized
        return [_unit(v) for v in states], sum(len(s) for s in seqs)

    def encode(v: list[float], fmt: str) -> Any:
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii") if fmt == "base64" else v

    def usage(n: int) -> dict[str, Any]:
        return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        body = await request.json()
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            return _error(f"Input should be 'float', 'base64' or 'bytes' (encoding_format={fmt!r})", param="encoding_format")
        out = await pooled(body)
        if isinstance(out, JSONResponse):
            return out
        vectors, n = out
        data = [{"index": i, "object": "embedding", "embedding": encode(v, fmt)} for i, v in enumerate(vectors)]
        return JSONResponse(
            {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": served, "data": data, "usage": usage(n)}
        )

    @app.post("/pooling")
    async def pooling(request: Request) -> JSONResponse:
        body = await request.json()
        out = await pooled(body)
        if isinstance(out, JSONResponse):
            return out
        vectors, n = out
        data = [{"index": i, "object": "pooling", "data": v} for i, v in enumerate(vectors)]
        return JSONResponse(
            {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": served, "data": data, "usage": usage(n)}
        )

    @app.get("/fake/stats")
    async def stats() -> dict[str, Any]:
        return dict(calls)

    return app


def _unit(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def _error(message: str, type: str = "BadRequestError", code: int = 400, param: str | None = None) -> JSONResponse:
    """vLLM's ``ErrorResponse``."""
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}}, status_code=code)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="[fake-vllm] %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
