"""Prefix-shared packing of training samples: one forward position per distinct token prefix, not per sample.

The samples of one update share long prefixes: a GRPO group's samples have the same context, the turns of one
agent trajectory extend each other (turn k+1's context is turn k's context, output and tool result), and every
chat request of an agent starts with the same system prompt. A transformer's hidden state at a position depends only
on the tokens up to it (and its position), so every sample that starts with the same prefix needs that prefix's
forward pass once. ``plan_packed`` puts the samples in token-sequence order and cuts them into rows; ``pack`` lays
each row out as a prefix trie (each distinct ``context + output`` prefix once, in depth-first order) with an
ancestor mask (a token attends to itself and the tokens on its path: block-diagonal across samples, causal along
one) and its depth as the position id, and names for every output token the row position whose logits predict it.
This is the shared-prefix (tree) attention of tree-search RL trainers (e.g. TreeRL, Hou et al. 2025; PATR's trees),
applied to ordinary batches: for the demo's groups of 8 answers to one 80-token prompt it trains ~2x fewer
positions than one padded row per sample. The logprobs are those of the unpacked rows up to float rounding.

A row holds at most ``row_tokens`` positions (default 512; more only where a sample sharing its prefix, such as a
long trajectory's later turn, needs them), because the ancestor mask is dense: attention over a row costs its length
squared, the rest of the model its length. Rows go into micro-batches by ``rows x longest row <= micro_batch_tokens``
(``plan_micro_batches``, which plans unpacked rows too).

Not here: the loss, the forward pass itself (``learner.trainer``), sequence parallelism, paged or varlen kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ROW_TOKENS", "PackedRows", "pack", "plan_micro_batches", "plan_packed"]

ROW_TOKENS = 512  # the default row length bound (a longer single sample gets a row of its own length)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices packed so that ``rows x longest row`` stays within ``max_tokens`` (a longer row goes alone).

    Rows are taken longest first, which keeps padding low; the result lists indices into ``lengths``.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)  # the first row of a batch is its longest
        else:
            batches.append([i])
    return batches


def plan_packed(seqs: Sequence[Sequence[int]], micro_batch_tokens: int, row_tokens: int | None = None) -> list[list[list[int]]]:
    """Micro-batches of rows of sample indices: ``seqs[i]`` is sample i's ``context + output``.

    Samples are taken in lexicographic token order, so each one shares its longest prefix with the one before it,
    and a row grows while its trie (the positions it would hold) stays within ``min(row_tokens, micro_batch_tokens)``;
    a sample that shares a prefix with the row (a trajectory's later turn) may take it past that bound by at most its
    own length, an unrelated one never. Rows then go into micro-batches
    longest first while ``rows x longest row <= micro_batch_tokens`` (a longer row goes alone)."""
    if not seqs:
        return []
    bound = min(row_tokens or ROW_TOKENS, micro_batch_tokens)
    order = sorted(range(len(seqs)), key=lambda i: tuple(seqs[i]))
    rows: list[list[int]] = []
    sizes: list[int] = []
    for i in order:
        new = len(seqs[i]) - (_lcp(seqs[rows[-1][-1]], seqs[i]) if rows else 0)
        if rows and sizes[-1] + new <= bound + (len(seqs[i]) if new < len(seqs[i]) else 0):
            rows[-1].append(i)
            sizes[-1] += new
        else:
            rows.append([i])
            sizes.append(len(seqs[i]))
    return [[rows[r] for r in batch] for batch in plan_micro_batches(sizes, micro_batch_tokens)]


@dataclass(frozen=True)
class PackedRows:
    """The packed forward input of one micro-batch and where each output token's logits come from.

    ``input_ids``, ``position_ids``: (R, L); ``attend``: (R, 1, L, L) bool, True = may attend (padding attends to
    itself only, so no row of the softmax is empty). Scored tokens, one entry per output token of every sample, in
    sample order: ``row``, ``pos`` (the position whose logits predict it), ``target`` (its id), ``sample`` (its
    sample's index in the micro-batch's sample order) and ``col`` (its column in the (S, T) output layout, each
    sample's outputs right-aligned in ``T`` columns). ``positions``: real (non-padding) positions in all rows."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attend: torch.Tensor
    row: torch.Tensor
    pos: torch.Tensor
    target: torch.Tensor
    sample: torch.Tensor
    col: torch.Tensor
    positions: int

    def to(self, device: torch.device) -> PackedRows:
        return PackedRows(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            attend=self.attend.to(device),
            row=self.row.to(device),
            pos=self.pos.to(device),
            target=self.target.to(device),
            sample=self.sample.to(device),
            col=self.col.to(device),
            positions=self.positions,
        )


def pack(rows: Sequence[Sequence[int]], contexts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> PackedRows:
    """Lay out ``rows`` (lists of indices into ``contexts``/``outputs``) as prefix tries.

    The micro-batch's sample order is the rows' order flattened (``[i for row in rows for i in row]``): ``sample``
    indexes that order. Every sample needs a non-empty context (its first output token is predicted from the
    context's last position)."""
    order = [i for row in rows for i in row]
    t_out = max((len(outputs[i]) for i in order), default=0)
    tokens: list[list[int]] = []
    depths: list[list[int]] = []
    parents: list[list[int]] = []
    paths: dict[int, list[int]] = {}
    for row in rows:
        tok: list[int] = []
        dep: list[int] = []
        par: list[int] = []
        prev: list[int] = []
        prev_seq: list[int] = []
        for i in row:
            if not contexts[i]:
                raise ValueError("a packed sample needs a non-empty context")
            seq = list(contexts[i]) + list(outputs[i])
            keep = _lcp(prev_seq, seq)  # in token order, the longest shared prefix is with the sample before
            path = prev[:keep]
            for d in range(keep, len(seq)):
                par.append(path[-1] if path else -1)
                path.append(len(tok))
                tok.append(seq[d])
                dep.append(d)
            paths[i] = path
            prev, prev_seq = path, seq
        tokens.append(tok)
        depths.append(dep)
        parents.append(par)
    width = max(len(t) for t in tokens)
    n_rows = len(rows)
    input_ids = torch.zeros(n_rows, width, dtype=torch.long)
    position_ids = torch.zeros(n_rows, width, dtype=torch.long)
    attend = np.zeros((n_rows, width, width), dtype=bool)
    for r, (tok, dep, par) in enumerate(zip(tokens, depths, parents, strict=True)):
        input_ids[r, : len(tok)] = torch.tensor(tok)
        position_ids[r, : len(tok)] = torch.tensor(dep)
        m = attend[r]
        for p, q in enumerate(par):  # parents come before their children: a row of the mask is its parent's plus itself
            if q >= 0:
                m[p] = m[q]
            m[p, p] = True
        for p in range(len(tok), width):
            m[p, p] = True  # padding: attends to itself only
    row_of: list[int] = []
    pos_of: list[int] = []
    target: list[int] = []
    sample: list[int] = []
    col: list[int] = []
    s = 0
    for r, row in enumerate(rows):
        for i in row:
            c, out, path = len(contexts[i]), outputs[i], paths[i]
            for j, tid in enumerate(out):
                row_of.append(r)
                pos_of.append(path[c + j - 1])
                target.append(int(tid))
                sample.append(s)
                col.append(t_out - len(out) + j)
            s += 1

    def long(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long)

    return PackedRows(
        input_ids=input_ids,
        position_ids=position_ids,
        attend=torch.from_numpy(attend)[:, None],
        row=long(row_of),
        pos=long(pos_of),
        target=long(target),
        sample=long(sample),
        col=long(col),
        positions=sum(len(t) for t in tokens),
    )
