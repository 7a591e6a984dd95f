"""The shared core of loopwise's external engines: one inference server over HTTP, token ids in and out.

``HTTPEngine`` does everything that an engine server reached over HTTP needs regardless of which server
it is; ``runtime/engines/sglang.py`` and ``runtime/engines/vllm.py`` subclass it and supply only their
wire format (request body, answer decoding, error bodies, adapter endpoints, server info). Several
``HTTPEngine`` s behind one runtime are ``runtime/engines/replicas.py``.

What the core does:

- one ``httpx.AsyncClient`` per server, explicit connect/read/write/pool timeouts (connect, read and adapter
  timeouts from the backend's settings section, ``TimeoutSettings``), a pool sized to the admission limit; more
  requests in flight than ``max_concurrency`` → :class:`EngineOverloaded`;
- the local model folder (``LocalModel``): the tokenizer (the runtime templates and tokenizes; text is
  decoded here from the token ids the server returns, with ``TextStream``, so stop strings are cut and
  partial UTF-8 is held back exactly as in the embedded engine) and the model's module shapes on the
  meta device (adapter validation). Loaded once and shared by replicas;
- generation: one POST per request (``n > 1`` is fanned out by the caller); a non-streamed answer or an
  SSE stream (``data: {...}`` lines, ``data: [DONE]``, in-band ``{"error": ...}`` events), each event
  turned by the backend's decoder into a :class:`StreamChunk` of new tokens only (``ChunkBuilder``);
- the engine-side request id is generated here (``uuid4``), never taken from the client: a client's
  ``X-Request-Id`` reused as the server's id could collide with, or be aborted as, another request. The
  pair is logged (``engine_request``) to correlate the two logs;
- adapters: each load gets a fresh server-side name (``family@N-<uuid>``; a name is never reused, since
  both SGLang and vLLM key their prefix caches by it), one lock per name, only a successful load is
  mapped; our names are unloaded on close (the server outlives us);
- transport failures: :class:`ServerDown` (an :class:`EngineClosed`) when nothing reached the caller
  yet, so a replica set may send the request elsewhere; :class:`ServerLost` once a stream handed out
  tokens. Idempotent GETs are retried (bounded, each retry logged); POSTs never are.

Embeddings: a server that serves a pooling (embedding) model instead of a generative one (``_connect`` sets
``pooling_model``: vLLM ``--runner pooling``, SGLang ``--is-embedding``) embeds token ids through its OpenAI-compatible
``POST /v1/embeddings`` (``pool``), which vLLM and SGLang both serve for such a model; it cannot generate, so a
generation request is :class:`NotSupported` here rather than the server's 404.

Hooks a backend implements: ``_init_backend`` (its own attributes, set at the end of the one shared constructor),
``_connect`` (read server info → :class:`EngineInfo`), ``_body``, ``_decoder``, ``translate_error``, ``_load``/``_unload``
(adapter endpoints), ``health``, ``probe``. A backend whose server cannot stream some request (vLLM: ``prompt_logprobs``)
says so in ``_streams``; such a request is one non-streamed call, handed out as one chunk.

Not here: launching servers (``runtime/engines/launcher.py``), routing between replicas, chat templating.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import httpx
import structlog

from runtime.engine import (
    AdapterError,
    EngineClosed,
    EngineError,
    EngineInfo,
    EngineOverloaded,
    GenerateRequest,
    GenerateResult,
    InvalidRequest,
    NotSupported,
    PoolingModel,
    StreamChunk,
    Timings,
    TokenLogprob,
    collect,
)
from runtime.engines.textstream import TextStream

log = structlog.stdlib.get_logger(__name__)

_GET_ATTEMPTS = 3
_GET_BACKOFF_S = 0.2


class ServerDown(EngineClosed):
    """The server could not be reached, or went away before anything was handed to the caller."""


class ServerLost(EngineError):
    """The server went away mid-stream, after tokens were handed out (the request cannot be retried)."""


class AdapterGone(AdapterError):
    """The server does not have that adapter (an unload of a name it forgot, e.g. after a restart)."""


class TimeoutSettings(Protocol):
    """A backend's settings section as far as the core reads it (``SGLangSettings``, ``VLLMSettings``)."""

    @property
    def connect_timeout_s(self) -> float: ...

    @property
    def request_timeout_s(self) -> float: ...

    @property
    def adapter_timeout_s(self) -> float: ...


@dataclass(frozen=True)
class HTTPTimeouts:
    connect_s: float
    request_s: float  # read timeout of one generate call
    adapter_s: float  # one adapter load or unload


@dataclass(frozen=True)
class LocalModel:
    """What loopwise needs from the model folder the server serves: tokenizer, module shapes, limits."""

    path: Path
    tokenizer: Any
    model: Any  # modules on the meta device (no weights), for adapter validation
    max_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, path: Path) -> LocalModel:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        try:
            eos: Any = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:
            eos = None
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        if eos is None:
            eos = tokenizer.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
        return cls(Path(path), tokenizer, model, int(getattr(config, "max_position_embeddings", 2048)), int(config.vocab_size), eos_ids)


def error_message(body: Any) -> str:
    """The message of any error body: nested ``{"error": {...}}``, flat ``{"message": ...}``, ``{"error": "text"}``,
    ``{"detail": ...}``, SGLang's ``LoRAUpdateOutput`` (``error_message``), or plain text."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str | list) and err:
            return err if isinstance(err, str) else "; ".join(map(str, err))
        for key in ("message", "error_message", "detail"):
            if body.get(key):
                return str(body[key])
        return json.dumps(body)[:500]
    return str(body)[:500] if body not in (None, "") else "no error message"


def grammar_refusal(label: str, status: int, msg: str) -> InvalidRequest | None:
    """The engine's refusal of a request's decoding constraint, as the embedded engine reports its own: an
    :class:`InvalidRequest` on ``response_format`` (which each API renames to the field its client sent: Anthropic's
    ``output_config.format``, a forced ``tool_choice``), the engine's text kept. SGLang aborts such a request with
    "Failed to compile json grammar: ..." (or "Grammar preprocessing timed out"); vLLM refuses it with "Failed to
    transform json schema into a grammar: ...", "Grammar error: ...", "Invalid grammar specification", or "The provided
    JSON schema contains features not supported by xgrammar"."""
    low = msg.lower()
    if 400 <= status < 500 and ("grammar" in low or "json schema" in low or "structured output" in low):
        return InvalidRequest(f"the response_format / tool_choice grammar was refused by {label}: {msg}", param="response_format")
    return None


def json_or_text(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text


class ChunkBuilder:
    """New token ids (+ logprobs and the finish) of one request → :class:`StreamChunk` with safe text and timings."""

    def __init__(self, req: GenerateRequest, tokenizer: Any) -> None:
        self.req = req
        self.text = TextStream(tokenizer, req.sampling.stop)
        self.seen = 0  # output tokens already handed out
        self.t_submit = time.perf_counter()
        self.t_first = 0.0

    def build(self, new_ids: list[int], lps: tuple[TokenLogprob, ...], reason: str | None, matched: str | int | None = None) -> StreamChunk | None:
        if not new_ids and reason is None:
            return None
        if new_ids and not self.t_first:
            self.t_first = time.perf_counter()
        self.seen += len(new_ids)
        parts = []
        for k, tid in enumerate(new_ids):
            if k == len(new_ids) - 1 and reason == "stop" and isinstance(matched, int) and tid == matched:
                continue  # an eos / stop token has no text (as in the embedded engine)
            parts.append(self.text.push(tid))
        if reason is None:
            return StreamChunk(tuple(new_ids), "".join(parts), lps)
        parts.append(self.text.flush())
        if reason == "stop" and matched is None and self.text.stopped is not None:
            matched = self.text.stopped
        now = time.perf_counter()
        timings = Timings(0.0, (self.t_first or now) - self.t_submit, now - self.t_submit)
        return StreamChunk(tuple(new_ids), "".join(parts), lps, reason, matched, timings)  # type: ignore[arg-type]


class Decoder(Protocol):
    """A backend's reader of one request's answer: each parsed event (or the whole non-streamed body) → a chunk."""

    builder: ChunkBuilder

    def feed(self, event: dict[str, Any]) -> StreamChunk | None: ...


class HTTPEngine:
    """One engine server as an :class:`runtime.engine.Engine`. Construct, ``await start()``, then serve."""

    backend: ClassVar[str] = ""  # "sglang", "vllm": EngineInfo.backend and log event prefix
    label: ClassVar[str] = ""  # "SGLang", "vLLM": in messages
    generate_path: ClassVar[str] = ""

    def __init__(
        self,
        url: str,
        model_path: Path,
        *,
        model_id: str,
        settings: TimeoutSettings,
        max_concurrency: int = 288,
        on_close: Callable[[], None] | None = None,
        local: LocalModel | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._path = Path(model_path)
        self._model_id = model_id
        self.timeouts = HTTPTimeouts(settings.connect_timeout_s, settings.request_timeout_s, settings.adapter_timeout_s)
        self._max_concurrency = max_concurrency
        self._on_close = on_close  # e.g. stop a launched server: runs in close(), inside the app's shutdown
        self._client: httpx.AsyncClient | None = None
        self._info: EngineInfo | None = None
        self._in_flight = 0
        self._names: dict[str, str] = {}  # loopwise adapter name (family@N) -> the server's name for it
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.local = local
        self.pooling_model: PoolingModel | None = None  # set by _connect when the server serves a pooling model
        self._init_backend()

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineClosed("engine not started")
        return self._info

    @property
    def tokenizer(self) -> Any:
        return self.local.tokenizer if self.local is not None else None

    @property
    def model(self) -> Any:
        """The base model's modules on the meta device (shapes only, for adapter validation)."""
        return self.local.model if self.local is not None else None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def open(self) -> None:
        """Create the HTTP client and load the local model folder (once); no request to the server yet."""
        if self._client is None:
            t = self.timeouts
            timeout = httpx.Timeout(connect=t.connect_s, read=t.request_s, write=30.0, pool=t.request_s)
            limits = httpx.Limits(max_connections=self._max_concurrency + 8, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits)
        if self.local is None:
            self.local = await asyncio.to_thread(LocalModel.load, self._path)

    async def connect(self) -> EngineInfo:
        """Read the server's info (again after a restart); raises :class:`EngineClosed` when it does not answer."""
        self._info = await self._connect()
        return self._info

    async def start(self) -> None:
        await self.open()
        await self.connect()

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        for name, server_name in list(self._names.items()):  # leave the server as we found it; it outlives us
            try:
                await self._unload(client, server_name, timeout=10.0)
            except EngineError as exc:
                log.warning(f"{self.backend}_unload_on_close_failed", adapter=name, server_name=server_name, error=str(exc))
        self._names.clear()
        await client.aclose()
        if self._on_close is not None:
            await asyncio.to_thread(self._on_close)

    # ---- hooks -----------------------------------------------------------------------------
    def _init_backend(self) -> None:
        """Set the backend's own attributes (the last step of ``__init__``; the constructor is this class's alone)."""

    async def _connect(self) -> EngineInfo:
        raise NotImplementedError

    def _body(self, req: GenerateRequest, rid: str, stream: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _decoder(self, req: GenerateRequest, stream: bool) -> Decoder:
        raise NotImplementedError

    def _streams(self, req: GenerateRequest) -> bool:
        """Whether the server can stream ``req`` (else :meth:`stream` makes one non-streamed call)."""
        return True

    def translate_error(self, status: int, body: Any) -> EngineError:
        raise NotImplementedError

    async def _load(self, client: httpx.AsyncClient, server_name: str, path: str) -> None:
        raise NotImplementedError

    async def _unload(self, client: httpx.AsyncClient, server_name: str, timeout: float | None = None) -> None:
        """Raise :class:`AdapterGone` when the server does not know the name."""
        raise NotImplementedError

    async def health(self) -> None:
        raise NotImplementedError

    async def probe(self) -> set[str] | None:
        """A cheap liveness check for the replica monitor; returns the server names of the loaded adapters when the
        server can list them (None when it cannot). Raises :class:`EngineError` when the server is not healthy."""
        raise NotImplementedError

    # ---- generation ------------------------------------------------------------------------
    def server_name(self, adapter: str) -> str:
        """The server's name of a loaded adapter (for request bodies)."""
        name = self._names.get(adapter)
        if name is None:
            raise AdapterError(f"adapter {adapter!r} is not loaded")
        return name

    def _admit(self) -> httpx.AsyncClient:
        if self.pooling_model is not None:
            raise NotSupported(
                f"the {self.label} server at {self.url} serves a pooling (embedding) model, which cannot generate; "
                "it answers POST /v1/embeddings (serve a generative model for the other APIs)"
            )
        return self._admit_pooled()

    def _admit_pooled(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineClosed("engine is not running")
        if self._in_flight >= self._max_concurrency:
            raise EngineOverloaded(
                f"server overloaded: {self._in_flight} requests in flight to {self.label} (max {self._max_concurrency})", retry_after=1.0
            )
        return self._client

    def _admit_any(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineClosed("engine is not running")
        return self._client

    def _start_request(self, req: GenerateRequest) -> str:
        rid = uuid.uuid4().hex  # never the client's id (see the module docstring)
        log.debug("engine_request", request_id=req.request_id, engine_request_id=rid, url=self.url)
        return rid

    def _down(self, exc: BaseException) -> ServerDown:
        return ServerDown(f"cannot reach {self.label} at {self.url}: {type(exc).__name__}: {exc}")

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        if not self._streams(req):
            yield await self.answer(req)
            return
        client = self._admit()
        body = self._body(req, self._start_request(req), stream=True)
        decoder = self._decoder(req, stream=True)
        self._in_flight += 1
        started = False  # a chunk was handed out: failures from here on are mid-stream
        try:
            async with client.stream("POST", self.generate_path, json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise self.translate_error(resp.status_code, json_or_text(resp))
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        err = event["error"]
                        code = err.get("code") if isinstance(err, dict) else None
                        raise self.translate_error(code if isinstance(code, int) else 400, event)
                    chunk = decoder.feed(event)
                    if chunk is None:
                        continue
                    started = True
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
            raise EngineError(f"{self.label}'s stream for {req.request_id} ended without a finish reason")
        except httpx.TransportError as exc:
            if started:
                seen = decoder.builder.seen
                log.error(f"{self.backend}_stream_lost", request_id=req.request_id, url=self.url, tokens=seen, error=repr(exc))
                raise ServerLost(f"lost the connection to {self.label} mid-stream after {seen} tokens: {type(exc).__name__}") from exc
            raise self._down(exc) from exc
        finally:
            self._in_flight -= 1

    async def answer(self, req: GenerateRequest) -> StreamChunk:
        """One non-streamed call: the whole answer as one final chunk."""
        client = self._admit()
        body = self._body(req, self._start_request(req), stream=False)
        decoder = self._decoder(req, stream=False)
        self._in_flight += 1
        try:
            resp = await client.post(self.generate_path, json=body)
        except httpx.TransportError as exc:
            raise self._down(exc) from exc
        finally:
            self._in_flight -= 1
        if resp.status_code != 200:
            raise self.translate_error(resp.status_code, json_or_text(resp))
        out = resp.json()
        if not isinstance(out, dict):  # e.g. a batch answer to a single request: a protocol error
            raise EngineError(f"{self.label} answered a single request with {type(out).__name__}")
        chunk = decoder.feed(out)
        if chunk is None or chunk.finish_reason is None:
            raise EngineError(f"{self.label}'s answer for {req.request_id} has no finish reason")
        return chunk

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        chunk = await self.answer(req)

        async def one() -> AsyncIterator[StreamChunk]:
            yield chunk

        return await collect(req, one())

    # ---- embeddings (a pooling model) ------------------------------------------------------
    async def pool(self, inputs: list[tuple[int, ...]], dimensions: int | None = None) -> list[list[float]]:
        """``POST /v1/embeddings`` with the token ids of each input; the server's vectors, in input order."""
        if self.pooling_model is None:
            raise NotSupported(f"the {self.label} server at {self.url} serves a generative model, which has no embeddings endpoint")
        client = self._admit_pooled()
        body: dict[str, Any] = {"model": self.pooling_model.served, "input": [list(x) for x in inputs], "encoding_format": "float"}
        if dimensions is not None:
            body["dimensions"] = dimensions
        self._in_flight += 1
        try:
            resp = await client.post("/v1/embeddings", json=body)
        except httpx.TransportError as exc:
            raise self._down(exc) from exc
        finally:
            self._in_flight -= 1
        out = json_or_text(resp)
        if resp.status_code != 200:
            err = self.translate_error(resp.status_code, out)
            if isinstance(err, InvalidRequest) and err.param is None and "dimension" in str(err).lower():
                err.param = "dimensions"
            raise err
        data = out.get("data") if isinstance(out, dict) else None
        if not isinstance(data, list) or len(data) != len(inputs):
            raise EngineError(f"{self.label} answered {len(inputs)} embedding inputs with {len(data) if isinstance(data, list) else 'no'} vectors")
        vectors: list[list[float]] = [[] for _ in inputs]
        for item in data:
            index, value = item.get("index"), item.get("embedding")
            if not isinstance(index, int) or not 0 <= index < len(inputs) or not isinstance(value, list):
                raise EngineError(f"{self.label} sent an embedding entry loopwise cannot read: {str(item)[:200]}")
            vectors[index] = [float(x) for x in value]
        return vectors

    async def _serves_embeddings(self, model: str) -> bool:
        """Whether ``POST /v1/embeddings`` embeds here: one token, 200 only from a server whose model pools."""
        assert self.local is not None
        body = {"model": model, "input": [list(self.local.eos_token_ids[:1] or (0,))], "encoding_format": "float"}
        try:
            resp = await self._admit_any().post("/v1/embeddings", json=body, timeout=60.0)
        except httpx.TransportError as exc:
            raise self._down(exc) from exc
        return resp.status_code == 200

    # ---- GETs ------------------------------------------------------------------------------
    async def _get(self, client: httpx.AsyncClient, path: str, attempts: int = _GET_ATTEMPTS) -> httpx.Response:
        """GET an idempotent endpoint, retrying transport errors and 503 a bounded number of times."""
        last: Exception | None = None
        for attempt in range(1, attempts + 1):
            try:
                resp = await client.get(path)
                if resp.status_code != 503 or attempt == attempts:
                    return resp
                last = EngineError(f"HTTP 503 from {path}")
            except httpx.TransportError as exc:
                last = exc
            if attempt < attempts:
                delay = _GET_BACKOFF_S * 2 ** (attempt - 1)
                log.warning(f"{self.backend}_retry", url=self.url, path=path, attempt=attempt, of=attempts, delay_s=delay, error=repr(last))
                await asyncio.sleep(delay)
        raise ServerDown(f"cannot reach {self.label} at {self.url}{path} after {attempts} tries: {last!r}") from last

    async def _post_lora(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], timeout: float | None = None) -> httpx.Response:
        """POST an adapter load or unload (``body`` names ``lora_name``); a transport error is :class:`ServerDown`.
        Not retried: a load or unload is not idempotent (a retry after a lost answer would be "already exists")."""
        try:
            return await client.post(path, json=body, timeout=timeout or self.timeouts.adapter_s)
        except httpx.TransportError as exc:
            raise ServerDown(f"{self.label} {path} for {body['lora_name']!r} failed: {type(exc).__name__}: {exc}") from exc

    async def _get_json(self, path: str, attempts: int = _GET_ATTEMPTS) -> dict[str, Any]:
        resp = await self._get(self._admit_any(), path, attempts)
        if resp.status_code != 200:
            raise self.translate_error(resp.status_code, json_or_text(resp))
        data = resp.json()
        if not isinstance(data, dict):
            raise EngineError(f"{self.label} {path} did not answer a JSON object")
        return data

    # ---- adapters --------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> None:
        """Load ``name`` under a fresh server name; only a successful load is mapped."""
        async with self._locks[name]:
            if name in self._names:
                raise AdapterError(f"adapter {name!r} is already loaded (versions are immutable: load it under a new name)")
            server_name = f"{name}-{uuid.uuid4().hex[:12]}"  # never reused, even if family@N comes back
            await self._load(self._admit_any(), server_name, str(Path(path).absolute()))
            self._names[name] = server_name
            log.info(f"{self.backend}_adapter_loaded", url=self.url, adapter=name, server_name=server_name, path=str(path))

    async def unload_adapter(self, name: str) -> None:
        """Unload ``name``. The registry has already drained its in-flight requests."""
        async with self._locks[name]:
            server_name = self._names.get(name)
            if server_name is None:
                raise AdapterError(f"adapter {name!r} is not loaded")
            try:
                await self._unload(self._admit_any(), server_name)
            except AdapterGone as exc:
                log.warning(f"{self.backend}_adapter_already_gone", url=self.url, adapter=name, server_name=server_name, error=str(exc))
            del self._names[name]
            self._locks.pop(name, None)
            log.info(f"{self.backend}_adapter_unloaded", url=self.url, adapter=name, server_name=server_name)

    def adapters(self) -> dict[str, str]:
        """loopwise adapter name → the server's name it is loaded under."""
        return dict(self._names)

    def forget_adapters(self, names: list[str] | None = None) -> list[str]:
        """Drop the mappings of ``names`` (default: all), e.g. after the server restarted without them; returns the
        server names that were mapped."""
        gone = [n for n in (list(self._names) if names is None else names) if n in self._names]
        return [self._names.pop(n) for n in gone]

    async def discard(self, server_names: list[str]) -> None:
        """Best effort: unload server names we no longer map (left over from before the server went away)."""
        client = self._admit_any()
        for server_name in server_names:
            try:
                await self._unload(client, server_name, timeout=self.timeouts.adapter_s)
            except AdapterGone:
                continue
            except EngineError as exc:
                log.warning(f"{self.backend}_discard_failed", url=self.url, server_name=server_name, error=str(exc))

    def stats(self) -> dict[str, float]:
        return {"waiting": 0.0, "running": float(self._in_flight)}
