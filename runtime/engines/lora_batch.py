"""Batched multi-LoRA for the embedded engine: every row of a forward gets its own adapter's delta.

    bank = LoraBank(model)                      # once, after the model is loaded (and packed)
    weights = read_lora(path, bank.targets)     # any thread (lora_weights)
    bank.attach("fam@3", weights)               # scheduler thread, between two forwards
    with bank.rows(["fam@3", None, "fam@1"]):   # one name (or None for the base) per batch row
        logits = model(...)

How: each adapted ``nn.Linear`` keeps its own forward (the oneDNN-packed one from ``cpu_linear``) and
gets a ``_Site`` in front of it that adds the LoRA delta ``scale * (x @ A^T) @ B^T`` for the rows
that name an adapter with weights for that module. No peft wrappers at serve time.

Per forward, ``rows`` builds one ``_Plan``: the distinct adapters of the batch (in order) and each
row's slot among them (-1 = base). Each site then adds the delta for the whole batch with one GEMM
pair, the "stacked" form used by punica/S-LoRA/SGLang made dense for CPU:

    h = x @ A_cat          # (B, T, R): A_cat = [A_1^T | A_2^T | ...], R = sum of the ranks present
    h *= M                 # (B, 1, R): M[b, c] = 1 where column c belongs to row b's adapter
    y += h @ B_cat         # (B, T, out): B_cat = [B_1^T; B_2^T; ...] with the scales folded in

Rows on the base or on other adapters only meet zeros, so each row gets exactly its own delta. When
every row uses the same adapter (prefill, single-adapter traffic) there is no mask. ``A_cat``/``B_cat``
are cached per site and set of adapters; masks are shared by sites with the same column layout
within one forward. Past ``max_stacked_rank`` columns (many distinct high-rank adapters in one batch)
the masked form wastes too much work, so the site instead groups rows by adapter
(``index_select`` → two GEMMs → ``index_add_``).

Concurrency: the bank belongs to the scheduler thread. ``attach``/``detach`` and every forward run
there, so weights never change under a forward; ``read_lora`` only reads the base weights' shapes.

Not here: embedding LoRA, LoRA on non-``nn.Linear`` modules, autograd (serving only).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from runtime.engine import AdapterError, EngineError
from runtime.engines.lora_weights import LoraModule, LoraWeights

log = logging.getLogger(__name__)

_CACHE_LIMIT = 32  # cached (A_cat, B_cat) pairs per site; cleared when full (batches rarely change adapter sets)


class _Plan:
    """The row → adapter map of one forward: ``names`` are the distinct adapters, ``slot`` (B,) indexes them (-1: base)."""

    def __init__(self, row_names: Sequence[str | None], tokens: int) -> None:
        self.tokens = tokens  # B * T of the forward
        names: list[str] = []
        index: dict[str, int] = {}
        slots: list[int] = []
        for n in row_names:
            if n is None:
                slots.append(-1)
                continue
            if n not in index:
                index[n] = len(names)
                names.append(n)
            slots.append(index[n])
        self.names = tuple(names)
        self.index = index
        self.uniform = len(names) == 1 and -1 not in slots  # every row on names[0]
        self.slot = torch.tensor(slots, dtype=torch.long)  # (B,)
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}

    def mask(self, layout: tuple[tuple[int, int], ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """(B, 1, R) 0/1: which of the ``layout``'s columns ((slot, rank) blocks, in order) each row uses."""
        m = self._masks.get(layout)
        if m is None:
            owner = torch.cat([torch.full((rank,), slot, dtype=torch.long) for slot, rank in layout])  # (R,)
            m = (self.slot[:, None] == owner[None, :]).to(dtype=dtype, device=device)[:, None, :]
            self._masks[layout] = m
        return m

    def rows_of(self, slot: int) -> torch.Tensor:
        r = self._rows.get(slot)
        if r is None:
            r = self._rows[slot] = (self.slot == slot).nonzero().flatten()
        return r


class _Site:
    """Stands in for one linear's ``forward``: base output plus each row's LoRA delta."""

    def __init__(self, bank: LoraBank, module: nn.Linear) -> None:
        self.bank = bank
        self.base_forward = module.forward
        self.out_features = int(module.weight.shape[0])
        self.weights: dict[str, LoraModule] = {}
        self._stacked: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = {}

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = self.base_forward(x, *args, **kwargs)  # (B, T, out)
        plan = self.bank.plan
        if plan is None or not self.weights:
            return y
        if plan.tokens > self.bank.small_tokens:
            return self._delta(plan, x, y)
        # decode-sized LoRA GEMMs are a few microseconds of work; handing them to the thread pool costs
        # far more (a barrier per op, long waits when a sibling thread is descheduled), so run them inline
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._delta(plan, x, y)
        finally:
            torch.set_num_threads(threads)

    def _delta(self, plan: _Plan, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if plan.uniform:
            w = self.weights.get(plan.names[0])
            if w is None:
                return y
            return _add_dense(y, x, w.a_t, w.b_t)
        present = tuple(n for n in plan.names if n in self.weights)
        if not present:
            return y
        a_cat, b_cat, layout = self._stack(plan, present)
        if a_cat.shape[1] > self.bank.max_stacked_rank:
            return self._grouped(plan, x, y)
        h = torch.matmul(x, a_cat)  # (B, T, R)
        h.mul_(plan.mask(layout, h.dtype, h.device))
        return _add_dense(y, h, None, b_cat)

    def _stack(self, plan: _Plan, present: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]]:
        """``A_cat`` (in, R), ``B_cat`` (R, out) for the adapters ``present``, and their (slot, rank) column blocks."""
        hit = self._stacked.get(present)
        if hit is None:
            ws = [self.weights[n] for n in present]
            hit = (torch.cat([w.a_t for w in ws], dim=1), torch.cat([w.b_t for w in ws], dim=0), tuple(w.rank for w in ws))
            if len(self._stacked) >= _CACHE_LIMIT:
                self._stacked.clear()
            self._stacked[present] = hit
        a_cat, b_cat, ranks = hit
        return a_cat, b_cat, tuple((plan.index[n], r) for n, r in zip(present, ranks, strict=True))

    def _grouped(self, plan: _Plan, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for slot, name in enumerate(plan.names):
            w = self.weights.get(name)
            if w is None:
                continue
            rows = plan.rows_of(slot)  # (g,)
            xs = x.index_select(0, rows)  # (g, T, in)
            y.index_add_(0, rows, torch.matmul(torch.matmul(xs, w.a_t), w.b_t))  # (g, T, out)
        return y

    def drop(self, name: str) -> None:
        if self.weights.pop(name, None) is not None:
            self._stacked = {k: v for k, v in self._stacked.items() if name not in k}


def _add_dense(y: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor | None, b_t: torch.Tensor) -> torch.Tensor:
    """``y + (x @ a_t) @ b_t`` (``x`` is already ``x @ a_t`` when ``a_t`` is None), in place where ``y`` allows."""
    h = x if a_t is None else torch.matmul(x, a_t)  # (B, T, r)
    if y.is_contiguous():
        y.view(-1, y.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), b_t)
        return y
    return y + torch.matmul(h, b_t)


class LoraBank:
    """The adapters attached to one model, and the row → adapter plan of the forward in progress."""

    def __init__(self, model: nn.Module, *, max_stacked_rank: int = 256, small_tokens: int = 64) -> None:
        self._model = model
        self.max_stacked_rank = max_stacked_rank
        self.small_tokens = small_tokens  # forwards over at most this many tokens run their LoRA GEMMs on one thread
        self.targets: dict[str, nn.Linear] = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        self._sites: dict[str, _Site] = {}
        self._adapters: dict[str, LoraWeights] = {}
        self.plan: _Plan | None = None

    def names(self) -> list[str]:
        return sorted(self._adapters)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def attach(self, name: str, weights: LoraWeights) -> None:
        """Serve ``weights`` under ``name`` from the next forward on. Scheduler thread only."""
        if self.plan is not None:
            raise EngineError("LoraBank.attach during a forward")
        if name in self._adapters:
            raise AdapterError(f"adapter {name!r} is already loaded (versions are immutable: load it under a new name)")
        for module_name, lora in weights.modules.items():
            site = self._sites.get(module_name)
            if site is None:  # first adapter on this linear: put a site in front of its forward
                module = self.targets[module_name]
                site = self._sites[module_name] = _Site(self, module)
                module.forward = site  # type: ignore[method-assign]
            site.weights[name] = lora
        self._adapters[name] = weights

    def detach(self, name: str) -> None:
        """Stop serving ``name`` and drop its weights. Scheduler thread only, never during a forward."""
        if self.plan is not None:
            raise EngineError("LoraBank.detach during a forward")
        weights = self._adapters.pop(name, None)
        if weights is None:
            raise AdapterError(f"adapter {name!r} is not loaded")
        for module_name in weights.modules:
            self._sites[module_name].drop(name)

    @contextlib.contextmanager
    def rows(self, row_names: Sequence[str | None], tokens: int | None = None) -> Iterator[None]:
        """Within the block, forwards give row ``i`` the adapter ``row_names[i]`` (None: the base).

        ``tokens``: B * T of the forward (default: one token per row, a decode step)."""
        unknown = {n for n in row_names if n is not None and n not in self._adapters}
        if unknown:  # the engine refuses unloads while rows use an adapter; reaching this is a bug
            raise EngineError(f"rows name adapters that are not loaded: {sorted(unknown)}")
        self.plan = _Plan(row_names, tokens if tokens is not None else len(row_names)) if any(n is not None for n in row_names) else None
        try:
            yield
        finally:
            self.plan = None
