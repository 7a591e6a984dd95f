"""The fast runner's KV cache: decode rows in length-bucketed pools, prompts in per-request staging.

A pool holds rows of at most ``cap`` tokens, per layer one K and one V buffer of shape
``(rows, kv_heads, cap, head_dim)``; row ``r``'s token ``t`` sits at column ``t`` and every column at
or beyond the row's length holds zeros. A decode step attends each pool's rows ``[0, n)`` over all
``cap`` columns at once (one batched GEMM per pool and layer, masked by length): the slice
``k[:n]`` is contiguous, which oneDNN's batched bf16 GEMM needs to be fast (a column slice
``k[:n, :, :L]`` is 10-15× slower, measured on SmolLM2's shapes). Pool caps double (64, 128, 256, ...
up to ``max_len``), so a row's attention reads less than 2× its length past the first cap and one long
request does not make every short row read its columns. Reading the cache is most of a large batch's step
(SmolLM2 bf16, 64 rows at ~100 tokens: the attention GEMMs were 38 % of the step with caps growing 4× from 256),
so the caps are fine-grained: doubling from 64 made that step 25 % faster than 4× from 256 (36 % at ~400 tokens,
equal at ~200, ``bench/decode_profile.py``). A row that fills its pool moves to the next (one copy of its KV;
log2 of its length times at most).

Rows stay compact: a finished row is replaced by the pool's last row (one copy of that row) and
the freed columns are zeroed, so a later row never attends to stale values (zeros are finite
even under a mask, unlike a NaN a bad forward may have left).

A prompt is prefilled (in chunks) into its own ``Staging`` buffer of exactly its length, then
``join`` copies it into the smallest pool that fits with room to decode; joining costs one copy of
the prompt's KV, never a copy of the batch.

Not here: paging, prefix sharing between requests, sliding-window attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_GROW_ROWS = 8  # rows a pool allocates at first; it doubles when full


@dataclass
class Staging:
    """A prompt's KV while it is prefilled: per layer (kv_heads, length, head_dim)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    filled: int = 0  # tokens written so far


@dataclass(eq=False)
class Pool:
    cap: int
    k: list[torch.Tensor] = field(default_factory=list)  # per layer (rows_alloc, kv_heads, cap, head_dim)
    v: list[torch.Tensor] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # per row in use: tokens stored
    owners: list[object] = field(default_factory=list)  # per row in use: the key the runner gave it

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def allocated(self) -> int:
        return int(self.k[0].shape[0]) if self.k else 0


class KVPools:
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, max_len: int, first_cap: int = 64, growth: int = 2) -> None:
        self.n_layers, self.kv_heads, self.head_dim, self.dtype = n_layers, kv_heads, head_dim, dtype
        caps = []
        cap = first_cap
        while cap < max_len:
            caps.append(cap)
            cap *= growth
        caps.append(max_len)
        self.pools = [Pool(c) for c in caps]
        self.where: dict[object, tuple[Pool, int]] = {}  # owner → (pool, row)

    # ---- prompts --------------------------------------------------------------------------
    def staging(self, length: int) -> Staging:
        shape = (self.kv_heads, length, self.head_dim)
        return Staging(
            [torch.zeros(shape, dtype=self.dtype) for _ in range(self.n_layers)], [torch.zeros(shape, dtype=self.dtype) for _ in range(self.n_layers)]
        )

    def join(self, owner: object, st: Staging) -> None:
        """Move a fully prefilled prompt into the smallest pool with room for at least one more token."""
        pool = self._pool_for(st.filled + 1)
        row = self._add_row(pool, owner, st.filled)
        n = st.filled
        for i in range(self.n_layers):
            pool.k[i][row, :, :n] = st.k[i][:, :n]
            pool.v[i][row, :, :n] = st.v[i][:, :n]

    # ---- decode rows ------------------------------------------------------------------------
    def make_room(self, owner: object) -> None:
        """Before a decode step: a row whose pool is full moves to the next pool."""
        pool, row = self.where[owner]
        n = pool.lengths[row]
        if n < pool.cap:
            return
        bigger = self._pool_for(n + 1)
        new_row = self._add_row(bigger, owner, n)
        for i in range(self.n_layers):
            bigger.k[i][new_row, :, :n] = pool.k[i][row, :, :n]
            bigger.v[i][new_row, :, :n] = pool.v[i][row, :, :n]
        self._remove_row(pool, row)

    def release(self, owner: object) -> None:
        pool, row = self.where.pop(owner)
        self._remove_row(pool, row, forget=False)

    def length(self, owner: object) -> int:
        pool, row = self.where[owner]
        return pool.lengths[row]

    def active(self) -> list[Pool]:
        return [p for p in self.pools if p.rows]

    def advance(self, pool: Pool) -> None:
        """After a decode step wrote one column for each of ``pool``'s rows."""
        pool.lengths = [n + 1 for n in pool.lengths]

    # ---- internals --------------------------------------------------------------------------
    def _pool_for(self, length: int) -> Pool:
        for pool in self.pools:
            if length <= pool.cap:
                return pool
        raise ValueError(f"{length} tokens exceed the cache's max_len {self.pools[-1].cap}")

    def _add_row(self, pool: Pool, owner: object, length: int) -> int:
        if pool.rows == pool.allocated:
            self._grow(pool, max(_GROW_ROWS, 2 * pool.allocated))
        row = pool.rows
        pool.lengths.append(length)
        pool.owners.append(owner)
        self.where[owner] = (pool, row)
        return row

    def _remove_row(self, pool: Pool, row: int, forget: bool = True) -> None:
        """Drop ``row``: the last row takes its place; the freed columns are zeroed."""
        last = pool.rows - 1
        n_last, n_row = pool.lengths[last], pool.lengths[row]
        for bufs in (pool.k, pool.v):
            for buf in bufs:
                if row != last:
                    buf[row, :, :n_last] = buf[last, :, :n_last]
                    if n_row > n_last:
                        buf[row, :, n_last:n_row] = 0
                    buf[last, :, :n_last] = 0
                else:
                    buf[row, :, :n_row] = 0
        owner = pool.owners[row]
        if row != last:
            pool.lengths[row], pool.owners[row] = n_last, pool.owners[last]
            self.where[pool.owners[row]] = (pool, row)
        pool.lengths.pop()
        pool.owners.pop()
        if forget and self.where.get(owner, (None,))[0] is pool:
            del self.where[owner]

    def _grow(self, pool: Pool, rows: int) -> None:
        shape = (rows, self.kv_heads, pool.cap, self.head_dim)
        old = pool.allocated
        for bufs in (pool.k, pool.v):
            if not bufs:
                bufs.extend(torch.zeros(shape, dtype=self.dtype) for _ in range(self.n_layers))
                continue
            for i, buf in enumerate(bufs):
                grown = torch.zeros(shape, dtype=self.dtype)
                grown[:old] = buf
                bufs[i] = grown
