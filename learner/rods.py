"""RODS (reward-driven online data synthesis): a replay pool of task problems that moves with the policy.

    pool = ReplayPool(RodsConfig(capacity=64), seed=0)
    pool.add_seeds([ItemRef(0, 0), ItemRef(1, 0)])           # the human seed items: never evicted
    batch = pool.sample(4)                                    # priority by boundary score
    ... G rollouts of each item ...
    pool.observe(batch[0], [1.0, 0.0, 0.0, 1.0])             # b(x) = Var_G(r) / ((r_max - r_min)^2 / 4): 4 * Var on [0, 1]
    pool.add_variants([ItemRef(5, 10**9 + 7)], parent=batch[0])   # validated by the task's verifier (agents/tasks/variants.py)
    pool.end_update()                                         # this update's pool size, zero-variance fraction, histogram

**Boundary score** (Fang et al. 2026, arXiv 2606.19047: GRPO's gradient concentrates where the rollout
reward variance is high, bounded by Popoviciu's inequality ``Var <= (r_max - r_min)^2 / 4``):
``b(x) = Var_G(r) / ((r_max - r_min)^2 / 4)``, the population variance of the item's ``G`` rewards of one
update over Popoviciu's bound for the task's reward range ``[r_min, r_max]`` (``reward_range``, default
``[0, 1]``: ``b = 4 * Var``, ``p(1-p)*4`` for binary rewards: 1 at ``p = 0.5``, 0 when all equal). A reward
outside the stated range widens it (the pool keeps the range of every reward it has seen, so its items
share one scale): ``b`` stays in ``[0, 1]`` without clipping, and rewards outside ``[0, 1]`` (Kevin's
uncapped ``0.3 + speedup``, negative penalties) do not saturate it. The ``G`` rewards must be independent
rollouts of the item (its ``G`` runs; under PATR one leaf per root run, ``learner.sources``): leaves that
share a forked prefix are correlated and would misstate the variance. It costs no inference: it is read off
the rollouts the update trains on.

**Pool** (items are ``(problem_index, seed)`` of the learner's task, as the runs endpoint addresses them):
- ``sample(n)``: ``n`` distinct items, with probability proportional to ``(b + floor) ** exponent``
  (Efraimidis-Spirakis weighted sampling without replacement, seeded); an item never visited counts as
  ``b = 1`` (it is tried before it is judged);
- ``observe``: records ``b``, the visit, and the streak of consecutive visits with ``b == 0``; a
  synthesised item whose streak reaches ``patience`` is evicted (mastered: all 1; hopeless: all 0);
  **seed items are never evicted** and stay eligible (their priority falls to the floor);
- ``add_variants``: new items (duplicates ignored); when the pool is at ``capacity`` a variant
  makes room by evicting the synthesised item with the longest zero-variance streak, then the oldest;
  with only seed items left, it is not added;
- ``boundary(tau)``: the items whose last ``b >= tau`` (what the synthesis starts from);
- ``end_update``: the update's figures (pool size, seeds, variants, items visited, zero-variance
  fraction among them, boundary histogram over ``[0, .25), [.25, .5), [.5, .75), [.75, 1]``,
  evictions and additions), which the learner writes to its status and history.

State is JSON (:meth:`ReplayPool.to_dict`), kept next to the learner's checkpoints.

Not here: the rollouts, the synthesis (the runtime's ``POST /admin/agents/{name}/variants``), the update.
Importing this module does not import torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["HIST_EDGES", "ItemRef", "PoolItem", "ReplayPool", "boundary_score"]

HIST_EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)


def _check_range(reward_range: tuple[float, float]) -> tuple[float, float]:
    lo, hi = float(reward_range[0]), float(reward_range[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"reward_range must be finite with r_min < r_max, got {reward_range!r}")
    return lo, hi


def boundary_score(rewards: Sequence[float], reward_range: tuple[float, float] = (0.0, 1.0)) -> float:
    """``Var_G(r) / ((r_max - r_min)^2 / 4)`` (population variance over Popoviciu's bound) of one item's independent
    rollout rewards, ``[r_min, r_max]`` = ``reward_range`` widened to every reward given; in ``[0, 1]``; 0 for fewer
    than two rewards. On ``[0, 1]`` this is ``4 * Var``."""
    lo, hi = _check_range(reward_range)
    vals = [float(r) for r in rewards if r is not None and math.isfinite(float(r))]
    if len(vals) < 2:
        return 0.0
    lo, hi = min(lo, *vals), max(hi, *vals)
    mean = sum(vals) / len(vals)
    var = sum((r - mean) ** 2 for r in vals) / len(vals)
    return min(1.0, var / ((hi - lo) ** 2 / 4.0))  # <= 1 by Popoviciu; min() only absorbs rounding


@dataclass(frozen=True)
class ItemRef:
    """A task problem as the runs endpoint addresses it (under the agent's task options)."""

    problem_index: int
    seed: int

    @property
    def key(self) -> str:
        return f"{self.seed}/{self.problem_index}"


@dataclass
class PoolItem:
    ref: ItemRef
    is_seed: bool
    parent: str | None = None  # the key of the boundary item it was synthesised from
    boundary: float | None = None  # the last b(x); None = never visited
    visits: int = 0
    zero_streak: int = 0  # consecutive visits with b == 0
    added_at: int = 0  # the update count when it entered

    def priority(self, floor: float, exponent: float) -> float:
        b = 1.0 if self.boundary is None else self.boundary
        p: float = (b + floor) ** exponent  # typeshed types float ** float as Any (a negative base gives a complex)
        return p


@dataclass
class _UpdateFigures:
    visited: int = 0
    zero_variance: int = 0
    histogram: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    evicted: int = 0
    added: int = 0
    rejected_full: int = 0


class ReplayPool:
    """The RODS replay pool (module docstring)."""

    def __init__(
        self,
        capacity: int = 800,
        patience: int = 2,
        floor: float = 0.05,
        exponent: float = 1.0,
        seed: int = 0,
        reward_range: tuple[float, float] = (0.0, 1.0),
    ) -> None:
        if capacity < 1 or patience < 1 or floor < 0 or exponent <= 0:
            raise ValueError("capacity and patience must be >= 1, floor >= 0, exponent > 0")
        self.capacity, self.patience, self.floor, self.exponent = capacity, patience, floor, exponent
        self.reward_range = _check_range(reward_range)  # the task's stated range, widened by every reward observed
        self.items: dict[str, PoolItem] = {}
        self.updates = 0
        self.rng = random.Random(seed)
        self._fig = _UpdateFigures()

    # ---- contents --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, ref: ItemRef) -> bool:
        return ref.key in self.items

    def add_seeds(self, refs: Iterable[ItemRef]) -> int:
        """Seed items (kept whatever their score; they may exceed ``capacity``: seeds are the task's own data)."""
        n = 0
        for ref in refs:
            if ref.key not in self.items:
                self.items[ref.key] = PoolItem(ref, is_seed=True, added_at=self.updates)
                n += 1
        return n

    def add_variants(self, refs: Iterable[ItemRef], parent: ItemRef | None = None) -> int:
        """Synthesised items (already validated by the task's verifier); returns how many entered."""
        n = 0
        for ref in refs:
            if ref.key in self.items:
                continue
            if len(self.items) >= self.capacity and not self._evict_one():
                self._fig.rejected_full += 1
                continue
            self.items[ref.key] = PoolItem(ref, is_seed=False, parent=parent.key if parent else None, added_at=self.updates)
            self._fig.added += 1
            n += 1
        return n

    def _evict_one(self) -> bool:
        """Make room: the synthesised item with the longest zero-variance streak, then the oldest; False if only seeds remain."""
        synth = [it for it in self.items.values() if not it.is_seed]
        if not synth:
            return False
        victim = max(synth, key=lambda it: (it.zero_streak, -it.added_at))
        del self.items[victim.ref.key]
        self._fig.evicted += 1
        return True

    # ---- sampling and scoring --------------------------------------------------------------------
    def sample(self, n: int) -> list[ItemRef]:
        """``n`` distinct items (all of them if fewer), weighted by ``(b + floor) ** exponent`` without replacement."""
        if n <= 0 or not self.items:
            return []
        keyed = []
        for it in self.items.values():
            w = it.priority(self.floor, self.exponent)
            u = self.rng.random()
            keyed.append((math.log(u) / w if w > 0 else -math.inf, it.ref.key))  # Efraimidis-Spirakis: largest u**(1/w)
        keyed.sort(reverse=True)
        return [self.items[k].ref for _, k in keyed[:n]]

    def observe(self, ref: ItemRef, rewards: Sequence[float]) -> float | None:
        """Record one visit's rewards; returns ``b(x)`` (None if the item is not in the pool). May evict the item."""
        it = self.items.get(ref.key)
        if it is None:
            return None
        vals = [float(r) for r in rewards if r is not None and math.isfinite(float(r))]
        if vals:
            self.reward_range = (min(self.reward_range[0], *vals), max(self.reward_range[1], *vals))
        b = boundary_score(vals, self.reward_range)
        it.boundary, it.visits = b, it.visits + 1
        it.zero_streak = it.zero_streak + 1 if b == 0.0 else 0
        self._fig.visited += 1
        self._fig.zero_variance += int(b == 0.0)
        self._fig.histogram[min(3, int(b * 4))] += 1
        if not it.is_seed and it.zero_streak >= self.patience:
            del self.items[ref.key]
            self._fig.evicted += 1
        return b

    def boundary(self, tau: float) -> list[ItemRef]:
        """Items whose last boundary score is at least ``tau`` (highest first)."""
        hits = [it for it in self.items.values() if it.boundary is not None and it.boundary >= tau]
        hits.sort(key=lambda it: -(it.boundary or 0.0))
        return [it.ref for it in hits]

    def end_update(self) -> dict[str, Any]:
        """This update's figures (module docstring); starts the next update's count."""
        f = self._fig
        out = {
            "pool_size": len(self.items),
            "seeds": sum(1 for it in self.items.values() if it.is_seed),
            "variants": sum(1 for it in self.items.values() if not it.is_seed),
            "visited": f.visited,
            "zero_variance_fraction": f.zero_variance / f.visited if f.visited else 0.0,
            "boundary_histogram": list(f.histogram),
            "histogram_edges": list(HIST_EDGES),
            "evicted": f.evicted,
            "added": f.added,
            "rejected_full": f.rejected_full,
        }
        self.updates += 1
        self._fig = _UpdateFigures()
        return out

    # ---- persistence -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "updates": self.updates,
            "reward_range": list(self.reward_range),
            "items": [{**asdict(it), "ref": asdict(it.ref)} for it in self.items.values()],
            "rng": self.rng.getstate()[1][:625],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, patience: int, floor: float, exponent: float, capacity: int | None = None) -> ReplayPool:
        pool = cls(capacity=capacity or int(d["capacity"]), patience=patience, floor=floor, exponent=exponent)
        pool.updates = int(d.get("updates", 0))
        rr = d.get("reward_range")
        if isinstance(rr, list) and len(rr) == 2:
            pool.reward_range = _check_range((float(rr[0]), float(rr[1])))
        for raw in d.get("items", []):
            ref = ItemRef(**raw["ref"])
            pool.items[ref.key] = PoolItem(**{**raw, "ref": ref})
        state = d.get("rng")
        if isinstance(state, list) and len(state) == 625:
            pool.rng.setstate((3, tuple(int(x) for x in state), None))
        return pool
