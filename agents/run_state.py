"""One agent run's state, its phases, and the one rule that says when it ends (``agents/loop.py`` runs the phases).

What it does:

- ``RunState``: everything one run changes while it goes (the messages, the context ids and their prefix
  check, the turn history, the recorded steps, token counts, the environment's rewards) and the facts the
  phases find that can end it (a call to a client's tool, the environment's episode ending, the stop
  policy's decision, a replayed turn that would have ended the backbone).
- ``Phase``: one turn is ``BEGIN`` (context rewrite, room and budget) → ``GENERATE`` (sample or replay,
  record, parse tool calls) → ``SCORE`` (the task's per-turn process score) → ``ACT`` (run tools, step the
  environment or ask the stop policy) → ``OBSERVE`` (the observation tokens; the next context), or for a
  branch's replayed turn ``REPLAY`` (what the record says followed) instead of ``ACT`` and ``OBSERVE``.
- ``ending(state, phase)``: the one place a run's end is decided, before each phase is entered. The reasons
  are ``client_tool_call``, a replayed turn's ending, ``env_done``, the stop policy's own reason, ``paused`` (a
  PATR segment sampled its turns), ``max_turns``, ``context_full`` and ``token_budget`` (those two end with
  finish reason ``length``).
- The parts a run is made of: ``Branch`` (start at a turn of a recorded trajectory) and ``Segment`` (sample a few
  turns, then pause), what the caller fixes for the run; ``ContextTracker`` (the running context ids and the prefix
  invariant: every next context extends the last one); ``StepRecord`` with its ``ToolEvent`` values (one turn as the
  runs endpoint reports it). ``agents/loop.py``'s docstring says what branches, segments and the invariant mean.

What it does not: call the model, run tools or record turns (``agents/loop.py``), or decide whether an
answer is good enough (the stop policies, ``agents/policies.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from learner.records import Turn, context_sha256

if TYPE_CHECKING:
    from agents.stop import StopDecision, StopPolicy, TurnView
    from agents.t2po import T2POCounters
    from agents.tasks import Env, Problem
    from runtime.agent_api import Lease
    from runtime.engine import GenerateResult, Grammar

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Branch:
    """Start a run at turn ``turn`` of a recorded trajectory (``agents/loop.py``'s docstring: re-rollouts)."""

    backbone: tuple[Turn, ...]  # the recorded turns 0..turn (at least), as the store holds them
    turn: int  # the branch turn: turns 0..turn-1 are replayed from ``backbone``, sampling starts here
    of: str | None = None  # the backbone's trajectory id
    kind: str = "rtpo"  # why the learner branched (recorded as meta ``rerollout``)
    pending: tuple[dict[str, Any], ...] | None = None  # continuing a paused path (turn == len(backbone)): what followed its last turn

    @property
    def parent_turn_id(self) -> str | None:
        """The backbone's turn ``turn - 1`` (the first sampled turn's parent)."""
        return self.backbone[self.turn - 1].turn_id if self.turn else None

    @property
    def context_sha256(self) -> str | None:
        """The id of the backbone's context at the branch turn (recorded as meta ``anchor``); None when continuing a paused path."""
        return context_sha256(self.backbone[self.turn].context_ids) if self.turn < len(self.backbone) else None


@dataclass(frozen=True)
class Segment:
    """Sample at most ``turns`` turns, then pause (``agents/loop.py``'s docstring: segments); ``tree`` is the PATR tree's id."""

    tree: str
    turns: int = 1


@dataclass
class ToolEvent:
    call_id: str
    name: str
    arguments: str
    content: str
    ok: bool
    error_kind: str | None = None
    flags: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


@dataclass
class StepRecord:
    """One turn of a run as the runs endpoint reports it."""

    index: int
    turn_id: str
    text: str
    output_tokens: int
    finish_reason: str
    tool_calls: list[ToolEvent] = field(default_factory=list)
    observation: str | None = None  # the user message appended after this turn (feedback or env observation)
    decision: str | None = None  # the stop policy's reason
    verdict: str | None = None  # the parsed self-check verdict (svr / svr_r1)
    confidence: float | None = None
    correct: bool | None = None  # svr / svr_r1 with a task problem: the verifier on this turn's stated answer
    format_failure: bool = False
    process_score: float | None = None
    uncertainty: float | None = None
    intervened: bool = False  # T²PO cut this turn's thinking
    drafts_discarded: int = 0  # T²PO regenerations of this turn
    replayed: bool = False  # a branch's replayed backbone turn (not sampled, not recorded)
    info: dict[str, Any] | None = (
        None  # the environment's structured report of this turn (its EnvStep.info: for kernels compiled, correct, speedup, ...)
    )


class ContextTracker:
    """The running context ids and the prefix invariant: every next context extends the last one."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids: list[int] = list(ids)
        self.broken_at: int | None = None

    def advance(self, turn: int, output_ids: Sequence[int], next_ids: Sequence[int]) -> None:
        """Move to ``next_ids``, the context of turn ``turn + 1``; it must start with context + output."""
        expected = self.ids + list(output_ids)
        if list(next_ids[: len(expected)]) != expected and self.broken_at is None:
            self.broken_at = turn + 1
            log.warning("prefix invariant broken; trajectory marked untrainable", turn=turn + 1)
        self.ids = list(next_ids)

    @property
    def intact(self) -> bool:
        return self.broken_at is None


class Phase(enum.Enum):
    BEGIN = "begin"
    GENERATE = "generate"
    SCORE = "score"
    REPLAY = "replay"
    ACT = "act"
    OBSERVE = "observe"


@dataclass(frozen=True)
class Stop:
    """Why a run ended; ``answered``: the last turn's output is the run's final assistant message."""

    reason: str
    finish: str = "stop"  # OpenAI's finish reason for the run: "length" when a budget ended it
    answered: bool = False


@dataclass
class RunState:
    """One run, as the phases of ``AgentLoop`` leave it (module docstring)."""

    # fixed for the run
    run_id: str
    trajectory_id: str
    request_id: str
    session_id: str
    lease: Lease
    policy: StopPolicy
    problem: Problem | None
    env: Env | None
    branch: Branch | None
    max_turns: int
    seed: int | None
    grammar: Grammar | None
    t0: float
    # the conversation so far
    msgs: list[dict[str, Any]]
    ctx: ContextTracker
    prompt_tokens: int
    counters: T2POCounters
    history: list[TurnView] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    state_keys: list[str | None] = field(default_factory=list)
    turn: int = 0
    completion_tokens: int = 0
    replayed_tokens: int = 0  # a branch's replayed turns count against the budget, not as completion tokens
    drift_turns: int = 0
    parent: str | None = None  # the last recorded turn
    prev_u: float | None = None  # the last turn's uncertainty (T²PO resampling)
    branched: bool = True  # False until a branch reaches its branch turn
    env_reward: float = 0.0
    env_info: dict[str, Any] = field(default_factory=dict)
    segment: Segment | None = None  # a PATR segment: pause at turn pause_at
    pause_at: int | None = None
    pending: list[dict[str, Any]] = field(default_factory=list)  # the observations after the last turn (what a pause records)
    # the current turn
    room: int = 0  # tokens left in the context window
    budget: int = 0  # tokens left in the run's token budget
    res: GenerateResult | None = None
    mask: list[int] | None = None  # the turn's loss mask (None: all ones)
    forced: bool = False  # a branch's replayed turn
    calls: list[Any] = field(default_factory=list)  # the turn's parsed tool calls
    observations: list[dict[str, Any]] = field(default_factory=list)
    # facts that end the run (``ending``)
    client_calls: list[Any] = field(default_factory=list)  # calls to the client's tools: the client runs them
    client_text: str = ""  # the text around those calls: the run's answer
    replay_end: str | None = None  # a replayed turn that would have ended the backbone (refused after the run)
    env_done: bool = False
    decision: StopDecision | None = None  # the stop policy's latest decision (None after an environment's turn)
    # how it ended
    stop_reason: str = "max_turns"
    finish: str = "stop"

    @property
    def step(self) -> StepRecord:
        return self.steps[-1]

    @property
    def text(self) -> str:
        assert self.res is not None
        return self.res.text


def ending(s: RunState, phase: Phase) -> Stop | None:
    """Whether the run ends before entering ``phase``, and why: the one place a run's termination is decided."""
    if s.client_calls:
        return Stop("client_tool_call", answered=True)
    if s.replay_end is not None:
        return Stop(s.replay_end, answered=True)
    if s.env_done:
        return Stop("env_done", answered=True)
    if s.decision is not None and s.decision.stop:
        return Stop(s.decision.reason, answered=True)
    if phase is Phase.BEGIN and s.pause_at is not None and s.turn >= s.pause_at and s.turn < s.max_turns:
        return Stop("paused")
    if phase is Phase.BEGIN and s.turn >= s.max_turns:
        return Stop("max_turns")
    if phase is Phase.GENERATE and s.room < 2:
        return Stop("context_full", finish="length")
    if phase is Phase.GENERATE and s.budget < 1:
        return Stop("token_budget", finish="length")
    return None
