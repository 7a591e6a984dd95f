"""Sticky A/B routing: a pure function from a request key to an adapter name.

``assign_arm(key, arms, salt=experiment_id)`` hashes ``f"{salt}:{key}"`` with SHA-256, maps the digest to a
point ``u`` in ``[0, 1)``, and picks the arm whose slice of the cumulative normalized weights contains ``u``.
The key should be sticky (user or session id), so a conversation never flips arms mid-way and keeps its
prefix cache on one adapter::

    arms = [Arm("champion-v3", 9.0), Arm("challenger-v4", 1.0)]
    adapter = assign_arm(session_id, arms, salt="exp-2024-06-v4")

Properties the tests pin down:

- deterministic across calls and processes (no ``hash()``, whose seed changes per process, no RNG);
- the split over many keys follows the weights;
- different salts (experiments) give decorrelated assignments, so one experiment's arm does not predict
  another's;
- for two arms in a fixed order, raising one arm's weight only moves keys *into* that arm (a ramp from
  1% to 10% keeps every key that was already on the challenger there). Keep the order of ``arms`` fixed for
  the life of an experiment: reordering reshuffles keys.

Not here: which experiments exist, whether an adapter is loaded (the registry decides that), recording
which arm served a request, or deciding an experiment (see ``runtime.experiment_stats``).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Arm", "assign_arm", "unit_interval"]


@dataclass(frozen=True)
class Arm:
    """One arm of an experiment: the adapter it routes to and its relative traffic weight (> 0)."""

    adapter: str
    weight: float

    def __post_init__(self) -> None:
        _check_weight(self)


def _check_weight(arm: Arm) -> None:
    try:
        weight = float(arm.weight)
    except (TypeError, ValueError):
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"arm {arm.adapter!r} has weight {arm.weight!r}; weights must be finite and > 0 (drop the arm to stop routing to it)")


def unit_interval(key: str, *, salt: str) -> float:
    """The point in ``[0, 1)`` that ``key`` hashes to under ``salt``: the top 53 bits of SHA-256 of ``f"{salt}:{key}"``.

    53 bits, not 64, so the division by ``2**53`` is exact in a float and never rounds up to 1.0.
    """
    digest = hashlib.sha256(f"{salt}:{key}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) / float(1 << 53)


def assign_arm(key: str, arms: Sequence[Arm], *, salt: str) -> str:
    """The adapter name ``key`` is routed to: a deterministic, weight-proportional pick among ``arms``.

    Raises ``ValueError`` for no arms, a non-positive or non-finite weight, or a repeated adapter name.
    """
    if not arms:
        raise ValueError("an experiment needs at least one arm")
    seen: set[str] = set()
    cumulative: list[float] = []
    total = 0.0
    for arm in arms:
        _check_weight(arm)  # again here: a frozen dataclass can still be built around __post_init__
        if arm.adapter in seen:
            raise ValueError(f"adapter {arm.adapter!r} appears twice in the arms; merge their weights into one arm")
        seen.add(arm.adapter)
        total += float(arm.weight)
        cumulative.append(total)
    point = unit_interval(key, salt=salt) * total
    # bisect_right: a point exactly on a boundary goes to the next arm, so slice i is [cum[i-1], cum[i]).
    index = min(bisect_right(cumulative, point), len(arms) - 1)  # min: guards float rounding at the top end
    return arms[index].adapter
