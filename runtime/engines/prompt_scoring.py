"""Prompt logprobs from a prefill's logits: per position, the log-softmax at the next prompt token, its rank and the top k.

The embedded engine calls :func:`score_prompt` on the scheduler thread for every prompt chunk of a
request that asked for prompt logprobs (``SamplingParams.prompt_logprobs``), right after the chunk's
forward. The logits of position i give the distribution of token i + 1 (a causal language model's
next-token distribution), so a prompt of n tokens has n - 1 scores; the first token has none. Values
are of the raw logits (``runtime/engine.py``'s convention for prompt logprobs), in float32.

Memory is bounded by :data:`SLICE`: the logits of at most that many positions are materialised and
soft-maxed at a time (64 × a 152k vocabulary is 39 MB of float32), however long the chunk.

Not here: which chunks are scored or when the scores are sent (``runtime/engines/embedded.py``), the
wire formats (``runtime/api/completions_logprobs.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.engine import TokenLogprob
from runtime.engines.runner import LogitsOf

SLICE = 64  # positions whose logits are materialised at once


def score_prompt(logits_of: LogitsOf, count: int, targets: Sequence[int], k: int, slice_rows: int = SLICE) -> list[TokenLogprob]:
    """The scores of a chunk's first ``count`` positions: position j is scored at ``targets[j]`` (the prompt token after it)."""
    if len(targets) != count:
        raise ValueError(f"{count} positions but {len(targets)} target tokens")
    out: list[TokenLogprob] = []
    for lo in range(0, count, slice_rows):
        hi = min(count, lo + slice_rows)
        out += score_rows(logits_of(lo, hi), targets[lo:hi], k)
    return out


def score_rows(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprob]:
    """``logits`` ``(P, V)`` and one target token per row → its logprob, its rank (1 = the likeliest) and the top ``k`` (best first).

    A row of NaN logits gives a NaN logprob (the caller fails that request)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(list(targets), dtype=torch.long)
    chosen = lp.gather(1, tgt[:, None])[:, 0]
    ranks = ((lp > chosen[:, None]).sum(dim=1) + 1).tolist()
    values = chosen.tolist()
    tops: list[tuple[tuple[int, float], ...]]
    if k > 0:
        top_v, top_i = lp.topk(min(k, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(ids, vals, strict=True)) for ids, vals in zip(top_i.tolist(), top_v.tolist(), strict=True)]
    else:
        tops = [()] * len(values)
    return [TokenLogprob(t, v, top, r) for t, v, top, r in zip(targets, values, tops, ranks, strict=True)]
