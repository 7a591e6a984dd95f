"""Routing a request's model name to what serves it: the base, an adapter version, an alias, an A/B arm, or the
version a session started on; and the sticky A/B hash under it.

:class:`ModelRouter` is the one decision, shared by every generating API and by agent runs (``router(model,
session, user)``; the version it returns is acquired, and the caller releases it when the request ends):

- the base model's name: the base (``None``); ``family@N``: that version;
- a family a learner trains, before its first champion (no alias yet): the base model serves it;
- an alias with a running A/B experiment: the request's arm (sticky by session or user, see below); a request
  without a session (``ANONYMOUS``) is its own unit of randomisation, so it draws a fresh key; an arm unloaded
  mid-experiment falls back to the champion;
- otherwise the alias's current version, except that a session stays on the version it started on while that
  version is loaded. Sessions are the clients' names, so a pin belongs to the caller's owner (``X-Session-Id: s``
  of one key never pins what ``s`` of another key gets), and each owner has its own 100,000 most recently used
  pins (one key sending a million session names forgets only its own).

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

Not here: which experiments exist and which arm a key gets (``runtime.adapters.experiments``), loading and
acquiring versions (``runtime.adapters.registry``), deciding an experiment (``runtime.adapters.experiment_stats``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import uuid
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from learner.records import PUBLIC_OWNER
from runtime.adapters.names import AdapterNotFound, AdapterRef, parse_model_name
from runtime.adapters.registry import AdapterRegistry
from runtime.recorder import ANONYMOUS

__all__ = ["Arm", "ModelRouter", "assign_arm", "unit_interval"]

MAX_PINS = 100_000  # sessions whose starting version is remembered, per owner


class ArmChooser(Protocol):
    """What routing asks of the A/B experiments (``runtime.adapters.experiments.Experiments``)."""

    def route(self, family: str, session_key: str, user_key: str | None) -> str | None: ...


class ModelRouter:
    """The routing decision of the module docstring, with the sessions' pinned versions."""

    def __init__(self, registry: AdapterRegistry, experiments: ArmChooser | None, model_id: str, learner_families: Collection[str] = ()) -> None:
        self.registry = registry
        self.experiments = experiments
        self.model_id = model_id
        self.learner_families = learner_families
        self._pins: dict[str, OrderedDict[tuple[str, str], str]] = {}  # owner -> (session, family) -> version it started on

    def __call__(self, model: str, session: str, user: str | None = None, owner: str = PUBLIC_OWNER) -> AdapterRef | None:
        """The version serving ``model`` for ``owner``'s ``session`` (acquired), or None for the base; ``AdapterNotFound``
        when none."""
        kind, target = parse_model_name(model, self.model_id)
        if kind == "base":
            return None
        assert target is not None
        if kind == "version":
            return self.registry.acquire(target)
        if target in self.learner_families and target not in self.registry.aliases():
            return None  # a family a learner trains, before its first champion: the base model serves it
        # a request without a session (no X-Session-Id, no `user`) is its own unit of randomisation: hashing the one
        # anonymous key would send every such request to the same arm, and the experiment could never compare its arms
        arm_key = session if session != ANONYMOUS else uuid.uuid4().hex
        arm = self.experiments.route(target, arm_key, user) if self.experiments is not None else None
        if arm is not None:
            with contextlib.suppress(AdapterNotFound):  # an arm unloaded mid-experiment: serve the champion
                return self.registry.acquire(arm)
        # no experiment: a session stays on the version it started on while that version is loaded
        if session == ANONYMOUS:
            return self.registry.acquire(target)
        pins, pin = self._pins.setdefault(owner, OrderedDict()), (session, target)
        if (pinned := pins.get(pin)) is not None:
            with contextlib.suppress(AdapterNotFound):
                ref = self.registry.acquire(pinned)
                pins.move_to_end(pin)
                return ref
        ref = self.registry.acquire(target)
        pins[pin] = ref.name
        pins.move_to_end(pin)
        while len(pins) > MAX_PINS:
            pins.popitem(last=False)
        return ref

    def forget_session(self, owner: str, session: str) -> None:
        """Drop ``owner``'s pins of ``session`` (the session was deleted: a new one of that name starts afresh)."""
        pins = self._pins.get(owner)
        if pins:
            for pin in [p for p in pins if p[0] == session]:
                del pins[pin]


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
