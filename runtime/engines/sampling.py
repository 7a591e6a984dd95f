"""Batched next-token sampling with per-row temperature, top-p, seed, penalties, logit bias, grammar mask and logprobs.

Pure functions over tensors; the scheduler owns the per-request state (generators, grammar matchers,
the :class:`Penalties` with the counts of each row's generated tokens, which it tells of every token).
Logprobs follow the convention in ``runtime/engine.py``: ``log_softmax(logits' / T)`` (undivided for
greedy rows) after the grammar mask, before top-p, where ``logits'`` are the logits after the row's
penalties and bias: the distribution the token was sampled from (vLLM's ``processed_logprobs``, not its
default ``raw_logprobs``). So a penalized row's logprobs are not the model's ``logits / T``: its turn is
recorded with its penalties and the learner leaves it out (``learner/samples.py``, ``sampling_penalties``).

Penalties (OpenAI's definitions, as vLLM applies them): per row, ``logits[j] += bias[j] - frequency *
count[j] - presence * (count[j] > 0)``, where ``count[j]`` is how often token ``j`` appears in the row's
*output* so far (never the prompt). All penalized rows of a batch are adjusted in one batched step; a
batch without any pays nothing (the logits tensor is passed on untouched).

One row can fail only itself: a temperature below :data:`MIN_TEMPERATURE` is greedy (``logits / 1e-50``
is ``inf`` in float32), and a row whose distribution is not a distribution (NaN logits, e.g. from a
broken adapter, or nothing allowed) is reported in ``SampleOutput.failed`` instead of raising for the
whole batch. Top logprobs list only tokens with a finite logprob (a grammar's masked tokens are left out).

Not here: the multiplicative ``repetition_penalty``, ``top_k``, ``min_p`` (the OpenAI surface has none of them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from runtime.engine import MIN_TEMPERATURE  # below it a row is sampled greedily (float32 division by a smaller T overflows)

ArgmaxLse = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (B, V) fp32 -> each row's first argmax, log-sum-exp

__all__ = ["MIN_TEMPERATURE", "ArgmaxLse", "Penalties", "RowSampling", "SampleOutput", "penalize", "sample_next"]


@dataclass
class Penalties:
    """One row's presence/frequency penalties and logit bias, and the counts of the tokens it generated (``seen``)."""

    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); ids already checked against the vocabulary
    _pending: list[int] = field(default_factory=list, init=False, repr=False)  # generated tokens not yet in ``_counts``
    _counts: torch.Tensor | None = field(default=None, init=False, repr=False)  # (V,) generated-token counts; made at the first step

    def seen(self, token: int) -> None:
        """The row generated ``token`` (the scheduler calls this once per sampled token)."""
        self._pending.append(token)

    def counts(self, vocab: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``(V,)`` counts of every generated token so far (updated with one ``index_add_`` per step)."""
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=dtype, device=device)
        if self._pending:
            ids = torch.tensor(self._pending, device=device)
            self._counts.index_add_(0, ids, torch.ones(len(self._pending), dtype=dtype, device=device))
            self._pending.clear()
        return self._counts


@dataclass
class RowSampling:
    temperature: float
    top_p: float
    generator: torch.Generator | None  # None: the global RNG (no seed given)
    top_logprobs: int
    penalties: Penalties | None = None  # None: no penalty and no bias (the row pays nothing)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per row, best first; empty where top_logprobs == 0
    failed: list[bool]  # per row: its logits held no valid distribution (NaN, or every token masked); token_ids[i] is meaningless


def sample_next(logits: torch.Tensor, rows: list[RowSampling], argmax_lse: ArgmaxLse | None = None) -> SampleOutput:
    """Sample one token per row. ``logits``: (B, V) float32, already grammar-masked (-inf).

    The log-softmax is never materialised: a row's logprob of token ``j`` is ``scaled[j] - logsumexp(scaled)``, so a
    greedy batch reads the (B, V) logits a few times and writes nothing of that size (only sampled rows write their
    probabilities, and only a row with T != 1 needs the division). In a 64-row decode step on SmolLM2's 49k vocabulary
    the division, the log-softmax and its max had each been a full pass over 12 MB. ``argmax_lse`` (the compiled
    kernel of ``runtime/engines/cpu_kernels.py``, where built) gives every row's first argmax and log-sum-exp in one
    call: 0.6 vs 5.4 ms for 64 rows there (PyTorch's argmax and logsumexp are a pass each and not vectorised alike)."""
    batch = logits.shape[0]
    logits = penalize(logits, rows)
    greedy = [r.temperature < MIN_TEMPERATURE for r in rows]
    temps = [1.0 if g else r.temperature for r, g in zip(rows, greedy, strict=True)]
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, dtype=logits.dtype)[:, None]  # (B, V)
    first: torch.Tensor | None = None  # (B,): each row's first argmax, where the kernel gave it
    if argmax_lse is not None and scaled.dtype == torch.float32 and scaled.stride(-1) == 1:
        first, lse = argmax_lse(scaled)
    else:
        lse = torch.logsumexp(scaled, dim=-1)  # (B,)
    # a valid row has no NaN, no +inf and at least one finite logit (all -inf: the mask allowed nothing): a finite lse
    bad = ~torch.isfinite(lse)
    failed = bad.tolist()
    if any(failed):  # any finite stand-in: the row's result is discarded (the other rows' argmax stands)
        scaled = scaled.masked_fill(bad[:, None], 0.0)
        lse = torch.logsumexp(scaled, dim=-1)

    chosen = torch.empty(batch, dtype=torch.long)
    if any(greedy):
        chosen[:] = first if first is not None else torch.argmax(scaled, dim=-1)
    sampled_rows = [i for i, g in enumerate(greedy) if not g and not failed[i]]
    if sampled_rows:
        every = len(sampled_rows) == batch  # then no (S, V) copy of the rows
        idx = torch.tensor(sampled_rows)
        probs = torch.softmax(scaled if every else scaled[idx], dim=-1)  # (S, V): exp(scaled - lse), in one pass
        probs = _top_p_probs(probs, torch.tensor([rows[i].top_p for i in sampled_rows]))
        picked = _inverse_cdf(probs, [rows[i].generator for i in sampled_rows])
        if every:
            chosen = picked
        else:
            chosen[idx] = picked
    for i in range(batch):
        if failed[i]:
            chosen[i] = 0

    chosen_lp = scaled.gather(1, chosen[:, None])[:, 0] - lse  # (B,)
    k = max(r.top_logprobs for r in rows)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if k > 0:
        vals, ids = torch.topk(scaled, min(k, scaled.shape[-1]), dim=-1)  # (B, k)
        vals_l, ids_l = (vals - lse[:, None]).tolist(), ids.tolist()
        for i, r in enumerate(rows):
            if not failed[i]:
                top[i] = [(t, v) for t, v in zip(ids_l[i][: r.top_logprobs], vals_l[i][: r.top_logprobs], strict=True) if v > -math.inf]
    return SampleOutput(token_ids=chosen.tolist(), logprobs=chosen_lp.tolist(), top=top, failed=failed)


def penalize(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """``logits`` (B, V) with each penalized row's penalties and bias added (module docstring); the same tensor, untouched,
    when no row has any. One ``(P, V)`` adjustment for the ``P`` penalized rows, added in one ``index_add``."""
    pen = [(i, r.penalties) for i, r in enumerate(rows) if r.penalties is not None]
    if not pen:
        return logits
    vocab, dev, dt = logits.shape[-1], logits.device, logits.dtype
    counts = torch.stack([p.counts(vocab, dev, dt) for _, p in pen])  # (P, V)
    freq = torch.tensor([p.frequency for _, p in pen], dtype=dt, device=dev)
    pres = torch.tensor([p.presence for _, p in pen], dtype=dt, device=dev)
    adj = -(freq[:, None] * counts + pres[:, None] * (counts > 0).to(dt))  # (P, V)
    bias = [(j, tok, b) for j, (_, p) in enumerate(pen) for tok, b in p.bias]
    if bias:
        rows_j, toks, vals = zip(*bias, strict=True)
        where = (torch.tensor(rows_j, device=dev), torch.tensor(toks, device=dev))
        adj.index_put_(where, torch.tensor(vals, dtype=dt, device=dev), accumulate=True)
    return logits.index_add(0, torch.tensor([i for i, _ in pen], device=dev), adj)


_CDF_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def _inverse_cdf(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of ``probs`` (S, V), non-negative and unnormalised: the first token whose cumulative mass
    exceeds ``u`` times the row's total, ``u ~ U[0, 1)`` from the row's own generator (the global RNG where None).

    Exact inverse-transform sampling, with one random number a row: ``torch.multinomial`` (and the exponential race)
    draw from the generator once per vocabulary entry, 1 ms a row on a 49k vocabulary, a quarter of a 16-row decode
    step. Sums are in float64, so a token's share is kept to about 1e-16 of the total; a token of mass 0 (masked, or
    cut by top-p) is never chosen, since the first index whose sum *exceeds* a value never ends a run of equal sums.

    Two levels, so no (S, V) float64 cumulative sum is written (7 ms of a 64-row step): the blocks of
    ``_CDF_BLOCK`` tokens are summed, the draw picks a block by their cumulative sums, then a token inside that block
    by its own cumulative sum, offset by the mass before the block."""
    s, v = probs.shape
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])  # (S,)
    pad = -v % _CDF_BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(s, -1, _CDF_BLOCK)  # (S, nb, block); the padding has mass 0
    upto = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # (S, nb): mass up to each block's end
    target = u * upto[:, -1]  # (S,)
    b = torch.searchsorted(upto, target[:, None], right=True)[:, 0].clamp_(max=upto.shape[1] - 1)  # (S,)
    before = torch.where(b > 0, upto.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], 0.0)  # (S,): mass before block b
    chosen_block = blocks[torch.arange(s), b]  # (S, block)
    inside = chosen_block.to(torch.float64).cumsum(dim=-1)
    j = torch.searchsorted(inside, (target - before)[:, None], right=True)[:, 0]  # (S,)
    # rounding may put the target at or past the block's own total (its cumsum and its sum differ in the last bit): then
    # the block's last token of mass
    last = torch.where(chosen_block > 0, torch.arange(_CDF_BLOCK), -1).amax(dim=-1)
    j = torch.where(j >= _CDF_BLOCK, last, j)
    return (b * _CDF_BLOCK + j).clamp_(max=v - 1)


def _top_p_probs(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail outside the nucleus of each row. ``probs``: (S, V); ``top_p``: (S,)."""
    if bool((top_p >= 1.0).all()):
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # (S, V)
    cum = torch.cumsum(sorted_p, dim=-1)
    drop = (cum - sorted_p) > top_p[:, None]  # keep the token that crosses the threshold
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)
