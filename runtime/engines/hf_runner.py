"""The general runner: any transformers causal LM through its own forward, over ``kv_batch.BatchKV``.

Used for models ``llama_runner.fits`` refuses (and in tests as the reference the lean runner is
checked against). Each prompt chunk runs as its own forward on the prompt's own ``BatchKV``; the
decode rows run as one batch on the running ``BatchKV`` (right-aligned, see ``kv_batch``), which a
prompt joins after its last chunk (``merge``). Every fp32/bf16 linear is oneDNN-packed
(``cpu_linear.pack_linears``); LoRA sites sit in front of the packed forwards.

Not here: mixing prompt chunks into the decode forward (``llama_runner`` does).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from runtime.engines.cpu_linear import pack_linears
from runtime.engines.kv_batch import BatchKV
from runtime.engines.lora_batch import LoraBank
from runtime.engines.runner import Chunk, DecodeRow, LogitsOf

log = logging.getLogger(__name__)


class HFRunner:
    name = "transformers"

    def __init__(self, model: Any, bank: LoraBank) -> None:
        self.model = model
        self.bank = bank
        self.vocab = int(model.config.vocab_size)
        self._layers = int(model.config.num_hidden_layers)
        self._kv: BatchKV | None = None
        self._keys: list[Hashable] = []  # the running batch's rows, in BatchKV order
        self._staging: dict[Hashable, BatchKV] = {}
        self.scored: dict[Hashable, LogitsOf] = {}

    @staticmethod
    def prepare(model: Any) -> None:
        """Before the ``LoraBank`` is built: pack the linears (LoRA sites then sit in front of the packed forwards)."""
        log.info("packed %d linear layers for oneDNN", pack_linears(model))

    def reset(self) -> None:
        """Forget every sequence (after a failed step left the cache in an unknown state)."""
        self._kv, self._keys, self._staging = None, [], {}
        self.scored = {}

    def begin(self, key: Hashable, prompt_len: int) -> None:
        self._staging[key] = BatchKV(self._layers)

    def release(self, key: Hashable) -> None:
        if self._staging.pop(key, None) is not None:
            return
        if key in self._keys:
            keep = [i for i, k in enumerate(self._keys) if k != key]
            self._keys = [self._keys[i] for i in keep]
            assert self._kv is not None
            self._kv.keep(keep)

    def step(self, decode: Sequence[DecodeRow], chunks: Sequence[Chunk]) -> torch.Tensor:
        self.scored = {}
        rows: list[torch.Tensor] = []
        if decode:
            rows.append(self._decode(decode))
        for c in chunks:
            logits = self._prefill(c)
            if c.last:
                rows.append(logits)
        return torch.cat(rows) if rows else torch.empty(0, self.vocab)

    def _decode(self, decode: Sequence[DecodeRow]) -> torch.Tensor:
        kv = self._kv
        assert kv is not None and kv.rows == len(self._keys) == len(decode)
        by_key = {r.key: r for r in decode}
        order = [by_key[k] for k in self._keys]
        ids = torch.tensor([[r.token] for r in order], dtype=torch.long)  # (B, 1)
        ones = torch.ones_like(ids)
        with self.bank.rows([r.adapter for r in order]):
            out = self.model(
                input_ids=ids,
                attention_mask=torch.cat([kv.mask, ones], dim=1),  # (B, length + 1)
                position_ids=kv.positions[:, None],
                cache=kv.as_cache(),
                use_cache=True,
            )
        kv.advance(1, ones)
        where = {k: i for i, k in enumerate(self._keys)}
        logits: torch.Tensor = out.logits[:, -1, :][torch.tensor([where[r.key] for r in decode])]
        return logits

    def _prefill(self, c: Chunk) -> torch.Tensor:
        kv = self._staging[c.key]
        ids = torch.tensor([list(c.ids)], dtype=torch.long)  # (1, n)
        n = ids.shape[1]
        with self.bank.rows([c.adapter], tokens=n):
            out = self.model(
                input_ids=ids,
                attention_mask=torch.ones(1, c.start + n, dtype=torch.long),
                position_ids=torch.arange(c.start, c.start + n)[None, :],
                cache=kv.as_cache(),
                use_cache=True,
                logits_to_keep=0 if c.score else 1,  # 0: every position (prompt logprobs)
            )
        kv.advance(n, torch.ones_like(ids))
        if c.score:
            self.scored[c.key] = _rows_of(out.logits[0])
        if c.last:
            del self._staging[c.key]
            if self._kv is None or self._kv.rows == 0:
                self._kv = kv
            else:
                self._kv.merge(kv)
            self._keys.append(c.key)
        last: torch.Tensor = out.logits[:, -1, :]
        return last


def _rows_of(logits: torch.Tensor) -> LogitsOf:
    """A scored chunk's logits ``(n, vocab)`` as the runner protocol hands them out: by position range."""

    def rows(lo: int, hi: int) -> torch.Tensor:
        return logits[lo:hi]

    return rows
