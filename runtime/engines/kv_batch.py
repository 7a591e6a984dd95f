"""The running batch's KV cache: preallocated, right-aligned rows that can join and leave between steps.

Every row ends at the same column ``length``; shorter rows are left-padded with zeros and masked out
in ``mask``. A decode step writes one column in place (no ``torch.cat`` of the whole cache per step,
which is what ``DynamicCache`` does). Rows join after their own prefill (``merge``) and leave when
they finish (``keep``); both copy the cache once, which is cheap next to a forward pass.

``as_cache()`` wraps the buffers in a transformers ``DynamicCache`` whose layers write into them, so
any decoder-only model in transformers runs on it unchanged.

Not here: paging or prefix sharing between requests (a later optimisation), sliding-window layers.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class _BufferLayer(DynamicLayer):
    def __init__(self, store: BatchKV, idx: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._store = store
        self._idx = idx
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        return self._store.write(self._idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._store.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._store.length + query_length, 0


class BatchKV:
    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.k: list[torch.Tensor] = []  # per layer (B, H, cap, D)
        self.v: list[torch.Tensor] = []
        self.length = 0  # columns in use
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # (B, length): 1 where a real token sits
        self.positions = torch.zeros(0, dtype=torch.long)  # (B,): next position id of each row

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[2]) if self.k else 0

    def as_cache(self) -> DynamicCache:
        cache = DynamicCache()
        cache.layers = [_BufferLayer(self, i) for i in range(self.n_layers)]
        return cache

    def write(self, idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by each layer during a forward: store ``n`` new columns after ``length``."""
        n = k.shape[2]
        if not self.k or len(self.k) <= idx:
            self._allocate_like(k, rows=k.shape[0], cap=max(64, n))
        self._ensure_capacity(self.length + n)
        end = self.length + n
        self.k[idx][:, :, self.length : end] = k
        self.v[idx][:, :, self.length : end] = v
        return self.k[idx][:, :, :end], self.v[idx][:, :, :end]

    def advance(self, n: int, new_mask: torch.Tensor) -> None:
        """After a forward over ``n`` new columns: commit them. ``new_mask``: (B, n)."""
        self.length += n
        if self.mask.numel() == 0:
            self.mask = new_mask
            self.positions = new_mask.sum(dim=1)
        else:
            self.mask = torch.cat([self.mask, new_mask], dim=1)
            self.positions = self.positions + new_mask.sum(dim=1)

    def merge(self, other: BatchKV) -> None:
        """Append ``other``'s rows (a freshly prefilled batch) to this one."""
        if self.rows == 0:
            self.k, self.v, self.length = other.k, other.v, other.length
            self.mask, self.positions = other.mask, other.positions
            return
        length = max(self.length, other.length)
        rows = self.rows + other.rows
        cap = max(self.capacity, length + 64)
        k_new, v_new = [], []
        for i in range(self.n_layers):
            ref = self.k[i]
            kb = ref.new_zeros(rows, ref.shape[1], cap, ref.shape[3])
            vb = ref.new_zeros(rows, ref.shape[1], cap, ref.shape[3])
            kb[: self.rows, :, length - self.length : length] = self.k[i][:, :, : self.length]
            vb[: self.rows, :, length - self.length : length] = self.v[i][:, :, : self.length]
            kb[self.rows :, :, length - other.length : length] = other.k[i][:, :, : other.length]
            vb[self.rows :, :, length - other.length : length] = other.v[i][:, :, : other.length]
            k_new.append(kb)
            v_new.append(vb)
        mask = torch.zeros(rows, length, dtype=torch.long)
        mask[: self.rows, length - self.length :] = self.mask
        mask[self.rows :, length - other.length :] = other.mask
        self.k, self.v, self.length, self.mask = k_new, v_new, length, mask
        self.positions = torch.cat([self.positions, other.positions])

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in ``rows`` (in this order), then trim all-padding columns on the left."""
        if not rows:
            self.k, self.v, self.length = [], [], 0
            self.mask = torch.zeros(0, 0, dtype=torch.long)
            self.positions = torch.zeros(0, dtype=torch.long)
            return
        idx = torch.tensor(rows, dtype=torch.long)
        self.mask = self.mask[idx]
        self.positions = self.positions[idx]
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else self.length
        self.k = [t[idx, :, start:] for t in self.k]
        self.v = [t[idx, :, start:] for t in self.v]
        self.mask = self.mask[:, start:]
        self.length -= start

    def _allocate_like(self, ref: torch.Tensor, rows: int, cap: int) -> None:
        shape = (rows, ref.shape[1], cap, ref.shape[3])
        self.k = [ref.new_zeros(shape) for _ in range(self.n_layers)]
        self.v = [ref.new_zeros(shape) for _ in range(self.n_layers)]

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = max(needed, 2 * self.capacity)
        for lst in (self.k, self.v):
            for i, t in enumerate(lst):
                grown = t.new_zeros(t.shape[0], t.shape[1], cap, t.shape[3])
                grown[:, :, : self.length] = t[:, :, : self.length]
                lst[i] = grown
