"""``POST /v1/completions``: OpenAI's legacy text completions on the one generation path, with a raw prompt.

``prompt`` is a string, a list of strings, a list of token ids or a list of such lists (one choice
set per prompt; choice ``index`` = prompt index × ``n`` + j). A string is tokenized as the model's
tokenizer does by default (its special tokens, e.g. BOS, added); token ids go to the engine as
given. No chat template and no tools. Fields: ``max_tokens`` (default 16, as OpenAI's),
``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``logprobs`` (0–20: per token the sampled
token's logprob and that many alternatives, with ``text_offset``), ``echo`` (the prompt text before
the completion), ``stream`` (+ ``stream_options.include_usage``; one prompt per streamed request),
``presence_penalty`` / ``frequency_penalty`` / ``logit_bias`` (as chat's: ``runtime/openai_schemas.py``),
``user``. Every choice is recorded as a turn (its messages are one ``prompt`` entry with the text).

Not served (a clear 400): ``suffix`` (no fill-in-the-middle), ``best_of`` other than ``n``,
``echo`` with ``logprobs`` (prompt logprobs are not computed).

Not here: the generation path (``runtime/serving.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError, model_validator
from starlette.background import BackgroundTask

from runtime.engine import InvalidRequest
from runtime.errors import from_validation
from runtime.generation import ChoiceDone, ChoiceOut, GenRequest, StreamFailed, TextDelta
from runtime.http_body import read_json
from runtime.openai_schemas import FieldError, LogitBias, Penalty, StreamOptions, _In
from runtime.serving import Gateway, Outcome

MAX_PROMPTS = 64


class CompletionRequest(_In):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    logit_bias: LogitBias = None
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise FieldError("stop", "at most 4 stop sequences are allowed")
        if self.suffix:
            raise FieldError("suffix", "suffix (fill-in-the-middle) is not supported by this model")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of is not supported by this server (send n and pick the choice yourself)")
        if self.echo and self.logprobs is not None:
            raise FieldError("echo", "echo with logprobs needs prompt logprobs, which this server does not compute")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt == [] or self.prompt == "":
            raise FieldError("prompt", "prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def to_internal(req: CompletionRequest, prompt: str | list[int], tokenizer: Any, vocab_size: int, param: str) -> GenRequest:
    if isinstance(prompt, str):
        ids = tuple(tokenizer(prompt)["input_ids"])
        text = prompt
    else:
        if not prompt:
            raise InvalidRequest("a prompt of token ids must not be empty", param=param)
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside this model's vocabulary (0 to {vocab_size - 1})", param=param)
        ids = tuple(prompt)
        text = tokenizer.decode(list(prompt))
    return GenRequest(
        model=req.model,
        messages=[],
        api="completions",
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_tokens,
        stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        seed=req.seed,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias={int(k): b for k, b in (req.logit_bias or {}).items()},
        user=req.user,
        prompt_ids=ids,
        prompt_text=text,
        messages_param="prompt",
    )


def legacy_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """Chat-style per-token entries → the legacy ``logprobs`` object (parallel lists, ``text_offset`` in characters)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def _choice(c: ChoiceOut, index: int, req: CompletionRequest, prompt_text: str) -> dict[str, Any]:
    text = c.content or ""
    return {
        "index": index,
        "text": prompt_text + text if req.echo else text,
        "logprobs": legacy_logprobs(c.logprobs or [], 0) if req.logprobs is not None else None,
        "finish_reason": c.finish_reason,
    }


def install_completions_routes(app: FastAPI, gateway: Gateway, max_body: int) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, max_body)
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc) from None
        prompts = req.prompts()
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        if req.stream and len(prompts) > 1:
            raise InvalidRequest("a streamed completion takes one prompt; send one request per prompt", param="prompt")
        tokenizer, vocab = gateway.tokenizer(), gateway.vocab_size()
        single = len(prompts) == 1
        ireqs = [to_internal(req, p, tokenizer, vocab, "prompt" if single else f"prompt[{i}]") for i, p in enumerate(prompts)]
        if req.stream:
            out = await gateway.run(request, ireqs[0], stream=True, id_prefix="cmpl-")
            assert out is not None
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _stream(out, req, ireqs[0].prompt_text or "", include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **out.headers},
                background=BackgroundTask(out.close),  # releases the lease and the key's slots however the stream ended
            )
        outs = await asyncio.gather(*(gateway.run(request, r, stream=False, id_prefix="cmpl-") for r in ireqs))
        if any(o is None for o in outs):
            return Response(status_code=499)
        choices = []
        prompt_tokens = completion_tokens = 0
        loopwise = []
        for i, (o, r) in enumerate(zip(outs, ireqs, strict=True)):
            assert o is not None and o.choices is not None
            prompt_tokens += o.prompt_tokens
            completion_tokens += o.completion_tokens
            choices += [_choice(c, i * req.n + c.index, req, r.prompt_text or "") for c in o.choices]
            if o.loopwise is not None:
                loopwise.append(o.loopwise)
        first = outs[0]
        assert first is not None
        result: dict[str, Any] = {
            "id": first.id,
            "object": "text_completion",
            "created": first.created,
            "model": req.model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
        }
        if loopwise:
            result["loopwise"] = loopwise[0] if single else {"prompts": loopwise}
        headers = first.headers if single else {}
        return JSONResponse(result, headers=headers)


async def _stream(out: Outcome, req: CompletionRequest, prompt_text: str, include_usage: bool) -> AsyncIterator[str]:
    assert out.events is not None
    envelope = {"id": out.id, "object": "text_completion", "created": out.created, "model": req.model}
    offsets = [len(prompt_text) if req.echo else 0] * req.n
    if req.echo:
        for i in range(req.n):
            yield _sse({**envelope, "choices": [{"index": i, "text": prompt_text, "logprobs": None, "finish_reason": None}]})
    async for ev in out.events:
        if isinstance(ev, TextDelta):
            lps = legacy_logprobs(ev.logprobs or [], offsets[ev.index]) if req.logprobs is not None else None
            offsets[ev.index] += len(ev.text)
            yield _sse({**envelope, "choices": [{"index": ev.index, "text": ev.text, "logprobs": lps, "finish_reason": None}]})
        elif isinstance(ev, ChoiceDone):
            more = {"loopwise": out.loopwise} if out.loopwise is not None else {}
            yield _sse({**envelope, "choices": [{"index": ev.index, "text": "", "logprobs": None, "finish_reason": ev.choice.finish_reason}], **more})
        elif isinstance(ev, StreamFailed):
            yield _sse({"error": {"message": ev.message, "type": "server_error", "param": None, "code": "internal_error"}})
    if include_usage:
        p, c = out.prompt_tokens, out.completion_tokens
        yield _sse({**envelope, "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})
    yield "data: [DONE]\n\n"


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
