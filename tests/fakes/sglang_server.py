"""A protocol-faithful fake of SGLang's native HTTP server, backed by loopwise's embedded engine.

Run it like ``python -m sglang.launch_server``::

    python -m tests.fakes.sglang_server --model-path MODEL_DIR --port 30000 --enable-lora \
        --max-lora-rank 8 --lora-target-modules all --max-loras-per-batch 9 --max-loaded-loras 16

It implements the request and response shapes of SGLang's native HTTP API:

- ``POST /generate`` (one request, ``input_ids`` only): ``sampling_params`` (``max_new_tokens``,
  ``temperature``, ``top_p``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``,
  ``json_schema``, ``ebnf``; as in SGLang 0.5.21, ``sampling_seed`` is ignored unless the server runs with
  ``--enable-deterministic-inference``, which the tests' shared fake does, as a GPU server could),
  ``return_logprob``, ``top_logprobs_num``, ``lora_path`` (a registered *name*), ``stream``. The answer is
  ``{"text", "output_ids", "meta_info"}``; ``meta_info`` has ``id``,
  ``finish_reason`` (``null`` while streaming, then ``{"type": "stop", "matched": id|str}`` or
  ``{"type": "length", "length": N}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
  ``output_token_logprobs`` (``[logprob, token_id, null]`` triples) and ``output_top_logprobs``; with
  ``logprob_start_len: 0`` also ``input_token_logprobs`` (the first prompt token's logprob null) and
  ``input_top_logprobs`` (in every cumulative event; in the first only with incremental output).
  ``max_new_tokens`` 0 scores the prompt without generating.
  Streams are SSE ``data: {...}`` events with *cumulative* ``text``/``output_ids``/logprobs (SGLang's
  default), or deltas with ``--incremental-streaming-output``, then ``data: [DONE]``. Errors: HTTP 400
  ``{"error": {"message"}}``; in a stream, an ``{"error": {"message", "type", "code"}}`` event, then ``[DONE]``.
- ``POST /load_lora_adapter`` / ``POST /unload_lora_adapter``: ``LoRAUpdateOutput`` bodies, HTTP 400 with
  ``success: false`` and SGLang 0.5.21's messages (LoRA not enabled, already loaded, does not exist, rank
  incompatible with the memory pool). Unload removes the name from routing at once, then waits for the
  adapter's in-flight requests (as SGLang does). Loads and unloads are serialised by one lock. A load past
  ``--max-loaded-loras`` evicts the least recently used unpinned adapter (requests count as uses).
- A ``/generate`` naming an adapter that was loaded once and is not loaded now (unloaded or evicted)
  loads it again from the path it was loaded from, waiting for an unload in progress (SGLang's
  ``lora_ref_cache``); only a name never loaded is refused, HTTP 400 "Got LoRA adapter that has never been
  loaded" (what a restarted SGLang answers for an adapter it had before).
- ``GET /health_generate`` (and ``/health``): a one-token generate; 200 with an empty body.
- ``GET /get_model_info``, ``GET /get_server_info`` (the server args we take, plus ``version``).
- ``GET /v1/models``: the base model and each loaded adapter (``parent``), as after SGLang PR #12229.
- A ``json_schema`` / ``ebnf`` that does not compile aborts the request as SGLang 0.5.21 does: HTTP 400
  ``{"error": {"message": "Failed to compile json grammar: <xgrammar's error>"}}``, or in a stream one event whose
  ``meta_info.finish_reason`` is ``{"type": "abort", "message", "status_code": 400, "err_type": "BadRequestError"}``,
  then ``[DONE]`` (the scheduler's ``set_finish_with_abort``; the tokenizer manager raises it as a ``ValueError`` only
  when not streaming).
- ``--is-embedding`` serves the model as an embedding model, as SGLang does with that flag: ``/get_model_info`` says
  ``is_generation: false`` with its ``embedding`` entry (a decoder asked for embeddings: ``pooling``
  ``model_defined``, which for a Llama-family model is the last token's final hidden state, ``normalize`` true),
  ``POST /v1/embeddings`` answers (``input`` a string, strings, token ids or lists of them; ``encoding_format``
  ``float`` or ``base64``; ``dimensions`` refused, the model not being Matryoshka) with SGLang's ``EmbeddingResponse``
  (``data`` of ``{"embedding", "index", "object": "embedding"}``, ``model`` the model path, ``usage``) or its flat
  ``{"object": "error", "message", "type", "param", "code"}`` 400, and ``/generate`` refuses to generate.

Fake-only controls, for tests: ``POST /fake/die_after`` ``{"tokens": n}`` makes the process exit
(``os._exit``, like a crashed SGLang) after the next stream has sent ``n`` token events;
``GET /fake/stats`` counts ``/generate`` calls and reports the most adapters seen in flight at once.

The contract with real SGLang (0.5.21 on CPU) is checked by ``tests/runtime/test_sglang_contract.py``, which runs
the same requests against this fake and, where ``make sglang`` installed it, a real server.

Not faithful (and not needed here): batch requests, ``text`` prompts, ``n``, ``regex``, the
OpenAI-compatible routes other than ``/v1/embeddings``, abort/flush endpoints, real GPU slot accounting. The scheduler crash of SGLang
#23141 (more distinct adapters in flight, plus base requests, than ``--max-loras-per-batch``) is *not*
reproduced as a crash: the fake answers such a request with HTTP 500 and logs it, so a test that breaks
loopwise's "one slot free for the base" rule fails loudly.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import math
import os
import struct
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.engine import (
    AdapterError,
    EngineError,
    EngineOverloaded,
    GenerateRequest,
    Grammar,
    InvalidRequest,
    SamplingParams,
    StreamChunk,
    TokenLogprob,
)
from runtime.engines.embedded import EmbeddedEngine

log = logging.getLogger("fake-sglang")

FAKE_VERSION = "0.5.21-fake"  # the SGLang release it was checked against
_SUPPORTED_SAMPLING = {
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "max_new_tokens",
    "temperature",
    "top_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
    "json_schema",
    "ebnf",
    "skip_special_tokens",
    "no_stop_trim",
    "spaces_between_special_tokens",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fake sglang.launch_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="+", default=None)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    p.add_argument("--tokenizer-worker-num", type=int, default=1)
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=32)
    # accepted for the launcher's CPU flags (runtime/engines/sglang_launcher.py); they change nothing here
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--sampling-backend", default=None)
    p.add_argument("--lora-backend", default=None)
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--constrained-json-disable-any-whitespace", action="store_true")  # the fake's JSON is compact anyway
    # SGLang 0.5.21 samples with a request's sampling_seed only with this flag (which its CPU path cannot run); else it ignores it
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--is-embedding", action="store_true")  # serve the model as an embedding model (no generation)
    return p.parse_args(argv)


class _Lora:
    def __init__(self, path: str, rank: int, pinned: bool = False) -> None:
        self.path = path
        self.rank = rank
        self.pinned = pinned
        self.in_flight = 0
        self.drained = asyncio.Event()
        self.drained.set()


def build_app(args: argparse.Namespace) -> FastAPI:
    engine = EmbeddedEngine(Path(args.model_path), model_id=args.served_model_name or args.model_path, max_batch_size=args.max_running_requests)
    loras: OrderedDict[str, _Lora] = OrderedDict()  # SGLang's LoRARegistry: least recently used first
    lora_lock = asyncio.Lock()  # SGLang's lora_update_lock: one load/unload at a time
    unloading: dict[str, _Lora] = {}  # removed from routing, waiting for in-flight requests
    ever_loaded: dict[str, tuple[str, bool]] = {}  # SGLang's lora_ref_cache: name -> (path, pinned) of its last load
    state: dict[str, Any] = {"die_after": None, "generate_calls": 0, "base_in_flight": 0, "max_adapters_in_flight": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        # SGLang's real readiness line (launch_server logs it once warmup is done)
        print("The server is fired up and ready to roll!", flush=True)
        yield
        await engine.close()

    app = FastAPI(lifespan=lifespan)

    def server_args() -> dict[str, Any]:
        return {
            "model_path": args.model_path,
            "tokenizer_path": args.model_path,
            "host": args.host,
            "port": args.port,
            "served_model_name": args.served_model_name or args.model_path,
            "enable_lora": args.enable_lora,
            "max_lora_rank": args.max_lora_rank,
            "lora_target_modules": args.lora_target_modules,
            "max_loras_per_batch": args.max_loras_per_batch,
            "max_loaded_loras": args.max_loaded_loras,
            "tokenizer_worker_num": args.tokenizer_worker_num,
            "incremental_streaming_output": args.incremental_streaming_output,
            "context_length": args.context_length,
            "max_running_requests": args.max_running_requests,
            "max_total_tokens": args.max_total_tokens,
            "enable_deterministic_inference": args.enable_deterministic_inference,
            "device": args.device,
            "dtype": args.dtype,
            "stream_interval": 1,
            "is_embedding": args.is_embedding,
        }

    # ---- info and health ----------------------------------------------------------------------
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": args.model_path,
            "served_model_name": args.served_model_name or args.model_path,
            "tokenizer_path": args.model_path,
            "is_generation": not args.is_embedding,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "embedding": embedding_spec(),
        }

    def embedding_spec() -> dict[str, Any]:
        """SGLang 0.5.21's ``resolved_embedding_plan`` of a decoder (LlamaForCausalLM): "explicit_decoder_embedding" under
        ``--is-embedding``, else no embedding task (the fields loopwise reads, and a few beside them)."""
        if not args.is_embedding:
            return {"family": "none", "task": "none", "execution": "none", "pooling": "model_defined", "normalize": False, "enabled": False}
        return {
            "family": "explicit_decoder_embedding",
            "task": "embed",
            "execution": "decoder_pooling",
            "attention": "causal",
            "pooling": "model_defined",
            "normalize": True,
            "supports_dimensions": False,
            "enabled": True,
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return {**server_args(), "internal_states": [{"last_gen_throughput": 0.0}], "version": FAKE_VERSION}

    @app.get("/health_generate")
    @app.get("/health")
    async def health_generate() -> Response:
        req = GenerateRequest("HEALTH_CHECK_fake", engine.info.eos_token_ids[:1] or (0,), SamplingParams(max_new_tokens=1, temperature=0))
        try:
            await asyncio.wait_for(engine.generate(req), timeout=20)  # SGLANG_HEALTH_CHECK_TIMEOUT
        except (EngineError, TimeoutError):
            log.exception("health check failed")
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = args.served_model_name or args.model_path
        data = [
            {
                "id": base,
                "object": "model",
                "created": 0,
                "owned_by": "sglang",
                "root": base,
                "parent": None,
                "max_model_len": engine.info.max_model_len,
            }
        ]
        data += [{"id": n, "object": "model", "created": 0, "owned_by": "sglang", "root": lo.path, "parent": base} for n, lo in loras.items()]
        return {"object": "list", "data": data}

    # ---- LoRA ---------------------------------------------------------------------------------
    def lora_output(success: bool, error: str | None = None) -> JSONResponse:
        body = {"success": success, "error_message": error, "loaded_adapters": {n: lo.path for n, lo in loras.items()}}
        return JSONResponse(body, status_code=200 if success else 400)

    async def load_locked(name: str, path: str, pinned: bool) -> str | None:
        """Load ``name`` (``lora_lock`` held); the error message, or None. Past ``--max-loaded-loras`` the least
        recently used unpinned adapter is unloaded (SGLang's ``load_lora_adapter``)."""
        if name in loras:  # SGLang's LoRAManager.validate_new_adapter
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        try:
            cfg = json.loads((Path(path) / "adapter_config.json").read_text())
        except (OSError, ValueError, TypeError) as exc:
            return f"Failed to load LoRA adapter {name} from {path}: {exc}"  # [U] wording: SGLang passes the loader's exception on
        rank = int(cfg.get("r", 0))
        targets = args.lora_target_modules or ["all"]
        wanted = cfg.get("target_modules") or []
        too_big = args.max_lora_rank is not None and rank > args.max_lora_rank
        if too_big or ("all" not in targets and not set(wanted) <= set(targets)):
            return (
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool configuration. "
                "Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the target "
                "modules are included in `--lora-target-modules`."
            )
        try:
            await engine.load_adapter(name, path)
        except AdapterError as exc:
            return f"Failed to load LoRA adapter {name}: {exc}"
        loras[name] = _Lora(path, rank, pinned)
        ever_loaded[name] = (path, pinned)
        while args.max_loaded_loras is not None and len(loras) > args.max_loaded_loras:
            lru = next((n for n, lo in loras.items() if not lo.pinned), None)
            if lru is None:
                return "Didn't find any LoRA adapters when trying to evict LRU LoRA adapter."
            log.info("fake: unloading least recently used LoRA adapter %r", lru)
            await unload_locked(lru)
        return None

    async def unload_locked(name: str) -> str | None:
        lora = loras.pop(name, None)  # unregistered at once; a request naming it now loads it again after this unload
        if lora is None:
            return f"LoRA with name {name} does not exist. Loaded LoRAs: {_keys(loras)}"
        unloading[name] = lora
        try:
            await lora.drained.wait()  # SGLang waits for in-flight requests, with no timeout
            await engine.unload_adapter(name)
        finally:
            del unloading[name]
        return None

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await request.json()
        if not args.enable_lora:
            return lora_output(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        async with lora_lock:
            error = await load_locked(body.get("lora_name"), body.get("lora_path"), bool(body.get("pinned")))
        return lora_output(error is None, error)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body = await request.json()
        if not args.enable_lora:
            return lora_output(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        async with lora_lock:
            error = await unload_locked(body.get("lora_name"))
        return lora_output(error is None, error)

    async def resolve_lora(name: str | None) -> None:
        """SGLang's ``_resolve_lora_path``: a name loaded once is loaded again if it is not loaded now; a use counts for the LRU."""
        if name is None:
            return
        if not args.enable_lora:
            raise AdapterError(
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with --enable-lora "
                "flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        if name not in loras:
            if name not in ever_loaded:
                raise AdapterError(f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: dict_keys({list(ever_loaded)}).")
            log.info("fake: reloading evicted adapter: %s", name)
            async with lora_lock:
                error = None if name in loras else await load_locked(name, *ever_loaded[name])
            if error is not None and "already loaded" not in error:
                raise AdapterError(f"Failed to implicitly load LoRA adapter {name}: {error}")
        loras.move_to_end(name)

    # ---- generate -----------------------------------------------------------------------------
    def to_request(body: dict[str, Any]) -> GenerateRequest:
        if "text" in body and body["text"] is not None:
            raise InvalidRequest("the fake takes input_ids only")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise InvalidRequest("input_ids must be one non-empty list of ints (the fake does not batch)")
        sp: dict[str, Any] = body.get("sampling_params") or {}
        unknown = set(sp) - _SUPPORTED_SAMPLING
        if unknown or sp.get("n", 1) != 1:
            raise InvalidRequest(f"the fake does not implement sampling params {sorted(unknown)}")
        grammar = None
        if sp.get("json_schema"):
            grammar = Grammar("json_schema", sp["json_schema"])
        elif sp.get("ebnf"):
            grammar = Grammar("ebnf", sp["ebnf"])
        stop = sp.get("stop") or ()
        want_lp = bool(body.get("return_logprob"))
        start = body.get("logprob_start_len", -1)
        if start not in (-1, 0, None):
            raise InvalidRequest(f"the fake takes logprob_start_len -1 or 0, not {start!r}")
        sampling = SamplingParams(
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            seed=sp.get("sampling_seed") if args.enable_deterministic_inference else None,  # as SGLang: ignored without the flag
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            ignore_eos=bool(sp.get("ignore_eos", False)),
            logprobs=want_lp,
            top_logprobs=int(body.get("top_logprobs_num") or 0) if want_lp else 0,
            grammar=grammar,
            presence_penalty=float(sp.get("presence_penalty") or 0.0),
            frequency_penalty=float(sp.get("frequency_penalty") or 0.0),
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in (sp.get("logit_bias") or {}).items())),
            prompt_logprobs=int(body.get("top_logprobs_num") or 0) if want_lp and start == 0 else None,
        )
        lora = body.get("lora_path")
        if len(ids) + sampling.max_new_tokens > engine.info.max_model_len:
            raise InvalidRequest(f"Requested token count exceeds the model's maximum context length of {engine.info.max_model_len} tokens.")
        return GenerateRequest(str(body.get("rid") or f"fake-{state['generate_calls']}"), tuple(ids), sampling, adapter=lora)

    def acquire(name: str | None) -> None:
        if name is None:
            state["base_in_flight"] += 1
        else:
            lo = loras[name]
            lo.in_flight += 1
            lo.drained.clear()
        hot = sum(1 for lo in loras.values() if lo.in_flight) + (1 if state["base_in_flight"] else 0)
        state["max_adapters_in_flight"] = max(state["max_adapters_in_flight"], hot)
        if hot > args.max_loras_per_batch:
            log.error(
                "fake: %d adapters (with the base) in flight > --max-loras-per-batch %d (SGLang #23141 would crash)", hot, args.max_loras_per_batch
            )
            release(name)
            raise EngineError("SGLang #23141: more LoRA slots needed than --max-loras-per-batch")

    def release(name: str | None) -> None:
        if name is None:
            state["base_in_flight"] -= 1
            return
        lo = _find(name)
        if lo is not None:
            lo.in_flight -= 1
            if lo.in_flight == 0:
                lo.drained.set()

    def _find(name: str) -> _Lora | None:
        return loras.get(name) or unloading.get(name)

    def meta(
        req: GenerateRequest,
        ids: list[int],
        lps: list[list[Any]],
        tops: list[list[list[Any]]],
        finish: Any,
        prompt: tuple[TokenLogprob, ...] | None = None,
    ) -> dict[str, Any]:
        m: dict[str, Any] = {
            "id": req.request_id,
            "finish_reason": finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": "default",
        }
        if req.sampling.logprobs:
            m["output_token_logprobs"] = lps
            m["output_top_logprobs"] = tops if req.sampling.top_logprobs else [None] * len(lps)
        if prompt is not None:  # the prompt's tokens from the first, whose logprob is null
            m["input_token_logprobs"] = [[None, req.input_ids[0], None]] + [[lp.logprob, lp.token_id, None] for lp in prompt]
            if req.sampling.top_logprobs:
                m["input_top_logprobs"] = [None] + [[[v, t, None] for t, v in lp.top] for lp in prompt]
        return m

    def finish_of(chunk: StreamChunk, n: int) -> dict[str, Any] | None:
        if chunk.finish_reason is None:
            return None
        if chunk.finish_reason == "length":
            return {"type": "length", "length": n}
        return {"type": "stop", "matched": chunk.matched_stop}

    async def compiled(req: GenerateRequest) -> GenerateRequest | str:
        """``req`` with its grammar compiled, or SGLang's abort message when it does not compile (its grammar backend
        compiles on a thread; "Failed to compile json grammar: <xgrammar's error>", the scheduler's wording)."""
        grammar = req.sampling.grammar
        if grammar is None:
            return req
        try:
            ready = await asyncio.to_thread(engine.compile_grammar, grammar)
        except InvalidRequest as exc:
            key = "json" if grammar.kind == "json_schema" else grammar.kind
            return f"Failed to compile {key} grammar: {exc.__cause__ or exc}"
        return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, grammar=dataclasses.replace(grammar, compiled=ready)))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        state["generate_calls"] += 1
        if args.is_embedding:  # [U] wording: what SGLang's scheduler answers a generate on an embedding model
            return _error(InvalidRequest("This model is an embedding model (--is-embedding): it does not generate"), stream=bool(body.get("stream")))
        try:
            req = to_request(body)
            await resolve_lora(req.adapter)
            ready = await compiled(req)
            if isinstance(ready, str):
                return _abort(req, ready, stream=bool(body.get("stream")))
            req = ready
            acquire(req.adapter)
        except (InvalidRequest, AdapterError) as exc:
            return _error(exc, stream=bool(body.get("stream")))
        except EngineError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=500)
        if body.get("stream"):
            return StreamingResponse(stream_events(req), media_type="text/event-stream")
        prompt: tuple[TokenLogprob, ...] | None = None
        ids: list[int] = []
        lps: list[list[Any]] = []
        tops: list[list[list[Any]]] = []
        text = ""
        try:
            async for chunk in engine.stream(req):
                ids += chunk.token_ids
                prompt = chunk.prompt_logprobs if prompt is None else prompt
                text += chunk.text
                lps += [[lp.logprob, lp.token_id, None] for lp in chunk.logprobs]
                tops += [[[v, t, None] for t, v in lp.top] for lp in chunk.logprobs]
                if chunk.finish_reason is not None:
                    return JSONResponse({"text": text, "output_ids": ids, "meta_info": meta(req, ids, lps, tops, finish_of(chunk, len(ids)), prompt)})
        except EngineOverloaded as exc:
            return JSONResponse({"error": {"message": f"The request queue is full. ({exc})"}}, status_code=503)  # [U] wording
        except (InvalidRequest, AdapterError) as exc:
            return _error(exc, stream=False)
        finally:
            release(req.adapter)
        return JSONResponse({"error": {"message": "generation ended without a finish reason"}}, status_code=500)

    async def stream_events(req: GenerateRequest) -> AsyncIterator[bytes]:
        ids: list[int] = []
        lps: list[list[Any]] = []
        tops: list[list[list[Any]]] = []
        prompt: tuple[TokenLogprob, ...] | None = None
        text = ""
        sent = 0
        try:
            async for chunk in engine.stream(req):
                prompt = chunk.prompt_logprobs if prompt is None else prompt
                new_lps = [[lp.logprob, lp.token_id, None] for lp in chunk.logprobs]
                new_tops = [[[v, t, None] for t, v in lp.top] for lp in chunk.logprobs]
                ids, lps, tops, text = ids + list(chunk.token_ids), lps + new_lps, tops + new_tops, text + chunk.text
                finish = finish_of(chunk, len(ids))
                if args.incremental_streaming_output:
                    first = chunk.prompt_logprobs  # SGLang's incremental output sends the prompt's logprobs once
                    out = {"text": chunk.text, "output_ids": list(chunk.token_ids), "meta_info": meta(req, ids, new_lps, new_tops, finish, first)}
                    out["meta_info"]["completion_tokens"] = len(ids)
                else:
                    out = {"text": text, "output_ids": ids, "meta_info": meta(req, ids, lps, tops, finish, prompt)}
                yield b"data: " + json.dumps(out).encode() + b"\n\n"
                sent += 1
                die = state["die_after"]
                if die is not None and sent >= die:
                    log.error("fake: dying mid-stream after %d token events (kill switch)", sent)
                    os._exit(17)
        except (InvalidRequest, AdapterError, EngineError) as exc:
            err = {"error": {"message": str(exc), "type": "invalid_request_error", "code": 400, "retryable": False}}
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
        finally:
            release(req.adapter)
        yield b"data: [DONE]\n\n"

    # ---- embeddings (--is-embedding) ------------------------------------------------------------
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        body = await request.json()
        x, fmt = body.get("input"), body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            return _openai_error(f"encoding_format must be either 'float' or 'base64', got {fmt!r}")
        if not x:
            return _openai_error("Input cannot be empty")
        if not args.is_embedding:  # the tokenizer manager's check, raised as a ValueError
            return _openai_error(
                "This model does not appear to be an embedding model by default. "
                "Please add `--is-embedding` when launching the server or try another model."
            )
        if body.get("dimensions") is not None:
            return _openai_error(
                f"Model '{args.model_path}' does not support matryoshka representation, changing output dimensions will lead to poor results."
            )
        tok = engine.tokenizer
        if isinstance(x, str):
            seqs = [tok(x)["input_ids"]]
        elif all(isinstance(v, int) for v in x):
            seqs = [list(x)]
        elif all(isinstance(v, str) for v in x):
            seqs = [tok(v)["input_ids"] for v in x]
        else:
            seqs = [list(v) for v in x]
        for seq in seqs:
            if len(seq) > engine.info.max_model_len:
                return _openai_error(f"The input ({len(seq)} tokens) is longer than the model's context length ({engine.info.max_model_len} tokens).")
        # a LlamaForCausalLM under --is-embedding: the last token's final hidden state, L2-normalized (SGLang's Pooler)
        states = await engine.embed([tuple(s) for s in seqs], "last")
        data = []
        for i, v in enumerate(states):
            norm = math.sqrt(sum(f * f for f in v)) or 1.0
            unit = [f / norm for f in v]
            value: Any = base64.b64encode(struct.pack(f"<{len(unit)}f", *unit)).decode("ascii") if fmt == "base64" else unit
            data.append({"embedding": value, "index": i, "object": "embedding"})
        n = sum(len(s) for s in seqs)
        usage = {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None, "reasoning_tokens": 0}
        return JSONResponse({"data": data, "model": args.model_path, "object": "list", "usage": usage})

    # ---- fake-only controls -------------------------------------------------------------------
    @app.post("/fake/die_after")
    async def die_after(request: Request) -> dict[str, Any]:
        state["die_after"] = int((await request.json())["tokens"])
        return {"die_after": state["die_after"]}

    @app.get("/fake/stats")
    async def stats() -> dict[str, Any]:
        return {
            "generate_calls": state["generate_calls"],
            "max_adapters_in_flight": state["max_adapters_in_flight"],
            "loaded": {n: lo.path for n, lo in loras.items()},
        }

    return app


def _keys(loras: OrderedDict[str, _Lora]) -> str:
    """How SGLang prints its registry's names in messages (an ``OrderedDict`` 's keys)."""
    return f"odict_keys({list(loras)})"


def _error(exc: EngineError, *, stream: bool) -> Response:
    """SGLang's ``_create_error_response`` (400, nested) or, for a stream, one error event then ``[DONE]``."""
    if not stream:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)

    async def events() -> AsyncIterator[bytes]:
        err = {"error": {"message": str(exc), "type": "invalid_request_error", "code": 400, "retryable": False}}
        yield b"data: " + json.dumps(err).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _abort(req: GenerateRequest, message: str, *, stream: bool) -> Response:
    """A request the scheduler finished with ``set_finish_with_abort`` (400): a ``ValueError`` → HTTP 400 when not
    streaming; streamed, its one output event carries the abort finish reason, then ``[DONE]``. As the real server
    sends it (seen on SGLang 0.5.21's CPU path), that event holds one output id already sampled but no logprob for it
    (``output_token_logprobs: []``, ``completion_tokens: 1``)."""
    if not stream:
        return JSONResponse({"error": {"message": message}}, status_code=400)
    finish = {"type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"}
    meta = {
        "id": req.request_id,
        "finish_reason": finish,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": 1,
        "cached_tokens": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": [],
    }
    out = {"text": "", "output_ids": [req.input_ids[-1]], "meta_info": meta}

    async def events() -> AsyncIterator[bytes]:
        yield b"data: " + json.dumps(out).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _openai_error(message: str, status: int = 400) -> JSONResponse:
    """SGLang's OpenAI-compatible routes' flat error body (``OpenAIServingBase.create_error_response``)."""
    return JSONResponse({"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}, status_code=status)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="[fake-sglang] %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
