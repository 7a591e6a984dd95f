"""A scripted engine (the fake sits at the engine edge only) and a real runtime client around it.

``ScriptedEngine`` answers each call with the next scripted reply: its text tokenized with the real
tiny tokenizer plus the eos token, with top-2 logprobs whose entropy the script sets (for T²PO
tests). Everything above it is real: ``ChatFormatter``, ``LocalRuntimeClient``, the adapter registry,
the recorder and a SQLite store in a temporary folder.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learner.records.store import SqliteStore
from runtime.adapters.registry import AdapterRegistry
from runtime.agent_api import LocalRuntimeClient
from runtime.chat_format import ChatFormatter
from runtime.engine import EngineInfo, GenerateRequest, GenerateResult, StreamChunk, Timings, TokenLogprob
from runtime.recorder import Recorder


@dataclass
class Reply:
    text: str
    p: float = 0.9  # probability of the chosen token in a two-token distribution (entropy H(p))
    eos: bool = True


class ScriptedEngine:
    def __init__(self, tokenizer: Any, script: list[Reply | str] | Callable[[GenerateRequest], Reply | str], max_model_len: int = 4096) -> None:
        self.tok = tokenizer
        self.script = script
        self.calls: list[GenerateRequest] = []
        self.info = EngineInfo(
            backend="scripted", model="tiny", max_model_len=max_model_len, vocab_size=len(tokenizer), eos_token_ids=(tokenizer.eos_token_id,)
        )
        self.closed_streams = 0

    def _next(self, req: GenerateRequest) -> Reply:
        self.calls.append(req)
        item = self.script(req) if callable(self.script) else self.script[len(self.calls) - 1]
        return Reply(item) if isinstance(item, str) else item

    def _tokens(self, reply: Reply, req: GenerateRequest) -> list[int]:
        ids = self.tok.encode(reply.text, add_special_tokens=False)
        if reply.eos:
            ids.append(self.tok.eos_token_id)
        return ids[: req.sampling.max_new_tokens]

    def _lp(self, tid: int, p: float) -> TokenLogprob:
        other = (tid + 1) % len(self.tok)
        return TokenLogprob(tid, math.log(p), ((tid, math.log(p)), (other, math.log(1 - p))))

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        reply = self._next(req)
        ids = self._tokens(reply, req)
        finish = "stop" if ids and ids[-1] == self.tok.eos_token_id else "length"
        return GenerateResult(
            request_id=req.request_id,
            prompt_ids=req.input_ids,
            output_ids=tuple(ids),
            text=self.tok.decode([i for i in ids if i != self.tok.eos_token_id]),
            finish_reason=finish,
            logprobs=tuple(self._lp(i, reply.p) for i in ids),
            matched_stop=self.tok.eos_token_id if finish == "stop" else None,
        )

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        reply = self._next(req)
        ids = self._tokens(reply, req)
        try:
            for k, tid in enumerate(ids):
                last = k == len(ids) - 1
                text = "" if tid == self.tok.eos_token_id else self.tok.decode([tid])
                finish = ("stop" if tid == self.tok.eos_token_id else "length") if last else None
                matched = self.tok.eos_token_id if finish == "stop" else None
                yield StreamChunk((tid,), text, (self._lp(tid, reply.p),), finish, matched, timings=Timings() if last else None)
        finally:
            self.closed_streams += 1

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def health(self) -> None: ...
    async def load_adapter(self, name: str, path: str) -> None: ...
    async def unload_adapter(self, name: str) -> None: ...

    def stats(self) -> dict[str, float]:
        return {}


def make_client(tokenizer: Any, engine: ScriptedEngine, data_dir: Path) -> tuple[LocalRuntimeClient, Recorder, SqliteStore]:
    store = SqliteStore(data_dir / "interactions.db")
    recorder = Recorder(store, durability="sync", commit_window_s=0.001)
    recorder.start()
    registry = AdapterRegistry(max_loaded=4, load_fn=lambda ref: engine.load_adapter(ref.name, ref.path), unload_fn=engine.unload_adapter)
    client = LocalRuntimeClient(engine, ChatFormatter(tokenizer), registry, recorder, "tiny")  # type: ignore[arg-type]
    return client, recorder, store
