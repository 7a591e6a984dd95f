"""Embeddings for engines that serve none: the base model's hidden states from a local CPU copy of its weights.

When the external backends (vLLM, SGLang) serve a generative model, their servers have no pooling endpoint for it (when
they serve a pooling model, the route takes the engine's own embeddings instead: ``runtime/api/embeddings.py``); so
that ``POST /v1/embeddings`` answers on every backend, :class:`LocalEmbedder` loads the same base model folder the runtime
already holds for its tokenizer (``transformers.AutoModel``: the decoder with its final norm, no LM head) on the first
request, and computes exactly what the embedded engine's ``embed`` does: the final hidden state, mean-pooled over the
input's tokens or the last token's. bf16 where the CPU has native bf16 (as ``--dtype auto``), else fp32; one forward
pass at a time on a worker thread, never on the event loop. A model folder whose weights exceed ``max_bytes`` is not
loaded (a 501 that says so): an external engine usually serves a model too large for the runtime host's CPU.

Not here: the HTTP route and its limits (``runtime/api/embeddings.py``), the embedded engine's own ``embed``.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, Literal

from runtime.engine import EngineInfo, NotSupported

MAX_BYTES = 4 << 30  # weights above 4 GiB are not loaded onto the runtime host's CPU for embeddings


class LocalEmbedder:
    """``runtime.engine.Embedder`` over a local copy of the base model; ``info`` is the serving engine's."""

    def __init__(self, model_path: Path, engine: Any, *, max_bytes: int = MAX_BYTES) -> None:
        self.model_path = Path(model_path)
        self._engine = engine
        self._max_bytes = max_bytes
        self._model: Any = None
        self._lock = threading.Lock()  # one load, one forward pass at a time

    @property
    def info(self) -> EngineInfo:
        info: EngineInfo = self._engine.info
        return info

    def _weights_bytes(self) -> int:
        return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin") for p in self.model_path.glob(pattern))

    def _load(self) -> Any:
        if self._model is None:
            size = self._weights_bytes()
            if size > self._max_bytes:
                raise NotSupported(
                    f"embeddings on the {self.info.backend} backend come from a local CPU copy of the base model, and its "
                    f"weights ({size / 2**30:.1f} GiB) exceed the {self._max_bytes / 2**30:.0f} GiB bound; serve a pooling model instead"
                )
            import torch
            from transformers import AutoModel

            from runtime.engines.embedded import pick_dtype

            model = AutoModel.from_pretrained(str(self.model_path), dtype=pick_dtype("auto"))
            model.eval()
            torch.set_grad_enabled(False)
            self._model = model
        return self._model

    def _embed(self, inputs: list[tuple[int, ...]], pooling: str) -> list[list[float]]:
        import torch

        with self._lock:
            model = self._load()
            out: list[list[float]] = []
            with torch.inference_mode():
                for ids in inputs:
                    h = model(input_ids=torch.tensor([ids], dtype=torch.long)).last_hidden_state[0].float()  # (T, H), after the final norm
                    out.append((h.mean(0) if pooling == "mean" else h[-1]).tolist())
            return out

    async def embed(self, inputs: list[tuple[int, ...]], pooling: Literal["mean", "last"]) -> list[list[float]]:
        """One vector per input, computed on a worker thread (the first call loads the model)."""
        return await asyncio.to_thread(self._embed, inputs, pooling)
