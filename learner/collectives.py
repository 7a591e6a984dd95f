"""The data-parallel learner's collectives over torch.distributed's process group, as ``LoRATrainer``'s step uses them.

What it does: ``world`` (this process's rank and the world size: (0, 1) when not distributed), ``allreduce_grads``
(every parameter's gradient summed over the ranks, in one flat buffer) and ``allreduce_sums`` (a dict of floats summed
over the ranks). torch is imported only when one is called.

What it does not: join the process group, start the ranks or mirror rank 0's trainer on the workers
(``learner/distributed.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def world() -> tuple[int, int]:
    """(rank, world size): (0, 1) when not distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def allreduce_grads(params: Sequence[Any]) -> None:
    """Sum every parameter's gradient over the ranks (a rank without micro-batches contributes zeros), in one flat buffer."""
    import torch
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def allreduce_sums(values: dict[str, float]) -> dict[str, float]:
    """Sum a dict of floats over the ranks (keys: the union; a missing key counts 0)."""
    import torch
    import torch.distributed as dist

    keys: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(keys, sorted(values))
    union = sorted(set().union(*keys))
    t = torch.tensor([float(values.get(k, 0.0)) for k in union], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(union, t.tolist(), strict=True))
