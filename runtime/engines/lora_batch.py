"""Batched multi-LoRA for the embedded engine: every token of a forward gets its row's adapter delta.

    bank = LoraBank(model)                      # once, after the model is loaded (and packed)
    weights = read_lora(path, bank.targets)     # any thread (lora_weights)
    bank.attach("fam@3", weights)               # scheduler thread, between two forwards
    with bank.rows(["fam@3", None, "fam@1"]):   # one name (or None for the base) per batch row
        logits = model(...)                     # transformers path: sites stand in for the linears
        bank.add("model.layers.0.self_attn.q_proj", x, y)   # fused path (llama_runner): y += deltas

How: each adapted ``nn.Linear`` gets a ``_Site`` that adds the LoRA delta ``scale * (x @ A^T) @ B^T``
for the tokens whose row names an adapter with weights for that module. The transformers path puts
the site in front of the module's own forward; the fused runner calls ``bank.add`` with a column
slice of its fused QKV / gate-up output. No peft wrappers at serve time.

Per forward, ``rows`` builds one ``_Plan``: the distinct adapters of the batch (in order) and each
token's slot among them (-1 = base); row ``i`` owns ``counts[i]`` consecutive tokens (1 for a decode
row). Each site then adds the delta for all tokens with one GEMM pair, the "stacked" form used by
punica/S-LoRA/SGLang made dense for CPU:

    h = x @ A_cat          # (N, R): A_cat = [A_1^T | A_2^T | ...], R = sum of the ranks present
    h[~M] = 0              # (N, R): M[t, c] is True where column c belongs to token t's adapter
    y += h @ B_cat         # (N, out): B_cat = [B_1^T; B_2^T; ...] with the scales folded in

Tokens on the base or on other adapters only meet zeros, so each gets exactly its own delta. The mask
*sets* zeros rather than multiplying by them: an adapter whose finite weights overflow (``x @ A`` is
infinite) would otherwise turn its neighbours' columns into ``inf * 0 = NaN``, and fail their requests too.
``B_cat`` is finite (``lora_weights`` refuses NaN and infinite weights), so a zero row of ``h`` adds zero. When
every token uses the same adapter (prefill, single-adapter traffic) there is no mask. ``A_cat``/``B_cat``
are cached per site and set of adapters; masks are shared by sites with the same column layout
within one forward. Past ``max_stacked_rank`` columns (many distinct high-rank adapters in one batch)
the masked form wastes too much work, so the site instead groups tokens by adapter
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
    """The token → adapter map of one forward: ``names`` are the distinct adapters, ``slot`` (N,) indexes them (-1: base)."""

    def __init__(self, row_names: Sequence[str | None], counts: Sequence[int]) -> None:
        self.tokens = int(sum(counts))  # N
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
        self.uniform = len(names) == 1 and -1 not in slots  # every token on names[0]
        row_slot = torch.tensor(slots, dtype=torch.long)  # (rows,)
        self.slot = row_slot if all(c == 1 for c in counts) else row_slot.repeat_interleave(torch.tensor(list(counts)))  # (N,)
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}

    def unused(self, layout: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
        """(N, R) bool: which of the ``layout``'s columns ((slot, rank) blocks, in order) each token does *not* use."""
        m = self._masks.get(layout)
        if m is None:
            owner = torch.cat([torch.full((rank,), slot, dtype=torch.long) for slot, rank in layout])  # (R,)
            m = (self.slot[:, None] != owner[None, :]).to(device=device)
            self._masks[layout] = m
        return m

    def rows_of(self, slot: int) -> torch.Tensor:
        """The indices of the tokens on adapter ``slot``."""
        r = self._rows.get(slot)
        if r is None:
            r = self._rows[slot] = (self.slot == slot).nonzero().flatten()
        return r


class _Site:
    """One adapted linear: its adapters' weights, and the delta each token's adapter adds to its output."""

    def __init__(self, bank: LoraBank, module: nn.Linear) -> None:
        self.bank = bank
        self.base_forward = module.forward
        self.in_features = int(module.weight.shape[1])
        self.out_features = int(module.weight.shape[0])
        self.weights: dict[str, LoraModule] = {}
        self._stacked: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = {}

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Stands in for the module's ``forward`` (the transformers path): base output plus the deltas."""
        y = self.base_forward(x, *args, **kwargs)  # (..., out), contiguous
        plan = self.bank.plan
        if plan is not None and self.weights:
            self.add(plan, x.reshape(-1, self.in_features), y.view(-1, self.out_features))
        return y

    def add(self, plan: _Plan, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y`` (N, out) += each token's LoRA delta for ``x`` (N, in), in place (``y`` may be a column slice)."""
        if plan.tokens > self.bank.small_tokens:
            self._delta(plan, x, y)
            return
        # decode-sized LoRA GEMMs are a few microseconds of work; handing them to the thread pool costs
        # far more (a barrier per op, long waits when a sibling thread is descheduled), so run them inline
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._delta(plan, x, y)
        finally:
            torch.set_num_threads(threads)

    def _delta(self, plan: _Plan, x: torch.Tensor, y: torch.Tensor) -> None:
        if plan.uniform:
            w = self.weights.get(plan.names[0])
            if w is not None:
                y.addmm_(torch.mm(x, w.a_t), w.b_t)
            return
        present = tuple(n for n in plan.names if n in self.weights)
        if not present:
            return
        a_cat, b_cat, layout = self._stack(plan, present)
        if a_cat.shape[1] > self.bank.max_stacked_rank:
            self._grouped(plan, x, y)
            return
        h = torch.mm(x, a_cat)  # (N, R)
        h.masked_fill_(plan.unused(layout, h.device), 0.0)  # not mul_: inf * 0 would be NaN in a neighbour's row
        y.addmm_(h, b_cat)

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

    def _grouped(self, plan: _Plan, x: torch.Tensor, y: torch.Tensor) -> None:
        for slot, name in enumerate(plan.names):
            w = self.weights.get(name)
            if w is None:
                continue
            rows = plan.rows_of(slot)  # (g,)
            y.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), w.a_t), w.b_t))  # (g, out)

    def drop(self, name: str) -> None:
        if self.weights.pop(name, None) is not None:
            self._stacked = {k: v for k, v in self._stacked.items() if name not in k}


class LoraBank:
    """The adapters attached to one model, and the token → adapter plan of the forward in progress."""

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
                module.forward = site  # type: ignore[method-assign, assignment]
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

    def add(self, module_name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Fused path: ``y`` (N, out of ``module_name``) += the LoRA deltas of the plan in force for ``x`` (N, in)."""
        site = self._sites.get(module_name)
        if self.plan is not None and site is not None and site.weights:
            site.add(self.plan, x, y)

    @contextlib.contextmanager
    def rows(self, row_names: Sequence[str | None], tokens: int | None = None, counts: Sequence[int] | None = None) -> Iterator[None]:
        """Within the block, forwards give row ``i``'s tokens the adapter ``row_names[i]`` (None: the base).

        ``counts``: tokens per row, in the forward's token order (default: ``tokens`` split evenly over
        the rows, a (B, T) batch; without either, one token per row, a decode step)."""
        unknown = {n for n in row_names if n is not None and n not in self._adapters}
        if unknown:  # the engine refuses unloads while rows use an adapter; reaching this is a bug
            raise EngineError(f"rows name adapters that are not loaded: {sorted(unknown)}")
        if counts is None:
            per_row = (tokens // len(row_names)) if tokens is not None and row_names else 1
            counts = [per_row] * len(row_names)
        self.plan = _Plan(row_names, counts) if any(n is not None for n in row_names) else None
        try:
            yield
        finally:
            self.plan = None
