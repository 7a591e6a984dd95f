"""The embedded engine: a transformers model in this process, with continuous batching on CPU or GPU.

Architecture: one scheduler thread owns the model, the running batch and every torch call of the
engine (loading included, so the process has one OpenMP thread pool; see ``_loop_forever``). Each
loop iteration it (1) runs adapter commands, (2) admits waiting requests up to ``max_batch_size``,
fairly across owners when the batch cannot take them all (``fair_share.FairQueue``: the Virtual Token
Counter of Sheng et al., OSDI 2024; FCFS within an owner), each owner holding at most its equal share of
the rows while others are active (``row_share``: on a CPU every row slows every step),
(3) drops cancelled ones, then (4) runs one forward (``runner.py``): one token for every decoding row
plus up to ``prefill_chunk`` prompt tokens of the admitted requests, oldest first, so a long prompt is
fed over several steps while the others keep decoding (chunked prefill); while no request decodes, the oldest
prompt goes in pieces of up to ``IDLE_PREFILL_CHUNKS`` chunks (no one's token gap to protect). It samples per row
(temperature, top-p, seed, penalties and logit bias, grammar mask, logprobs; ``sampling.py``) for the
decode rows and for each prompt that finished, and hands each request its new text through its
asyncio queue. The event loop never runs model code.

Prompt logprobs (``SamplingParams.prompt_logprobs``): a request that asks for them has every prompt chunk
scored right after its forward (``prompt_scoring.py``, on the chunk's logits in bounded slices), and the
scores go out with its first chunk. ``max_new_tokens`` 0 scores only: the request ends after its prefill,
without sampling a token (finish ``length``).

Runners: ``llama_runner.LlamaRunner`` (fused, prepacked weights and its own KV pools; Llama, Mistral,
Qwen2/3) when ``llama_runner.fits`` the model, else ``hf_runner.HFRunner`` (the model's own forward);
``runner="transformers"`` forces the latter.

Why not transformers' ``init_continuous_batching``/``generate_batch``: measured for this issue, it has
one generation config for all requests (no per-request temperature, seed or grammar), returns only the
chosen token's logprob (no top-k), and has no per-request adapter. Those are what this API promises.

Concurrency invariants:
- ``_waiting`` (and its owners' counters) is guarded by ``_cv``; the scheduler thread alone touches ``_running``, ``_prefilling``
  and the runner.
- A request's ``cancelled`` flag is written by the event loop and read by the scheduler; the flag is a
  plain bool (atomic under the GIL) and the scheduler drops the row at its next step.
- Chunks cross threads only through ``loop.call_soon_threadsafe(queue.put_nowait, ...)``.

LoRA adapters (``lora_weights``, ``lora_batch``; no peft at serve time): ``load_adapter`` reads,
checks and prepares the weights on a worker thread, then attaches them on the scheduler thread between
two steps (a few dict insertions), so a load never stalls decoding for longer than that. Every forward
names one adapter (or the base) per row, and each adapted linear adds its rows' LoRA deltas in one
batched GEMM pair, so requests for different adapters and the base share one batch.
- An adapter is never unloaded while a request uses it: ``_unload_adapter_now`` checks the running,
  prefilling and waiting rows and drops the name from ``_adapters`` in one ``_cv`` critical section,
  and ``_submit`` checks the name and queues the row in one too; so a row is either refused or
  counted. The registry drains in-flight requests before it asks, so a refusal here means a caller
  bug; it is counted in ``stats()["adapter_unloads_refused"]`` and raised.

Not here yet: prefix caching.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime._futures import settle
from runtime.engine import (
    AdapterError,
    EngineClosed,
    EngineError,
    EngineInfo,
    EngineOverloaded,
    GenerateRequest,
    GenerateResult,
    Grammar,
    InvalidRequest,
    NonFiniteOutput,
    SamplingParams,
    StreamChunk,
    Timings,
    TokenLogprob,
    collect,
)
from runtime.engines import cpu_kernels, llama_runner
from runtime.engines.cpu_linear import cpu_flags
from runtime.engines.fair_share import W_DECODE, W_PREFILL, FairQueue, owner_of
from runtime.engines.hf_runner import HFRunner
from runtime.engines.lora_batch import LoraBank
from runtime.engines.lora_weights import LoraWeights, read_lora
from runtime.engines.prompt_scoring import score_prompt
from runtime.engines.runner import Chunk, DecodeRow, Runner
from runtime.engines.sampling import ArgmaxLse, Penalties, RowSampling, sample_next
from runtime.engines.textstream import TextStream
from runtime.grammar_worker import GrammarInvalid, GrammarWorker, compile_grammar

log = logging.getLogger(__name__)

IDLE_PREFILL_CHUNKS = 4  # while no request decodes, the oldest prompt's piece per step: up to this many prefill chunks


def pick_dtype(name: str) -> torch.dtype:
    """``auto``: bfloat16 where the CPU has native bf16 matmuls (AMX / AVX512-BF16) or on CUDA, else float32."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if torch.cuda.is_available():
        return torch.bfloat16
    flags = cpu_flags()
    return torch.bfloat16 if ("amx_bf16" in flags or "avx512_bf16" in flags) else torch.float32


@dataclass(eq=False)  # identity: the runner keys its KV by the sequence object
class _Seq:
    req: GenerateRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamChunk | BaseException]
    text: TextStream
    row: RowSampling
    stop_ids: frozenset[int]
    matcher: Any | None  # xgrammar.GrammarMatcher
    t_submit: float = field(default_factory=time.perf_counter)
    t_sched: float = 0.0
    t_first: float = 0.0
    generated: int = 0
    prefilled: int = 0  # prompt tokens fed to the model so far
    prompt_lps: list[TokenLogprob] | None = None  # the prompt's scores so far, when asked (until sent with the first chunk)
    nonfinite: bool = False  # a prompt score was NaN: the request fails instead of answering
    last_token: int = 0
    cancelled: bool = False
    done: bool = False
    owner: str = ""  # whose service this is (fair_share.owner_of)

    def send(self, item: StreamChunk | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EmbeddedEngine:
    """transformers in process, with LoRA adapters served side by side. Construct, ``await start()``, then ``stream``/``generate``."""

    def __init__(
        self,
        model_path: Path,
        *,
        model_id: str,
        dtype: str = "auto",
        max_batch_size: int = 32,
        max_queue: int = 256,
        max_model_len: int | None = None,
        threads: int | None = None,
        prefill_chunk: int = 512,
        runner: Literal["auto", "llama", "transformers"] = "auto",
        on_step: Callable[[int], None] | None = None,
        grammar_cache_mb: int = 256,
        fair_weights: tuple[float, float] = (W_PREFILL, W_DECODE),
        row_share: bool = True,
    ) -> None:
        self._path = Path(model_path)
        self.grammar_cache_bytes = grammar_cache_mb << 20
        self._model_id = model_id
        self._dtype = pick_dtype(dtype)
        self._max_batch = max_batch_size
        self._max_queue = max_queue
        self._max_model_len_cfg = max_model_len
        self._threads = threads
        self._prefill_chunk = prefill_chunk
        self._runner_choice = runner
        self._on_step = on_step
        self._cv = threading.Condition()
        self._waiting: FairQueue[_Seq] = FairQueue(*fair_weights)  # by owner: VTC order across owners, FCFS within one
        self._row_share = row_share  # while owners share the batch, each holds at most its equal share of rows
        self._ended: list[_Seq] = []  # rows that left the batch this iteration (their owners' counters settle under _cv)
        self._running: list[_Seq] = []  # decoding; the scheduler thread alone touches these two lists
        self._prefilling: list[_Seq] = []  # admitted, prompt not fully fed yet (oldest first)
        self._runner: Runner | None = None
        self._argmax_lse: ArgmaxLse | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._commands: deque[tuple[Callable[[], None], asyncio.Future[None]]] = deque()
        self._lora: LoraBank | None = None  # scheduler thread only (attach/detach/forward)
        self._adapters: set[str] = set()  # loaded adapter names; changed under _cv on the scheduler thread
        self._loading: set[str] = set()  # names being prepared on a worker thread (event loop only)
        self.adapter_unloads = 0
        self.adapter_unloads_refused = 0
        self._info: EngineInfo | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self._grammar_compiler: Any = None  # these two: built on the first constrained request (_grammar_tools)
        self._grammar_worker: GrammarWorker | None = None
        self._grammar_lock = threading.Lock()
        self.tokens_generated = 0

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineClosed("engine not started")
        return self._info

    async def start(self) -> None:
        """Load the model on the scheduler thread, then serve from it; raises what loading raised."""
        loaded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="loopwise-engine", daemon=True)
        self._thread.start()
        try:
            await loaded
        except BaseException:
            self._thread = None
            raise

    def _run(self, loaded: asyncio.Future[None]) -> None:
        """The scheduler thread. Loading here too keeps every torch call of the engine on this one thread:
        libgomp keeps an OpenMP thread pool per thread that ever ran a parallel region and, once the
        process holds more pool threads than CPUs, throttles every barrier's spin-wait to 1,000 rounds
        before sleeping in the kernel, so each of the hundreds of parallel regions of a step pays a
        futex wake-up. (A process that first converted SmolLM2 on its main thread, then loaded the
        model on a worker thread, served at 62% of the speed of one that did not convert.)"""
        loop = loaded.get_loop()
        try:
            self._load()
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, loaded, exc)
            return
        loop.call_soon_threadsafe(settle, loaded, None)
        self._loop_forever()

    def _load(self) -> None:
        bound_onednn_caches()  # before the first oneDNN primitive of the process (the weights' packing below)
        if self._threads:
            torch.set_num_threads(self._threads)
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(self._path)
        self.model = AutoModelForCausalLM.from_pretrained(self._path, dtype=self._dtype)
        self.model.eval()
        cfg = self.model.config
        limit = int(getattr(cfg, "max_position_embeddings", 2048))
        max_len = min(self._max_model_len_cfg or limit, limit)
        why_not = llama_runner.fits(self.model, max_len)
        if self._runner_choice == "llama" and why_not:
            raise EngineError(f"runner 'llama' cannot serve this model: {why_not}")
        if self._runner_choice == "transformers" or why_not:
            HFRunner.prepare(self.model)
            self._lora = LoraBank(self.model)  # after packing: LoRA sites sit in front of the packed forwards
            self._runner = HFRunner(self.model, self._lora)
            if why_not and self._runner_choice == "auto":
                log.info("serving through the transformers forward: %s", why_not)
        else:
            self._lora = LoraBank(self.model)
            self._runner = llama_runner.LlamaRunner(self.model, self._lora, max_len)
        kernels = cpu_kernels.ops()  # where built: the sampler's argmax and log-sum-exp in one compiled pass, any runner
        self._argmax_lse = kernels.argmax_lse if kernels is not None else None
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
        vocab = int(cfg.vocab_size)
        self._info = EngineInfo(
            backend="embedded",
            model=self._model_id,
            max_model_len=max_len,
            vocab_size=vocab,
            eos_token_ids=eos_ids,
            dtype=str(self._dtype).removeprefix("torch."),
            prompt_logprobs=True,
        )
        log.info(
            "model loaded in %.2fs (%s, %s, %s runner, %d threads)",
            time.perf_counter() - t0,
            self._path,
            self._info.dtype,
            self._runner.name,
            torch.get_num_threads(),
        )

    async def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        if self._grammar_worker is not None:
            await asyncio.to_thread(self._grammar_worker.close)

    # ---- public API ------------------------------------------------------------------------
    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        grammar = req.sampling.grammar
        if grammar is not None and grammar.compiled is None:
            # an internal grammar (an agent's self-check format; clients' are compiled by the admission, in the
            # killable worker): compiled off the event loop, as is the first one's xgrammar import and vocabulary read
            compiled = await asyncio.to_thread(self.compile_grammar, grammar)
            req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, grammar=dataclasses.replace(grammar, compiled=compiled)))
        seq = self._submit(req)
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            seq.cancelled = True  # no-op if finished; otherwise the scheduler drops the row

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        return await collect(req, self.stream(req))

    async def health(self) -> None:
        eos = self.info.eos_token_ids[:1] or (0,)
        req = GenerateRequest(request_id="health", input_ids=eos, sampling=SamplingParams(max_new_tokens=1, temperature=0))
        res = await self.generate(req)
        if len(res.output_ids) != 1:
            raise EngineError("health generate returned no token")

    async def embed(self, inputs: list[tuple[int, ...]], pooling: str) -> list[list[float]]:
        """The base model's final hidden states (no adapter), mean-pooled or the last token's, one input at a time.

        Runs on the scheduler thread between two decode steps (so no forward overlaps one that holds
        LoRA row state); callers bound the total tokens of a request."""
        out: list[list[float]] = []

        def run() -> None:
            assert self._lora is not None
            for ids in inputs:
                x = torch.tensor([ids], dtype=torch.long)
                with self._lora.rows([None], tokens=int(x.numel())):
                    h = self.model.get_decoder()(input_ids=x).last_hidden_state[0].float()  # (T, H), after the final norm
                out.append((h.mean(0) if pooling == "mean" else h[-1]).tolist())

        await self._run_in_scheduler(run)
        return out

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA folder under ``name``; it is served from the next step on, mixed with others.

        Reading and preparing the weights runs on a worker thread while decoding goes on; only the
        attach runs on the scheduler thread, between two steps."""
        if name in self._adapters or name in self._loading:
            raise AdapterError(f"adapter {name!r} is already loaded (versions are immutable: load it under a new name)")
        if self._lora is None:
            raise EngineClosed("engine not started")
        self._loading.add(name)
        try:
            t0 = time.perf_counter()
            weights = await asyncio.to_thread(self._read_adapter, name, path, self._lora)
            t1 = time.perf_counter()
            await self._run_in_scheduler(lambda: self._attach_adapter_now(name, weights))
        finally:
            self._loading.discard(name)
        log.info(
            "adapter %s loaded: %d modules, rank %d, %.1f MB; prepared in %.3fs, attached %.3fs later",
            name,
            len(weights.modules),
            weights.rank,
            weights.nbytes / 1e6,
            t1 - t0,
            time.perf_counter() - t1,
        )

    async def unload_adapter(self, name: str) -> None:
        """Drop an adapter. Refused (``AdapterError``) while any request still uses it; the registry drains first."""
        if name not in self._adapters:
            raise AdapterError(f"adapter {name!r} is not loaded")
        await self._run_in_scheduler(lambda: self._unload_adapter_now(name))

    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    async def _run_in_scheduler(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the scheduler thread between two steps, so weights never change under a forward."""
        if self._thread is None or self._stopping:
            raise EngineClosed("engine is not running")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._cv:
            self._commands.append((fn, fut))
            self._cv.notify()
        await fut

    @staticmethod
    def _read_adapter(name: str, path: str, bank: LoraBank) -> LoraWeights:
        """Worker thread: read, check and prepare the weights (``bank.targets`` is only read).

        On one torch thread: a parallel region here would give this worker thread an OpenMP pool of its
        own, and the scheduler's pool would be throttled from then on (see ``_run``)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return read_lora(path, bank.targets)
        except AdapterError as exc:
            raise AdapterError(f"could not load adapter {name!r}: {exc}") from exc
        finally:
            torch.set_num_threads(threads)

    def _attach_adapter_now(self, name: str, weights: LoraWeights) -> None:
        assert self._lora is not None
        self._lora.attach(name, weights)
        with self._cv:
            self._adapters.add(name)

    def _unload_adapter_now(self, name: str) -> None:
        assert self._lora is not None
        with self._cv:  # same critical section as _submit's check + enqueue (module docstring)
            # a cancelled row never runs again (_drop_cancelled and admission skip it before the next forward)
            users = sum(s.req.adapter == name for s in [*self._running, *self._prefilling, *self._waiting] if not (s.done or s.cancelled))
            if users:
                self.adapter_unloads_refused += 1
                log.error("refused to unload adapter %s: %d request(s) still use it", name, users)
                raise AdapterError(f"adapter {name!r} still has {users} request(s) in flight; not unloaded")
            self._adapters.discard(name)
        self._lora.detach(name)
        self.adapter_unloads += 1

    def stats(self) -> dict[str, float]:
        return {
            "waiting": float(len(self._waiting)),
            "running": float(len(self._running) + len(self._prefilling)),
            "adapters": float(len(self._adapters)),
            "adapter_unloads": float(self.adapter_unloads),
            "adapter_unloads_refused": float(self.adapter_unloads_refused),
        }

    # ---- submission (event loop thread) ----------------------------------------------------
    def _submit(self, req: GenerateRequest) -> _Seq:
        if self._thread is None or self._stopping:
            raise EngineClosed("engine is not running")
        info = self.info
        sp = req.sampling
        if not req.input_ids:
            raise InvalidRequest("empty prompt", param="messages")
        if len(req.input_ids) + sp.max_new_tokens > info.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {info.max_model_len} tokens. However, you requested "
                f"{len(req.input_ids) + sp.max_new_tokens} tokens ({len(req.input_ids)} in the messages, "
                f"{sp.max_new_tokens} in the completion). Please reduce the length of the messages or completion.",
                param="messages",
                code="context_length_exceeded",
            )
        if max(req.input_ids) >= info.vocab_size or min(req.input_ids) < 0:
            raise InvalidRequest("token id out of vocabulary range", param="input_ids")
        if any(not 0 <= t < info.vocab_size for t, _ in sp.logit_bias):
            raise InvalidRequest(f"logit_bias names a token id outside the vocabulary (0 to {info.vocab_size - 1})", param="logit_bias")
        if sp.prompt_logprobs is not None and not 0 <= sp.prompt_logprobs <= info.vocab_size:
            raise InvalidRequest(f"prompt_logprobs must be between 0 and {info.vocab_size}", param="prompt_logprobs")
        matcher = self._matcher(sp.grammar) if sp.grammar is not None else None
        gen = None
        if sp.seed is not None and sp.temperature > 0:
            gen = torch.Generator().manual_seed(sp.seed)
        stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(info.eos_token_ids))
        seq = _Seq(
            req=req,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            text=TextStream(self.tokenizer, sp.stop),
            row=RowSampling(sp.temperature, sp.top_p, gen, sp.top_logprobs if sp.logprobs else 0, _penalties(sp)),
            stop_ids=stop_ids,
            matcher=matcher,
            prompt_lps=[] if sp.prompt_logprobs is not None else None,
            owner=owner_of(req),
        )
        with self._cv:  # the adapter check and the enqueue in one step: an unload can't slip in between
            if req.adapter is not None and req.adapter not in self._adapters:
                raise AdapterError(f"adapter {req.adapter!r} is not loaded")
            free_slots = max(0, self._max_batch - len(self._running) - len(self._prefilling))  # those go straight into the batch
            if len(self._waiting) >= self._max_queue + free_slots:
                raise EngineOverloaded(
                    f"server overloaded: {len(self._waiting)} requests waiting (max_queue={self._max_queue})",
                    retry_after=1.0,
                )
            self._waiting.push(seq.owner, seq)
            self._cv.notify()
        return seq

    def compile_grammar(self, grammar: Grammar, timeout_s: float | None = None) -> Any:
        """The compiled form of ``grammar``. With ``timeout_s`` (admission, off the event loop) it is compiled in the
        grammar worker process, killed at the deadline (``GrammarTimeout``); without, here (small internal grammars)."""
        compiler, worker = self._grammar_tools()
        try:
            if timeout_s is not None:
                return worker.compile(grammar.kind, grammar.spec, timeout_s)
            return _compile(compiler, grammar)
        except (GrammarInvalid, RuntimeError, ValueError) as exc:
            raise InvalidRequest(f"invalid {grammar.kind} constraint: {exc}", param="response_format") from exc

    def _grammar_tools(self) -> tuple[Any, GrammarWorker]:
        """xgrammar's compiler and the grammar worker, built on the first constrained request (as vLLM's structured-output
        manager builds its backend): importing xgrammar and reading the vocabulary cost a server that never sees a grammar
        about 0.7 s of start-up for nothing."""
        with self._grammar_lock:
            if self._grammar_worker is None:
                import xgrammar as xgr

                info = self.info
                tok_info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=info.vocab_size, stop_token_ids=list(info.eos_token_ids))
                # the compiled-grammar cache is bounded: three 1000-branch anyOf schemas kept about 1 GB unbounded
                self._grammar_compiler = xgr.GrammarCompiler(tok_info, max_threads=1, cache_limit_bytes=self.grammar_cache_bytes)
                self._grammar_worker = GrammarWorker(tok_info, cache_bytes=self.grammar_cache_bytes)  # requests' grammars, killable
            return self._grammar_compiler, self._grammar_worker

    def _matcher(self, grammar: Grammar) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(grammar.compiled if grammar.compiled is not None else self.compile_grammar(grammar))

    # ---- scheduler thread ------------------------------------------------------------------
    def _loop_forever(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stopping and not self._waiting and not self._busy() and not self._commands:
                        self._cv.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                # commands (adapter attach/unload) before admission: an unload must see every row that will run
                for fn, fut in commands:
                    self._run_command(fn, fut)
                with self._cv:
                    admitted: list[_Seq] = []
                    cap = self._waiting.row_cap(self._max_batch) if self._row_share else None
                    while self._waiting and len(self._running) + len(self._prefilling) + len(admitted) < self._max_batch:
                        seq = self._waiting.pop(cap)  # the lowest-counter owner's oldest request, within its row share
                        if seq is None:  # every waiting owner holds its share: the rest wait for their own rows
                            break
                        if seq.cancelled:
                            self._waiting.done(seq.owner)
                            continue
                        self._waiting.charge(seq.owner, prefill=len(seq.req.input_ids))
                        admitted.append(seq)
                decoded: list[_Seq] = []
                try:
                    self._drop_cancelled()
                    for seq in admitted:
                        self._admit(seq)
                    if self._busy():
                        decoded = self._step()
                except Exception as exc:  # the model raised: fail every admitted request, keep serving
                    failed = [*self._running, *self._prefilling, *(s for s in admitted if s not in self._prefilling)]
                    log.exception("engine step failed; failing %d requests", len(failed))
                    for seq in failed:
                        seq.send(EngineError(f"generation failed: {type(exc).__name__}"))
                    self._ended.extend(s for s in failed if s not in self._ended)  # a row released before the failure counts once
                    self._running, self._prefilling = [], []
                    assert self._runner is not None
                    self._runner.reset()
                if decoded or self._ended:
                    with self._cv:  # the step's service and departures, for the next admission
                        for seq in decoded:
                            self._waiting.charge(seq.owner, decode=1)
                        for seq in self._ended:
                            self._waiting.done(seq.owner)
                    self._ended = []
        for seq in [*self._running, *self._prefilling, *self._waiting]:
            seq.send(EngineClosed("engine shut down"))

    def _busy(self) -> bool:
        return bool(self._running or self._prefilling)

    @staticmethod
    def _run_command(fn: Callable[[], None], fut: asyncio.Future[None]) -> None:
        loop = fut.get_loop()
        try:
            fn()
        except Exception as exc:  # handed to the awaiting caller, which turns it into an error response
            loop.call_soon_threadsafe(settle, fut, exc)
            return
        loop.call_soon_threadsafe(settle, fut, None)

    def _admit(self, seq: _Seq) -> None:
        assert self._runner is not None
        seq.t_sched = time.perf_counter()
        self._runner.begin(seq, len(seq.req.input_ids))
        self._prefilling.append(seq)

    def _release(self, seq: _Seq) -> None:
        """``seq`` leaves the batch: its KV is freed, and its owner's running count drops after the step."""
        assert self._runner is not None
        self._runner.release(seq)
        self._ended.append(seq)

    def _drop_cancelled(self) -> None:
        for seqs in (self._running, self._prefilling):
            gone = [s for s in seqs if s.cancelled]
            for seq in gone:
                self._release(seq)
            if gone:
                seqs[:] = [s for s in seqs if not s.cancelled]

    def _step(self) -> list[_Seq]:
        """One forward: a token for every decoding row, and up to ``prefill_chunk`` prompt tokens (oldest prompt first).
        Returns the rows that sampled a token (their owners are charged for it)."""
        assert self._runner is not None
        decode = [DecodeRow(s, s.last_token, s.req.adapter) for s in self._running]
        chunks: list[Chunk] = []
        budget = self._prefill_chunk
        if not self._running and self._prefilling:
            # no row decodes, so no token gap to protect: the oldest prompt goes in pieces of up to IDLE_PREFILL_CHUNKS
            # chunks (SmolLM2 bf16, 2 cores: a 1,990-token prompt's first logits 2.5-2.6 s in one piece, 2.9-3.0 s in four)
            oldest = self._prefilling[0]
            left = len(oldest.req.input_ids) - oldest.prefilled
            budget = max(budget, min(IDLE_PREFILL_CHUNKS * budget, left))
        for seq in self._prefilling:
            if budget <= 0:
                break
            ids = seq.req.input_ids
            n = min(budget, len(ids) - seq.prefilled)
            last = seq.prefilled + n == len(ids)
            chunks.append(Chunk(seq, ids[seq.prefilled : seq.prefilled + n], seq.prefilled, seq.req.adapter, last, seq.prompt_lps is not None))
            budget -= n
        logits = self._runner.step(decode, chunks)
        for c in chunks:
            c.key.prefilled = c.start + len(c.ids)  # type: ignore[attr-defined]
            if c.score:
                self._score(c)
        joined = [c.key for c in chunks if c.last and isinstance(c.key, _Seq)]
        rows = [*self._running, *joined]  # one logits row each, in this order
        sampled = [s for s in rows if s.req.sampling.max_new_tokens > 0]  # max_new_tokens 0: scored, ends without a token
        finished: list[bool] = []
        if sampled:  # else only a part of a long prompt ran, or only scoring prompts finished
            if self._on_step is not None:
                self._on_step(len(sampled))
            if len(sampled) < len(rows):
                logits = logits[[i for i, s in enumerate(rows) if s.req.sampling.max_new_tokens > 0]]
            finished = self._sample_and_emit(sampled, logits)
        for seq in joined:
            if seq.req.sampling.max_new_tokens == 0:
                self._end_after_prefill(seq)
                self._release(seq)
        if joined:
            self._prefilling = [s for s in self._prefilling if s not in joined]
        for seq, done in zip(sampled, finished, strict=True):
            if done:
                self._release(seq)
        self._running = [s for s, done in zip(sampled, finished, strict=True) if not done]
        return sampled

    def _score(self, c: Chunk) -> None:
        """Score a chunk that just ran: each of its positions at the prompt token after it (the prompt's final position has none)."""
        seq = c.key
        assert isinstance(seq, _Seq) and seq.prompt_lps is not None and self._runner is not None
        ids = seq.req.input_ids
        count = min(len(c.ids), len(ids) - 1 - c.start)
        if count <= 0:
            return
        k = seq.req.sampling.prompt_logprobs or 0
        scores = score_prompt(self._runner.scored[seq], count, ids[c.start + 1 : c.start + 1 + count], k)
        if any(math.isnan(s.logprob) for s in scores):
            seq.nonfinite = True
        seq.prompt_lps.extend(scores)

    def _prompt_scores(self, seq: _Seq) -> tuple[TokenLogprob, ...] | None:
        """The prompt scores to send with the request's first chunk (then dropped from the sequence)."""
        lps, seq.prompt_lps = seq.prompt_lps, None
        return tuple(lps) if lps is not None else None

    def _end_after_prefill(self, seq: _Seq) -> None:
        """A scoring-only request (``max_new_tokens`` 0) ends once its prompt ran: its scores, no token, finish ``length``."""
        seq.done = True
        if seq.nonfinite:
            seq.send(NonFiniteOutput("scoring failed: the model produced non-finite logits for this prompt"))
            return
        now = time.perf_counter()
        timings = Timings(seq.t_sched - seq.t_submit, now - seq.t_submit, now - seq.t_submit)
        seq.send(StreamChunk((), "", (), "length", None, timings, self._prompt_scores(seq)))

    def _sample_and_emit(self, seqs: list[_Seq], logits: torch.Tensor) -> list[bool]:
        """Sample one token for each of ``seqs`` from ``logits`` (B, V); emit; return which finished."""
        logits = logits.float()
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            import xgrammar as xgr  # loaded already: every constrained row's matcher was built with it

            bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[-1])
            for i in constrained:
                matcher = seqs[i].matcher
                assert matcher is not None
                matcher.fill_next_token_bitmask(bitmask, i)
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=constrained)
        sampled = sample_next(logits, [s.row for s in seqs], self._argmax_lse)
        now = time.perf_counter()
        finished = []
        for i, seq in enumerate(seqs):
            if sampled.failed[i] or seq.nonfinite:  # this row's logits (or its prompt's) were NaN: fail its request only, the batch goes on
                seq.done = True
                seq.send(NonFiniteOutput("generation failed: the model produced non-finite logits for this request"))
                finished.append(True)
                continue
            tok = sampled.token_ids[i]
            if seq.row.penalties is not None:
                seq.row.penalties.seen(tok)
            seq.generated += 1
            seq.last_token = tok
            if seq.generated == 1:
                seq.t_first = now
            self.tokens_generated += 1
            finish: str | None = None
            matched: int | str | None = None
            if seq.matcher is not None and not seq.matcher.accept_token(tok):
                finish = "stop"  # cannot happen under a correct mask; stop rather than emit garbage
            text = "" if tok in seq.stop_ids else seq.text.push(tok)
            if tok in seq.stop_ids:
                finish, matched = "stop", tok
            elif seq.text.stopped is not None:
                finish, matched = "stop", seq.text.stopped
            elif seq.matcher is not None and seq.matcher.is_terminated():
                finish = "stop"
            elif seq.generated >= seq.req.sampling.max_new_tokens:
                finish = "length"
            elif len(seq.req.input_ids) + seq.generated >= self.info.max_model_len:
                finish = "length"
            lp: tuple[TokenLogprob, ...] = ()
            if seq.row.top_logprobs or seq.req.sampling.logprobs:
                lp = (TokenLogprob(tok, sampled.logprobs[i], tuple(sampled.top[i])),)
            prompt = self._prompt_scores(seq) if seq.generated == 1 else None
            if finish is not None:
                text += seq.text.flush()
                seq.done = True
                timings = Timings(seq.t_sched - seq.t_submit, seq.t_first - seq.t_submit, now - seq.t_submit)
                seq.send(StreamChunk((tok,), text, lp, finish, matched, timings, prompt))  # type: ignore[arg-type]
            else:
                seq.send(StreamChunk((tok,), text, lp, prompt_logprobs=prompt))
            finished.append(finish is not None)
        return finished


def _penalties(sp: SamplingParams) -> Penalties | None:
    """A row's penalties and bias, None when it has none (a row without pays nothing in the sampler)."""
    if not sp.penalized:
        return None
    return Penalties(presence=sp.presence_penalty, frequency=sp.frequency_penalty, bias=tuple((t, b) for t, b in sp.logit_bias if b))


def _compile(compiler: Any, grammar: Grammar) -> Any:
    """Compile a constraint here; xgrammar's compiler caches compiled grammars itself (bounded)."""
    return compile_grammar(compiler, grammar.kind, grammar.spec)


ONEDNN_CACHE_ENTRIES = "64"


def bound_onednn_caches() -> None:
    """Cap oneDNN's primitive cache and ideep's linear cache at ``ONEDNN_CACHE_ENTRIES`` entries each (unless set already).

    Both keep one entry per distinct input shape, and every step of this engine has its own token count (decode rows
    plus a prefill chunk of any length), so under varied traffic they fill towards their default 1,024 entries at about
    0.38 MB an entry: that was the server's steady RSS climb in ``bench/soak.py`` (malloc's in-use bytes, in the engine
    thread's arena; 300 token counts x 4 SmolLM2 linear shapes held +460 MB, +29 MB with both caps at 64). A hit saves
    nothing measurable here (16 x 16-token requests on SmolLM2: 1.76 s a batch with the caps at 1,024, 64 or 16).
    oneDNN reads its capacity when it creates its first primitive and ideep at its first linear, so this must run before
    the model's weights are packed; an operator's own values win."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
    os.environ.setdefault("LRU_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))
