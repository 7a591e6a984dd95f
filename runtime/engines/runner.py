"""What the embedded engine's scheduler asks of a model runner: one forward over decode rows and prompt chunks.

The scheduler owns requests, sampling and the order of work; a runner owns the model's weights and
the KV cache. Each step the scheduler hands the runner

- the decode rows: every sequence that has finished its prompt, with its last sampled token, and
- zero or more prompt chunks: consecutive prompt tokens of sequences still being prefilled
  (``begin`` was called for each first), the last chunk of a prompt marked ``last``,

and gets back logits: one row per decode row (in the order given), then one per ``last`` chunk (the
prompt's final position). A sequence whose last chunk ran decodes from the next step on. ``release``
forgets a sequence (finished, cancelled, or failed) wherever it is.

A chunk marked ``score`` (the request wants prompt logprobs) also has the logits of every one of its
positions: after the step, ``scored[key]`` computes them for a range of the chunk's positions on demand,
so the caller can bound the memory (the lean runner computes them from the chunk's hidden states per
range; a chunk's positions times the vocabulary at once would be 512 × 152k floats on Qwen; the
transformers forward returns them all). ``scored`` holds the last step's chunks only.

Two runners: ``llama_runner.LlamaRunner`` (a lean forward for Llama-family decoders, chosen when the
model fits) and ``hf_runner.HFRunner`` (any transformers causal LM, through its own forward).

Not here: sampling, grammars, text (the scheduler's), adapters' weights (``lora_batch``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DecodeRow:
    key: Hashable
    token: int  # the token sampled last step, fed now
    adapter: str | None


@dataclass(frozen=True)
class Chunk:
    key: Hashable
    ids: Sequence[int]  # prompt tokens start .. start + len(ids)
    start: int
    adapter: str | None
    last: bool  # the prompt's final chunk: its last position's logits are returned
    score: bool = False  # the logits of all its positions are wanted too (``Runner.scored``)


LogitsOf = Callable[[int, int], torch.Tensor]
"""``(lo, hi)`` → the logits ``(hi - lo, vocab)`` of a scored chunk's positions ``start + lo .. start + hi``."""


class Runner(Protocol):
    name: str
    scored: dict[Hashable, LogitsOf]  # after a step: each ``score`` chunk's logits, by position range

    def begin(self, key: Hashable, prompt_len: int) -> None:
        """Make room for a prompt of ``prompt_len`` tokens, to be fed in chunks."""
        ...

    def step(self, decode: Sequence[DecodeRow], chunks: Sequence[Chunk]) -> torch.Tensor:
        """One forward. Returns logits (len(decode) + #last chunks, vocab), decode rows first, in the given order."""
        ...

    def release(self, key: Hashable) -> None: ...

    def reset(self) -> None:
        """Forget every sequence (after a step raised)."""
        ...
