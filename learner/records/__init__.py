"""The wire types of recorded interactions: sessions, trajectories, turns and rewards (pydantic only).

These are the contract between the runtime (which writes them), the interaction store (which keeps
them) and the learner (which trains on them). Importing this module never imports torch.

A **turn** is one engine call: the exact context token ids the engine was given, the output token ids
it produced (including a final eos), their sampling logprobs and a loss mask (1 = a model token to
train on). Training never re-tokenizes ``messages``/``output_text``; those are for people to read.
A turn of a self-verifying agent also carries its parsed self-check and the verifier's judgment of its
answer (``TurnCheck``), so per-turn rewards (``learner/svr_rewards.py``) are computed from the store.
A **trajectory** is a chain of turns of one conversation (see ``runtime/recorder.py`` for stitching);
``parent_turn_id`` links a turn to the turn it continues, also across branches.
A **reward** targets a turn or a trajectory and says where it came from (``feedback``,
``verifier:<name>``, ``self-verdict``, ...).
Every record has an **owner**: the identity of the API key that made it (``key-<hash>``, see
``runtime/identity.py``), or ``public`` on a server without keys. Sessions are named per owner, and a
reward's owner is the owner of what it rewards.

Two rules that every reader of rewards applies alike, the learner when it trains and the runtime's A/B
experiments when they judge (so an experiment decides on the rewards its learner trains on):
:func:`source_rank` (a reward source's precedence under shell patterns; one rank per group) and
:func:`owner_quota` (how many of its records one owner may contribute under a share bound).

Not here: storage (``learner/records/store.py``) or how samples are built for training.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import time
import uuid
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PUBLIC_OWNER = "public"  # the owner of everything on a server without API keys
ADMIN_OWNER = "admin"  # the owner of what the admin API does itself (the learner's own runs); never a key's hash


class UnknownTarget(LookupError):
    """A reward names a turn or trajectory that is not in the store (or is another owner's: the same answer)."""


class TooManyRewards(ValueError):
    """The target already holds as many rewards as a client may give it (``add_reward``'s ``max_per_target``)."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def context_sha256(ids: Sequence[int]) -> str:
    """The id of an exact context: sha256 of its token ids as little-endian int32.

    Re-rollouts check it (a branch's rebuilt context must match the recorded one) and the learner keys
    RTPO sibling sets and GiGPO anchors on it."""
    a = array("i", ids)
    if a.itemsize != 4 or array("i", [1]).tobytes() != b"\x01\x00\x00\x00":
        raise RuntimeError("context_sha256 needs 4-byte little-endian C ints")
    return hashlib.sha256(a.tobytes()).hexdigest()


LEARNER_SOURCE_PREFIX = "learner:"  # the learner's scores of its own groups (group completion): training data, never A/B evidence
RESERVED_SOURCES = (
    "verifier:",
    "judge:",
    "hook:",
    "memory:",
    LEARNER_SOURCE_PREFIX,
)  # the runtime's evaluators, judges and reward hooks, memory credit, the learner's own scores; never a client's word
PROCESS_SUFFIX = ":process"  # an agent task's per-turn process scores: ``<outcome source>:process`` (agents/loop.py)


def source_rank(source: str, patterns: Sequence[str]) -> int | None:
    """The precedence of a reward source under ``patterns`` (shell patterns, best first): the index of the first
    pattern it matches; None when it matches none (such a reward never counts)."""
    return next((i for i, p in enumerate(patterns) if fnmatch.fnmatchcase(source, p)), None)


def owner_quota(counts: Mapping[str, int], max_share: float) -> dict[str, int]:
    """How many of its records each owner keeps so that no owner exceeds ``max_share`` of what is kept.

    With K owners present the bound is ``max(max_share, 1/K)`` (a lone owner, or equal ones, are never cut). Each owner
    keeps ``min(n_o, c)`` for the largest integer cap ``c`` with ``c <= share * sum_o min(n_o, c)``: water-filling, so
    the owners under the cap keep everything and the largest ones are cut down to one common cap. ``g(c) = share *
    sum_o min(n_o, c) - c`` is concave with ``g(0) = 0``, so the feasible caps are an interval ``[0, c*]`` and a
    binary search finds ``c*``. Callers keep each owner's *oldest* records up to its quota, so the kept set only grows
    as data arrives (a sequential test's observations are never taken back)."""
    if not 0.0 < max_share <= 1.0:
        raise ValueError(f"max_share must be in (0, 1], got {max_share}")
    present = {o: n for o, n in counts.items() if n > 0}
    if not present:
        return {o: 0 for o in counts}
    share = max(max_share, 1.0 / len(present))
    lo, hi = 0, max(present.values())
    while lo < hi:  # the largest c with g(c) >= 0
        mid = (lo + hi + 1) // 2
        if mid <= share * sum(min(n, mid) for n in present.values()) + 1e-9:
            lo = mid
        else:
            hi = mid - 1
    cap = max(lo, 1)
    return {o: min(n, cap) for o, n in counts.items()}


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ToolCallRecord(_Record):
    id: str
    name: str
    arguments: str  # the JSON string as returned to the client


class TurnTimings(_Record):
    queued_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0


class TurnCheck(_Record):
    """A self-verifying turn's parsed self-check (``svr`` / ``svr_r1`` formats, ``agents/stop.py``) and the verifier's
    judgment of the answer it states, recorded with the turn so per-turn rewards and calibration reports come from the store.

    ``solution`` is the answer the turn states (the parsed ``<solution>``/``<answer>``; the extracted text when the turn
    did not parse); ``verdict``/``confidence`` are what parsed (``format_ok`` False: not all of it did, ``error`` says
    why); ``correct`` is the task verifier on ``solution`` (None when the run named no task problem)."""

    format: Literal["svr", "svr_r1"]
    solution: str | None = None
    verdict: Literal["correct", "incorrect"] | None = None
    confidence: float | None = Field(None, ge=0.0, le=1.0)  # svr only
    format_ok: bool = False
    error: str | None = None
    correct: bool | None = None

    @property
    def p_correct(self) -> float | None:
        """The stated P(correct): confidence after Correct, 1 − confidence after Incorrect; svr_r1 Yes → 1, No → 0."""
        if not self.format_ok or self.verdict is None:
            return None
        if self.confidence is None:
            return 1.0 if self.verdict == "correct" else 0.0
        return self.confidence if self.verdict == "correct" else 1.0 - self.confidence


class Turn(_Record):
    turn_id: str
    trajectory_id: str
    session_id: str
    index: int = Field(ge=0, description="position of this turn in its trajectory")
    parent_turn_id: str | None = None
    completion_id: str
    choice_index: int = 0
    created_at: float = Field(default_factory=time.time)
    model: str
    adapter: str | None = None  # the adapter version that produced it; None = the base model
    context_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    sampling: dict[str, Any] = Field(default_factory=dict)
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    finish_reason: str
    timings: TurnTimings = Field(default_factory=TurnTimings)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    output_text: str = ""
    continuation_key: str = ""  # hash of messages + this turn's reply, for stitching the next request
    prefix_key: str = ""  # hash of the messages this turn answered
    owner: str = PUBLIC_OWNER  # the identity of the key that made it
    self_check: TurnCheck | None = None  # svr / svr_r1 turns: the parsed self-check and the verifier's per-turn correctness

    @model_validator(mode="after")
    def _aligned(self) -> Turn:
        n = len(self.output_ids)
        if len(self.loss_mask) != n or (self.logprobs and len(self.logprobs) != n):
            raise ValueError(f"output_ids ({n}), logprobs ({len(self.logprobs)}) and loss_mask ({len(self.loss_mask)}) must align")
        return self


class Trajectory(_Record):
    trajectory_id: str
    session_id: str
    owner: str = PUBLIC_OWNER
    created_at: float = Field(default_factory=time.time)
    # set by agent runs: agent, task, task_key, stop_reason, trainable (False when the prefix invariant broke), ...
    meta: dict[str, Any] = Field(default_factory=dict)
    turns: list[Turn] = Field(default_factory=list)
    rewards: list[Reward] = Field(default_factory=list)


class Session(_Record):
    session_id: str  # the client's session key (``user`` field or ``X-Session-Id``), or a generated ``anon-…``
    owner: str = PUBLIC_OWNER  # sessions are named per owner
    created_at: float = Field(default_factory=time.time)


class Reward(_Record):
    reward_id: str = Field(default_factory=lambda: new_id("rwd"))
    target: Literal["turn", "trajectory"]
    target_id: str
    value: float
    source: str = "feedback"
    created_at: float = Field(default_factory=time.time)
    comment: str | None = None
    idempotency_key: str | None = None  # unique per owner
    owner: str = PUBLIC_OWNER  # who gave it: always the owner of its target (the store checks)

    @field_validator("value")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reward must be a finite number")
        return v


Trajectory.model_rebuild()


class TurnRef(_Record):
    """Where a recorded turn sits, for stitching the next request onto it."""

    turn_id: str
    trajectory_id: str
    session_id: str
    index: int
    has_successor: bool  # a later turn already continues it (a new continuation is a branch)
