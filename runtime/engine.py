"""The engine contract: token ids in, token ids + logprobs out.

Every serving backend (embedded transformers+peft, an SGLang server over HTTP, the fake used in tests)
implements :class:`Engine`. Chat templating, tool rendering and tool-call parsing happen above this
line in the runtime, never inside an engine, so what an engine is given and what it returns are the
exact tokens that get recorded and trained on.

What lives here: the request/response value types, the protocol, and the engine exception hierarchy::

    EngineError
    ├── EngineOverloaded      queue full; the HTTP layer answers 429 with Retry-After
    ├── EngineClosed          the engine is shutting down or never started
    ├── InvalidRequest        a request the engine cannot serve (bad grammar, prompt too long, ...)
    ├── AdapterError          adapter load/unload/lookup failures
    └── NotSupported          the backend cannot do this at all (HTTP 501)

What does not: scheduling, batching or sampling code (see ``runtime/engines/``).

Logprob convention: ``logprobs`` are of the distribution the token was sampled from: the model's
logits, less OpenAI's presence/frequency penalties and plus its ``logit_bias`` when the request has
them, divided by the temperature (undivided for greedy), with a grammar mask applied when the request
is constrained; top-p truncation is not applied to them. Without penalties or bias this is what a
learner recomputes from ``logits / T`` for importance ratios; a turn sampled with them is not (its
record says so: ``SamplingParams.penalized``, and the learner leaves it out).

Prompt logprobs (``SamplingParams.prompt_logprobs``, for scoring: OpenAI legacy completions' ``echo`` with
``logprobs``, vLLM's ``prompt_logprobs``) are of the model's raw distribution: ``log_softmax`` of the logits
at position i - 1 for prompt token i (the adapter of the request applied; no temperature, penalties or
grammar), with the top-k alternatives and the token's rank where the engine knows it. The first prompt
token has none. Engines that compute them say so in ``EngineInfo.prompt_logprobs``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


class EngineError(Exception):
    """Base class of every engine failure."""


class EngineOverloaded(EngineError):
    """The bounded request queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineClosed(EngineError):
    """The engine is not running (not started yet, or shutting down)."""


class InvalidRequest(EngineError):
    """The engine cannot serve this request as given; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class AdapterError(EngineError):
    """An adapter could not be found, loaded or unloaded."""


class NonFiniteOutput(EngineError):
    """This request's logits held no distribution (NaN, e.g. from a broken adapter); its batch neighbours go on."""


class NotSupported(EngineError):
    """This backend cannot do what was asked (e.g. embeddings on an external engine): HTTP 501."""


@dataclass(frozen=True)
class Grammar:
    """A decoding constraint, in the same vocabulary as SGLang's ``/generate`` sampling params."""

    kind: Literal["json_schema", "json_object", "ebnf"]
    spec: str = ""  # the JSON schema text, or the EBNF grammar text; empty for json_object
    # an engine's compiled form, made off the event loop at admission (runtime/admission.py); engines that
    # compile it themselves (SGLang) ignore it
    compiled: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the matched string is excluded from the text
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's eos ids
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: Grammar | None = None
    # OpenAI's penalties, on the counts of this request's *output* tokens so far (not the prompt's), and logit bias:
    # logit[j] += bias[j] - frequency_penalty * count[j] - presence_penalty * (count[j] > 0), before the temperature
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a tuple: the params stay hashable
    # the logprob of every prompt token from the second on, with this many alternatives (None: not asked); see the module docstring.
    # max_new_tokens 0 with it scores the prompt only: the request ends after its prefill with no token (finish "length")
    prompt_logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        """Whether penalties or a logit bias change the distribution (a trainer's ``logits / T`` cannot reproduce it)."""
        return bool(self.presence_penalty or self.frequency_penalty or any(b for _, b in self.logit_bias))

    def __post_init__(self) -> None:
        # below MIN_TEMPERATURE a request is greedy: logits / 1e-50 overflow float32, and a recorded 1e-50 would
        # make a learner recomputing logprobs divide by it (runtime/engines/sampling.py uses the same floor)
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)


MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # None serves the base model
    session: str | None = None  # the conversation's routing key: replicas of an external engine keep a session on one server
    owner: str | None = None  # the API key's identity: the embedded engine shares its batch fairly between owners


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs; None where the engine does not say)


@dataclass(frozen=True)
class Timings:
    queued_s: float = 0.0  # submit → first scheduled
    ttft_s: float = 0.0  # submit → first token
    total_s: float = 0.0  # submit → finished


@dataclass(frozen=True)
class StreamChunk:
    """Tokens produced since the previous chunk, and the text that is now safe to show.

    ``text`` never contains a (partial) stop string and never ends in half a UTF-8 character.
    The last chunk of a stream has ``finish_reason`` set.
    """

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None  # the stop string or token id that ended generation
    timings: Timings | None = None  # set on the last chunk
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.. (the first has none); on the first chunk, when asked


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]  # every sampled token, including a final eos/stop token
    text: str
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprob, ...] = ()
    matched_stop: str | int | None = None
    timings: Timings = field(default_factory=Timings)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.., when asked (``SamplingParams.prompt_logprobs``)


@dataclass(frozen=True)
class EngineInfo:
    backend: str
    model: str  # the served model's id
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str = ""
    prompt_logprobs: bool = False  # computes prompt logprobs (``SamplingParams.prompt_logprobs``, max_new_tokens 0 included)


@runtime_checkable
class Engine(Protocol):
    """What the runtime needs from a serving backend."""

    @property
    def info(self) -> EngineInfo: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """Yield chunks until one has ``finish_reason``. Closing the iterator early cancels the request.

        Raises :class:`EngineOverloaded` at the first ``__anext__`` when the queue is full.
        """
        ...

    async def generate(self, req: GenerateRequest) -> GenerateResult: ...

    async def health(self) -> None:
        """Generate one token; raise :class:`EngineError` if that fails."""
        ...

    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    def stats(self) -> dict[str, float]:
        """Gauges for /metrics: queue depth, running requests, ..."""
        ...


@runtime_checkable
class Embedder(Protocol):
    """An engine that can also return the base model's pooled hidden states (``POST /v1/embeddings``)."""

    @property
    def info(self) -> EngineInfo: ...

    async def embed(self, inputs: list[tuple[int, ...]], pooling: Literal["mean", "last"]) -> list[list[float]]:
        """One vector per input: the final hidden state of the base model (no adapter), mean-pooled or the last token's."""
        ...


@dataclass(frozen=True)
class PoolingModel:
    """An external engine that serves a pooling (embedding) model rather than a generative one: vLLM with
    ``--runner pooling`` (its ``/v1/embeddings`` route exists only then), SGLang with ``--is-embedding``
    (``/get_model_info`` says ``is_generation: false``). Such a server embeds and cannot generate."""

    backend: str  # "vllm", "sglang"
    served: str  # the engine's name of the model (the ``model`` of its requests)
    pooling: str  # how it pools, as the engine says ("last", "mean", "cls"); "model_defined": the model's own config decides
    normalized: bool | None = None  # whether it scales each vector to unit length (None: the engine does not say)


@runtime_checkable
class PoolingEngine(Protocol):
    """An external engine that may serve a pooling model; ``pooling_model`` is None when it serves a generative one."""

    @property
    def pooling_model(self) -> PoolingModel | None: ...

    async def pool(self, inputs: list[tuple[int, ...]], dimensions: int | None = None) -> list[list[float]]:
        """The engine's own embedding of each input (token ids), as its pooling model computes it."""
        ...


async def collect(req: GenerateRequest, chunks: AsyncIterator[StreamChunk]) -> GenerateResult:
    """Fold a stream into a :class:`GenerateResult` (shared by engines that implement ``generate`` via ``stream``)."""
    ids: list[int] = []
    text: list[str] = []
    lps: list[TokenLogprob] = []
    prompt: tuple[TokenLogprob, ...] | None = None
    last: StreamChunk | None = None
    async for chunk in chunks:
        if prompt is None:
            prompt = chunk.prompt_logprobs
        ids.extend(chunk.token_ids)
        text.append(chunk.text)
        lps.extend(chunk.logprobs)
        last = chunk
    if last is None or last.finish_reason is None:
        raise EngineError(f"stream for {req.request_id} ended without a finish reason")
    return GenerateResult(
        request_id=req.request_id,
        prompt_ids=req.input_ids,
        output_ids=tuple(ids),
        text="".join(text),
        finish_reason=last.finish_reason,
        logprobs=tuple(lps),
        matched_stop=last.matched_stop,
        timings=last.timings or Timings(),
        prompt_logprobs=prompt,
    )
