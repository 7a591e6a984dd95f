"""The SGLang engine: token ids in, token ids + logprobs out, through SGLang's native HTTP API.

``SGLangEngine(url, model_path, model_id=..., settings=...)`` talks to one SGLang server with one
``httpx.AsyncClient`` (explicit connect/read/write/pool timeouts):

- generation: ``POST /generate`` with ``input_ids`` (never text: the runtime owns templating and
  tokenization), ``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``, ``stop``,
  ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``, ``json_schema``/``ebnf``), ``return_logprob`` and
  ``top_logprobs_num``, ``stream``, and ``lora_path`` = the adapter's SGLang name. One request per
  call: ``n > 1`` is fanned out by the caller (``serving_chat`` builds one GenerateRequest per choice;
  SGLang's own ``n`` is never sent, see SGLang #36894);
- streaming: SSE ``data: {...}`` events. By default SGLang sends *cumulative* ``output_ids``, ``text``
  and ``meta_info.output_token_logprobs``; with ``--incremental-streaming-output`` it sends deltas
  (``/get_server_info`` says which). Either way the engine yields only new tokens;
- text: decoded here from the token ids with the local tokenizer (``TextStream``, as the embedded
  engine does), so stop strings are cut and partial UTF-8 is held back the same way on both backends.
  SGLang's ``text`` field is not used;
- adapters: ``POST /load_lora_adapter`` under a fresh SGLang name per load (``family@N-<uuid>``: a name
  is never reused, because SGLang's prefix cache is keyed per load), ``POST /unload_lora_adapter``;
  one lock per name; the registry (``runtime/adapters.py``) drains in-flight requests before unload
  and caps loaded adapters at SGLang's ``--max-loras-per-batch`` − 1 (``serve.py``);
- health: ``GET /health_generate`` (a one-token generate inside SGLang); info: ``/get_model_info``,
  ``/get_server_info``. Only these idempotent GETs are retried (bounded, each retry logged).

Errors: SGLang's nested ``{"error": {"message"}}`` (``/generate``, stream events), flat
``{"object": "error", "message", ...}`` (OpenAI routes) and ``LoRAUpdateOutput`` (``success: false``)
bodies become :class:`InvalidRequest`, :class:`AdapterError`, :class:`EngineOverloaded` or
:class:`EngineError`; transport failures become :class:`EngineClosed` (before a stream starts) or
:class:`EngineError` (mid-stream), which the app turns into OpenAI's envelope or an SSE error event.

Logprob convention: SGLang's ``output_token_logprobs`` are passed through as they come. Whether they
are of ``logits / T`` (loopwise's convention, ``runtime/engine.py``) or of the raw logits depends on
SGLang's build and settings (unconfirmed, see serving-apis.md); the fake used in tests gives ``logits / T``.

Not here: launching SGLang (``runtime/sglang_launcher.py``), chat templating, tool parsing.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

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
    StreamChunk,
    Timings,
    TokenLogprob,
    collect,
)
from runtime.engines.textstream import TextStream
from runtime.settings import SGLangSettings

log = structlog.stdlib.get_logger(__name__)

_GET_ATTEMPTS = 3
_GET_BACKOFF_S = 0.2


# ---- error translation (pure) ---------------------------------------------------------------------


def error_message(body: Any) -> str:
    """The message of any SGLang error body: nested ``{"error": {...}}``, flat ``{"message": ...}``,
    ``{"error": "text"}``, ``LoRAUpdateOutput`` (``error_message``), or plain text."""
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


def translate_error(status: int, body: Any) -> EngineError:
    """An SGLang error response (status and parsed body) as a loopwise engine error."""
    msg = error_message(body)
    low = msg.lower()
    if "lora" in low and ("not loaded" in low or "does not exist" in low or "not enabled" in low):
        return AdapterError(f"SGLang: {msg}")
    if status == 429 or (status == 503 and "queue" in low):
        return EngineOverloaded(f"SGLang is overloaded: {msg}", retry_after=1.0)
    if "context length" in low or "context_length" in low or "too long" in low:
        return InvalidRequest(f"SGLang: {msg}", param="messages", code="context_length_exceeded")
    if 400 <= status < 500:
        return InvalidRequest(f"SGLang refused the request: {msg}")
    if status == 503:
        return EngineClosed(f"SGLang is unavailable: {msg}")
    return EngineError(f"SGLang error (HTTP {status}): {msg}")


def _json_or_text(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text


# ---- one request's output, chunk by chunk ---------------------------------------------------------


class _Decoder:
    """Turns SGLang outputs (cumulative or incremental) into :class:`StreamChunk` s of new tokens only."""

    def __init__(self, req: GenerateRequest, tokenizer: Any, incremental: bool) -> None:
        self.req = req
        self.text = TextStream(tokenizer, req.sampling.stop)
        self.incremental = incremental
        self.seen = 0  # output tokens already handed out
        self.t_submit = time.perf_counter()
        self.t_first = 0.0

    def feed(self, out: dict[str, Any]) -> StreamChunk | None:
        meta = out.get("meta_info") or {}
        lp_triples = meta.get("output_token_logprobs") or []
        ids = out.get("output_ids")
        if ids is None:  # builds that only return ids inside the logprob triples
            ids = [int(t[1]) for t in lp_triples]
        start = 0 if self.incremental else self.seen
        new_ids = [int(t) for t in ids[start:]]
        finish = meta.get("finish_reason")
        if not new_ids and finish is None:
            return None
        if new_ids and not self.t_first:
            self.t_first = time.perf_counter()
        lps: tuple[TokenLogprob, ...] = ()
        if self.req.sampling.logprobs or self.req.sampling.top_logprobs:
            tops = meta.get("output_top_logprobs") or []
            new_lps = lp_triples[start:]
            new_tops = tops[start:]
            if len(new_lps) != len(new_ids):
                raise EngineError(f"SGLang sent {len(new_ids)} new tokens but {len(new_lps)} logprobs")
            lps = tuple(
                TokenLogprob(int(tid), float(lp[0]), tuple((int(t[1]), float(t[0])) for t in (new_tops[k] if k < len(new_tops) else None) or ()))
                for k, (tid, lp) in enumerate(zip(new_ids, new_lps, strict=True))
            )
        self.seen += len(new_ids)
        reason, matched = _finish(finish)
        text_parts = []
        for k, tid in enumerate(new_ids):
            last = k == len(new_ids) - 1
            if last and reason == "stop" and isinstance(matched, int) and tid == matched:
                continue  # an eos / stop token has no text (as in the embedded engine)
            text_parts.append(self.text.push(tid))
        if reason is None:
            return StreamChunk(tuple(new_ids), "".join(text_parts), lps)
        text_parts.append(self.text.flush())
        if reason == "stop" and matched is None and self.text.stopped is not None:
            matched = self.text.stopped
        now = time.perf_counter()
        first = self.t_first or now
        timings = Timings(0.0, first - self.t_submit, now - self.t_submit)
        return StreamChunk(tuple(new_ids), "".join(text_parts), lps, reason, matched, timings)  # type: ignore[arg-type]


def _finish(finish: Any) -> tuple[str | None, str | int | None]:
    """SGLang's ``finish_reason`` dict → (loopwise finish reason, matched stop)."""
    if finish is None:
        return None, None
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    if kind == "stop":
        matched = finish.get("matched") if isinstance(finish, dict) else None
        return "stop", matched if isinstance(matched, int | str) else None
    if kind == "length":
        return "length", None
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        status = finish.get("status_code") if isinstance(finish, dict) else None
        if isinstance(status, int) and 400 <= status < 500:
            raise translate_error(status, {"error": {"message": message or "aborted"}})
        raise EngineError(f"SGLang aborted the request: {message or 'no reason given'}")
    raise EngineError(f"SGLang sent an unknown finish reason: {finish!r}")


# ---- the engine -----------------------------------------------------------------------------------


class SGLangEngine:
    """An SGLang server as an :class:`runtime.engine.Engine`. Construct, ``await start()``, then serve."""

    def __init__(
        self,
        url: str,
        model_path: Path,
        *,
        model_id: str,
        settings: SGLangSettings,
        max_concurrency: int = 288,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._path = Path(model_path)
        self._model_id = model_id
        self._settings = settings
        self._max_concurrency = max_concurrency
        self._on_close = on_close  # e.g. stop a launched SGLang: runs in close(), inside the app's shutdown
        self._client: httpx.AsyncClient | None = None
        self._info: EngineInfo | None = None
        self._incremental = False
        self._in_flight = 0
        self._names: dict[str, str] = {}  # loopwise adapter name (family@N) -> SGLang lora_name
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.tokenizer: Any = None
        self.model: Any = None  # the base model's modules on the meta device (shapes only, for adapter validation)
        self.server_info: dict[str, Any] = {}
        self.model_info: dict[str, Any] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineClosed("engine not started")
        return self._info

    async def start(self) -> None:
        s = self._settings
        timeout = httpx.Timeout(connect=s.connect_timeout_s, read=s.request_timeout_s, write=30.0, pool=s.request_timeout_s)
        limits = httpx.Limits(max_connections=self._max_concurrency + 8, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits)
        local = await asyncio.to_thread(_load_local, self._path)
        self.tokenizer, self.model = local["tokenizer"], local["model"]
        self.model_info = await self._get_json("/get_model_info")
        self.server_info = await self._get_json("/get_server_info")
        self._incremental = bool(self.server_info.get("incremental_streaming_output", False))
        max_len = local["max_len"]
        served = self.server_info.get("context_length")
        if isinstance(served, int) and served > 0:
            max_len = min(max_len, served)
        self._info = EngineInfo(
            backend="sglang",
            model=self._model_id,
            max_model_len=max_len,
            vocab_size=local["vocab"],
            eos_token_ids=local["eos"],
            dtype=str(self.server_info.get("dtype", "")),
        )
        remote = str(self.model_info.get("model_path", ""))
        if remote and Path(remote).name != self._path.name:
            log.warning("sglang_model_mismatch", local=str(self._path), sglang=remote, note="the tokenizer and template come from the local folder")
        log.info(
            "sglang_connected",
            url=self.url,
            model_path=remote,
            version=self.server_info.get("version"),
            max_loras_per_batch=self.server_info.get("max_loras_per_batch"),
            incremental_streaming=self._incremental,
        )

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        for name, lora_name in list(self._names.items()):  # leave SGLang as we found it; it outlives us
            try:
                await self._post_lora(client, "/unload_lora_adapter", {"lora_name": lora_name}, timeout=10.0)
            except EngineError as exc:
                log.warning("sglang_unload_on_close_failed", adapter=name, lora_name=lora_name, error=str(exc))
        self._names.clear()
        await client.aclose()
        if self._on_close is not None:
            await asyncio.to_thread(self._on_close)

    # ---- generation ------------------------------------------------------------------------
    def _payload(self, req: GenerateRequest, stream: bool) -> dict[str, Any]:
        sp = req.sampling
        params: dict[str, Any] = {
            "max_new_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "ignore_eos": sp.ignore_eos,
            "skip_special_tokens": True,
        }
        if sp.stop:
            params["stop"] = list(sp.stop)
        if sp.stop_token_ids:
            params["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        if sp.grammar is not None:
            if sp.grammar.kind == "ebnf":
                params["ebnf"] = sp.grammar.spec
            elif sp.grammar.kind == "json_object":
                params["json_schema"] = '{"type": "object"}'  # what SGLang's own OpenAI layer sends for json_object
            else:
                params["json_schema"] = sp.grammar.spec
        body: dict[str, Any] = {"rid": req.request_id, "input_ids": list(req.input_ids), "sampling_params": params, "stream": stream}
        if sp.logprobs or sp.top_logprobs:
            body["return_logprob"] = True
            body["top_logprobs_num"] = sp.top_logprobs
        if req.adapter is not None:
            lora_name = self._names.get(req.adapter)
            if lora_name is None:
                raise AdapterError(f"adapter {req.adapter!r} is not loaded")
            body["lora_path"] = lora_name
        return body

    def _admit(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineClosed("engine is not running")
        if self._in_flight >= self._max_concurrency:
            raise EngineOverloaded(
                f"server overloaded: {self._in_flight} requests in flight to SGLang (max {self._max_concurrency})", retry_after=1.0
            )
        return self._client

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        client = self._admit()
        body = self._payload(req, stream=True)
        decoder = _Decoder(req, self.tokenizer, self._incremental)
        self._in_flight += 1
        started = False  # a chunk was handed out: failures from here on are mid-stream
        try:
            async with client.stream("POST", "/generate", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise translate_error(resp.status_code, _json_or_text(resp))
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    out = json.loads(data)
                    if "error" in out:
                        err = out["error"]
                        code = err.get("code") if isinstance(err, dict) else None
                        raise translate_error(code if isinstance(code, int) else 400, out)
                    chunk = decoder.feed(out)
                    if chunk is None:
                        continue
                    started = True
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
            raise EngineError(f"SGLang's stream for {req.request_id} ended without a finish reason")
        except httpx.TransportError as exc:
            if started:
                log.error("sglang_stream_lost", request_id=req.request_id, tokens=decoder.seen, error=repr(exc))
                raise EngineError(f"lost the connection to SGLang mid-stream after {decoder.seen} tokens: {type(exc).__name__}") from exc
            raise EngineClosed(f"cannot reach SGLang at {self.url}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._in_flight -= 1

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        client = self._admit()
        body = self._payload(req, stream=False)
        decoder = _Decoder(req, self.tokenizer, incremental=False)
        self._in_flight += 1
        try:
            resp = await client.post("/generate", json=body)
        except httpx.TransportError as exc:
            raise EngineClosed(f"cannot reach SGLang at {self.url}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._in_flight -= 1
        if resp.status_code != 200:
            raise translate_error(resp.status_code, _json_or_text(resp))
        out = resp.json()
        if isinstance(out, list):  # a batch answer to a single request would be a protocol error
            raise EngineError("SGLang answered a single request with a batch")
        chunk = decoder.feed(out)
        if chunk is None or chunk.finish_reason is None:
            raise EngineError(f"SGLang's answer for {req.request_id} has no finish reason")

        async def one() -> AsyncIterator[StreamChunk]:
            yield chunk

        return await collect(req, one())

    async def health(self) -> None:
        """SGLang's ``/health_generate`` (it runs a one-token generate); raise :class:`EngineError` if it fails."""
        client = self._admit_any()
        resp = await self._get(client, "/health_generate", attempts=2)
        if resp.status_code != 200:
            raise EngineError(f"SGLang /health_generate answered HTTP {resp.status_code}")

    # ---- info ------------------------------------------------------------------------------
    async def refresh_info(self) -> dict[str, Any]:
        """Re-read ``/get_model_info`` and ``/get_server_info`` (both retried)."""
        self.model_info = await self._get_json("/get_model_info")
        self.server_info = await self._get_json("/get_server_info")
        return {"model": self.model_info, "server": self.server_info}

    def _admit_any(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineClosed("engine is not running")
        return self._client

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
                log.warning("sglang_retry", path=path, attempt=attempt, of=attempts, delay_s=delay, error=repr(last))
                await asyncio.sleep(delay)
        raise EngineClosed(f"cannot reach SGLang at {self.url}{path} after {attempts} tries: {last!r}") from last

    async def _get_json(self, path: str) -> dict[str, Any]:
        resp = await self._get(self._admit_any(), path)
        if resp.status_code != 200:
            raise translate_error(resp.status_code, _json_or_text(resp))
        data = resp.json()
        if not isinstance(data, dict):
            raise EngineError(f"SGLang {path} did not answer a JSON object")
        return data

    # ---- adapters --------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> None:
        """Load ``name`` into SGLang under a fresh ``lora_name``; only a successful load is mapped."""
        async with self._locks[name]:
            if name in self._names:
                raise AdapterError(f"adapter {name!r} is already loaded (versions are immutable: load it under a new name)")
            lora_name = f"{name}-{uuid.uuid4().hex[:12]}"  # never reused, even if family@N comes back
            await self._post_lora(self._admit_any(), "/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(path), "pinned": False})
            self._names[name] = lora_name
            log.info("sglang_adapter_loaded", adapter=name, lora_name=lora_name, path=str(path))

    async def unload_adapter(self, name: str) -> None:
        """Unload ``name`` from SGLang. The registry has already drained its in-flight requests."""
        async with self._locks[name]:
            lora_name = self._names.get(name)
            if lora_name is None:
                raise AdapterError(f"adapter {name!r} is not loaded")
            try:
                await self._post_lora(self._admit_any(), "/unload_lora_adapter", {"lora_name": lora_name})
            except AdapterError as exc:
                if "does not exist" not in str(exc):
                    raise
                log.warning("sglang_adapter_already_gone", adapter=name, lora_name=lora_name, error=str(exc))
            del self._names[name]
            self._locks.pop(name, None)
            log.info("sglang_adapter_unloaded", adapter=name, lora_name=lora_name)

    def adapters(self) -> dict[str, str]:
        """loopwise adapter name → the SGLang ``lora_name`` it is loaded under."""
        return dict(self._names)

    async def _post_lora(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], timeout: float | None = None) -> None:
        # not retried: a load or unload is not idempotent (a retry after a lost answer would be "already exists")
        try:
            resp = await client.post(path, json=body, timeout=timeout or self._settings.adapter_timeout_s)
        except httpx.TransportError as exc:
            raise AdapterError(f"SGLang {path} for {body['lora_name']!r} failed: {type(exc).__name__}: {exc}") from exc
        out = _json_or_text(resp)
        if resp.status_code == 200 and (not isinstance(out, dict) or out.get("success", True)):
            return
        raise AdapterError(f"SGLang {path} for {body['lora_name']!r} failed (HTTP {resp.status_code}): {error_message(out)}")

    def stats(self) -> dict[str, float]:
        return {"waiting": 0.0, "running": float(self._in_flight)}


def _load_local(path: Path) -> dict[str, Any]:
    """The tokenizer and the model's module shapes (meta device: no weights) from the local model folder."""
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
    return {
        "tokenizer": tokenizer,
        "model": model,
        "max_len": int(getattr(config, "max_position_embeddings", 2048)),
        "vocab": int(config.vocab_size),
        "eos": eos_ids,
    }


async def probe_server(url: str, settings: SGLangSettings) -> dict[str, Any]:
    """Check at startup that SGLang answers; returns ``/get_server_info``. Raises :class:`EngineClosed` with a
    message that says what to do."""
    timeout = httpx.Timeout(settings.connect_timeout_s, read=30.0)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout) as client:
        engine = SGLangEngine(url, Path("."), model_id="probe", settings=settings)
        try:
            resp = await engine._get(client, "/get_server_info")
        except EngineClosed as exc:
            raise EngineClosed(
                f"cannot reach SGLang at {url} ({exc.__cause__!r}); start an SGLang server there, fix --sglang-url, or pass --sglang-launch"
            ) from exc
        if resp.status_code != 200:
            raise EngineClosed(f"SGLang at {url} answered /get_server_info with HTTP {resp.status_code}: {error_message(_json_or_text(resp))}")
        info = resp.json()
        if not isinstance(info, dict):
            raise EngineClosed(f"{url}/get_server_info did not answer a JSON object: is this an SGLang server?")
        return info
