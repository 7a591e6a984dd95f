"""``POST /v1/completions``: OpenAI's legacy text completions on the one generation path, with a raw prompt.

``prompt`` is a string, a list of strings, a list of token ids or a list of such lists (one choice
set per prompt; choice ``index`` = prompt index × ``n`` + j). A string is tokenized as the model's
tokenizer does by default (its special tokens, e.g. BOS, added); token ids go to the engine as
given. No chat template and no tools. Fields: ``max_tokens`` (default 16, as OpenAI's),
``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``logprobs`` (0–20: per token the sampled
token's logprob and that many alternatives, with ``text_offset``), ``echo`` (the prompt text before
the completion; with ``logprobs``, the prompt's tokens and their logprobs before the generated ones,
the first prompt token's ``null``, and a final stop token's entry kept, as vLLM does: harnesses
slice the generated part by count), ``stream`` (+ ``stream_options.include_usage``; one prompt per
streamed request), ``presence_penalty`` / ``frequency_penalty`` / ``logit_bias`` (as chat's:
``runtime/api/openai_schemas.py``), ``user``, and vLLM's ``prompt_logprobs`` (0–20: each choice gets
vLLM's ``prompt_logprobs`` list; not with ``stream``). ``max_tokens`` 0 with ``echo`` (or
``prompt_logprobs``) scores the prompt without generating: what evaluation harnesses send. Formats:
``runtime/api/completions_logprobs.py``. Every choice is recorded as a turn (its messages are one
``prompt`` entry with the text; a scoring-only turn has no output token, so it never trains).

Prompt logprobs are the engine's (``runtime/engine.py``); an engine that does not compute them answers
400. A request's prompt logprobs are bounded: prompt tokens × (alternatives + 1) × ``n`` at most
:data:`MAX_PROMPT_SCORES` (a 400 beyond), so a batch of long prompts cannot build an unbounded answer.

Not served (a clear 400): ``suffix`` (no fill-in-the-middle), ``best_of`` other than ``n``.

Not here: the generation path (``runtime/serving.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, model_validator
from starlette.background import BackgroundTask

from runtime.admission import MAX_CHARS_PER_TOKEN
from runtime.api.completions_logprobs import TokenText, legacy_logprobs, prompt_entries, text_end, token_texts, vllm_prompt_logprobs
from runtime.api.openai_schemas import FieldError, LogitBias, Penalty, StreamOptions, _In, stop_problem
from runtime.engine import InvalidRequest, TokenLogprob
from runtime.errors import APIError
from runtime.gen_request import GenRequest
from runtime.generation import ChoiceDone, ChoiceOut, StreamFailed, TextDelta
from runtime.http_body import json_body
from runtime.services import services
from runtime.serving import Outcome

router = APIRouter()

MAX_PROMPTS = 64
MAX_LOGPROBS = 20  # alternatives per token, for generated and prompt tokens alike (vLLM's default --max-logprobs)
MAX_PROMPT_SCORES = 1 << 18  # prompt tokens × (alternatives + 1) × n per request, when the prompt's logprobs are asked


class CompletionRequest(_In):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: score the prompt only (with echo or prompt_logprobs)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    logit_bias: LogitBias = None
    user: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extension

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if (problem := stop_problem(self.stop)) is not None:
            raise FieldError("stop", problem)
        if self.suffix:
            raise FieldError("suffix", "suffix (fill-in-the-middle) is not supported by this model")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of is not supported by this server (send n and pick the choice yourself)")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise FieldError("max_tokens", "max_tokens 0 generates nothing: send echo or prompt_logprobs with it to score the prompt")
        if self.stream and self.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs", "prompt_logprobs is not available with stream (echo with logprobs streams the prompt's logprobs)")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt == [] or self.prompt == "":
            raise FieldError("prompt", "prompt must not be empty")
        return self

    def prompt_top(self) -> int | None:
        """How many alternatives the engine lists per prompt token; None when the prompt's logprobs are not wanted."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

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
        logprobs_with_stop=req.echo,  # the generated part has one entry per token, a final eos too (as vLLM: harnesses slice by count)
        top_logprobs=req.logprobs or 0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias={int(k): b for k, b in (req.logit_bias or {}).items()},
        user=req.user,
        prompt_ids=ids,
        prompt_text=text,
        prompt_logprobs=req.prompt_top(),
        prompt_logprobs_param="prompt_logprobs" if req.prompt_logprobs is not None else "logprobs",
        messages_param="prompt",
    )


@dataclass(frozen=True)
class _Prompt:
    """One prompt's part of every choice of it: its text, and its tokens' logprobs in both formats when asked."""

    text: str
    echo_logprobs: list[dict[str, Any]] | None = None  # per-token entries of the echoed prompt (echo with logprobs)
    vllm: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's prompt_logprobs (prompt_logprobs asked)


def _prompt_part(req: CompletionRequest, ireq: GenRequest, scores: tuple[TokenLogprob, ...] | None, text: TokenText) -> _Prompt:
    prompt = _Prompt(ireq.prompt_text or "")
    if scores is None:
        return prompt
    ids = ireq.prompt_ids or ()
    echo = prompt_entries(ids, scores, req.logprobs, text) if req.echo and req.logprobs is not None else None
    vllm = vllm_prompt_logprobs(scores, req.prompt_logprobs, text) if req.prompt_logprobs is not None else None
    return _Prompt(prompt.text, echo, vllm)


def _choice(c: ChoiceOut, index: int, req: CompletionRequest, prompt: _Prompt) -> dict[str, Any]:
    text = c.content or ""
    logprobs = None
    if req.logprobs is not None:
        logprobs = legacy_logprobs([*(prompt.echo_logprobs or []), *(c.logprobs or [])], 0)
    out: dict[str, Any] = {"index": index, "text": prompt.text + text if req.echo else text, "logprobs": logprobs, "finish_reason": c.finish_reason}
    if req.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt.vllm
    return out


def _check_scores(req: CompletionRequest, ireqs: list[GenRequest]) -> None:
    """Refuse a request whose prompt logprobs would exceed :data:`MAX_PROMPT_SCORES` entries (a 400 naming the field)."""
    k = req.prompt_top()
    if k is None:
        return
    entries = sum(len(r.prompt_ids or ()) for r in ireqs) * (k + 1) * req.n
    if entries > MAX_PROMPT_SCORES:
        raise InvalidRequest(
            f"the prompt logprobs asked for come to {entries} entries (prompt tokens × (alternatives + 1) × n), over this server's "
            f"limit of {MAX_PROMPT_SCORES}: send fewer or shorter prompts per request, or fewer alternatives",
            param="prompt_logprobs" if req.prompt_logprobs is not None else "logprobs",
        )


@router.post("/v1/completions")
async def completions(request: Request, req: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]) -> Response:
    prompts = req.prompts()
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    if req.stream and len(prompts) > 1:
        raise InvalidRequest("a streamed completion takes one prompt; send one request per prompt", param="prompt")
    gateway = services(request).gateway
    tokenizer, vocab, max_len = gateway.tokenizer(), gateway.vocab_size(), gateway.engine().info.max_model_len
    single = len(prompts) == 1
    params = ["prompt" if single else f"prompt[{i}]" for i in range(len(prompts))]
    for p, param in zip(prompts, params, strict=True):  # text that could never fit is refused before any tokenizing
        if isinstance(p, str) and len(p) > max_len * MAX_CHARS_PER_TOKEN:
            raise APIError(
                400, f"This model's maximum context length is {max_len} tokens. However, your prompt holds {len(p)} characters, "
                "more than could ever fit. Please reduce the length of the prompt.", param=param, code="context_length_exceeded",
            )  # fmt: skip
    # tokenizing (up to 64 prompts of megabytes) on the admission's preparation pool, not the event loop
    ireqs = await gateway.admission.prepare(lambda: [to_internal(req, p, tokenizer, vocab, param) for p, param in zip(prompts, params, strict=True)])
    _check_scores(req, ireqs)
    text = token_texts(tokenizer)
    if req.stream:
        out = await gateway.run(request, ireqs[0], stream=True, id_prefix="cmpl-")
        assert out is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(out, req, _prompt_part(req, ireqs[0], out.prompt_logprobs, text), include_usage),
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
        prompt = _prompt_part(req, r, o.prompt_logprobs, text)
        choices += [_choice(c, i * req.n + c.index, req, prompt) for c in o.choices]
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


async def _stream(out: Outcome, req: CompletionRequest, prompt: _Prompt, include_usage: bool) -> AsyncIterator[str]:
    assert out.events is not None
    envelope = {"id": out.id, "object": "text_completion", "created": out.created, "model": req.model}
    offsets = [0] * req.n
    if req.echo:  # the prompt first (with its tokens' logprobs when asked), then the completion's offsets continue after it
        echoed = legacy_logprobs(prompt.echo_logprobs, 0) if req.logprobs is not None and prompt.echo_logprobs is not None else None
        offsets = [text_end(echoed) if echoed is not None else len(prompt.text)] * req.n
        for i in range(req.n):
            yield _sse({**envelope, "choices": [{"index": i, "text": prompt.text, "logprobs": echoed, "finish_reason": None}]})
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
