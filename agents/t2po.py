"""T²PO at inference and in rollouts: token-level thinking intervention and turn-level resampling.

T²PO: Wang et al. 2026, arXiv 2605.02178, code github.com/WillDreamer/T2PO; what is ours: ``docs/methods.md``.

Both are pure decisions over token uncertainties that the agent loop computes from the engine's
per-token top-k logprobs (``runtime.engine.TokenLogprob.top``, best first). Both are switches of an
agent (``T2POConfig``), off by default; the loop counts what fired in ``T2POCounters``.

Token level (our reading: the public T²PO code does not contain it). While the model is thinking,
feed each token's top-k to a ``ThinkingMonitor``. It keeps ``ubar_k`` = mean entropy of the last
``window`` tokens and fires at the first token ``k`` (0-based) where

    k + 1 ≥ max(min_tokens, 2·window)   and   |ubar_k − ubar_{k−window}| < threshold

i.e. the mean uncertainty of the latest window barely differs from the window before it (the thinking
has stopped reducing uncertainty), or, with a ``budget``, when ``budget`` thinking tokens are reached.
A token is a thinking token when the think span is open in the output up to and including it (so the
token that completes ``<think>`` counts, the one that completes ``</think>`` does not). The loop then
keeps the output up to and including token ``k`` — exactly that token, wherever the engine's stream
chunks end (``thinking_tokens`` and ``chunk_cut`` take a chunk of several tokens one token at a time) —,
appends ``intervention_text()`` (closes the think span and cues the answer) as forced tokens (not
sampled: mask them out of training), and continues decoding the action. The monitor fires at most once.

Turn level (the T²PO code's ``T2PO_multi_turn_loop``): a turn's score is its mean token uncertainty
(``turn_uncertainty``; its producer is our reading, the code only consumes it). From the second turn on, a
turn is regenerated from the same context while ``0 < |u_t − u_{t−1}| < eta`` (absolute difference, as
in the code; Δ = 0 is excluded on purpose there), at most ``max_try`` times; the last regeneration is
kept even if it would still qualify, and its score becomes ``u_{t−1}`` for the next turn. Each
regeneration is a new sample from the same distribution, so it draws a fresh seed (``resample_seed``):
none in an unseeded run (the engine's own randomness, as the first draft), else one derived from the
run's seed, the turn and the draft number — reproducible, and distinct from every other draft's.

Not here: generating, cancelling or re-submitting requests (the agent loop), recording, training.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field

TopK = Sequence[tuple[int, float]] | Sequence[float]

# ── Token uncertainty ──────────────────────────────────────────────────────────────────────────────────


def token_entropy(top_logprobs: TopK) -> float:
    """Entropy (nats) of one token's distribution, estimated from its top-k logprobs.

    ``top_logprobs``: ``(token_id, logprob)`` pairs (as ``TokenLogprob.top``) or bare logprobs.
    Truncation: the top-k probabilities are renormalised to sum to 1 and the tail is ignored, so the
    value is the entropy of the top-k conditional distribution — at most ``log k``, and 0 for k = 1.
    It underestimates flat distributions (true entropy above ``log k``) and is exact when the top-k
    mass is ~1; for a sliding-window *change* detector the bias largely cancels. Ask the engine for
    k ≥ 2 (``T2POConfig.top_logprobs``, default 20). ``-inf`` entries have zero probability.
    Raises ValueError on an empty sequence or a NaN/+inf logprob (an engine bug, not a model state).
    """
    if len(top_logprobs) == 0:
        raise ValueError("token_entropy needs at least one top logprob (request top_logprobs >= 1)")
    first = top_logprobs[0]
    lps = [float(x[1]) for x in top_logprobs] if isinstance(first, tuple | list) else [float(x) for x in top_logprobs]  # type: ignore[index,arg-type]
    for lp in lps:
        if math.isnan(lp) or lp == math.inf:
            raise ValueError(f"invalid logprob {lp!r}")
    finite = [lp for lp in lps if lp != -math.inf]
    if not finite:
        raise ValueError("all top logprobs are -inf")
    m = max(finite)
    log_z = m + math.log(math.fsum(math.exp(lp - m) for lp in finite))
    h = -math.fsum(math.exp(lp - log_z) * (lp - log_z) for lp in finite)
    return max(h, 0.0)  # rounding can give -1e-17 for k = 1


def token_uncertainty(logprob: float, top_logprobs: TopK = ()) -> float:
    """A token's uncertainty: its top-k entropy, or, without top-k, its surprisal ``-logprob`` (§11's fallback)."""
    if len(top_logprobs) > 0:
        return token_entropy(top_logprobs)
    if math.isnan(logprob):
        raise ValueError("invalid logprob nan")
    return -logprob


# ── Token level: thinking intervention ─────────────────────────────────────────────────────────────────

THINK_CLOSE = "</think>"
INTERVENTION_TEXT = "\n</think>\n"  # a reading: "</think>\n<action>" would also do; the open tag depends on the format


def intervention_text(action_open_tag: str | None = None) -> str:
    """The forced text appended at the cut: close the think span, then optionally open the action tag
    (e.g. ``"solution"`` for svr, ``"answer"`` for svr_r1) so the model goes straight to acting."""
    return INTERVENTION_TEXT + (f"<{action_open_tag}>" if action_open_tag else "")


def thinking_open(text: str, *, prefilled: bool = False) -> bool:
    """Whether ``text`` (the output so far) ends inside a think span: its last ``<think>`` is not closed.

    ``prefilled``: the prompt already opened the span, so text with no tag at all is thinking."""
    opened, closed = text.rfind("<think>"), text.rfind(THINK_CLOSE)
    if opened < 0 and closed < 0:
        return prefilled
    return opened > closed


class ThinkingMonitor:
    """Fed one thinking token at a time; ``update`` returns True exactly once, at the token to cut after.

    See the module docstring for the rule. ``enabled=False`` makes every update return False without
    looking at its argument (the switch off). ``fired_at`` is the 0-based index of that token and
    ``reason`` is ``"plateau"`` or ``"budget"``.
    """

    def __init__(self, window: int = 32, threshold: float = 0.05, min_tokens: int = 64, budget: int | None = None, *, enabled: bool = True) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not threshold >= 0.0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        if budget is not None and budget < 1:
            raise ValueError(f"budget must be >= 1 or None, got {budget}")
        self.window, self.threshold, self.min_tokens, self.budget, self.enabled = window, threshold, min_tokens, budget, enabled
        self.entropies: list[float] = []
        self._prefix: list[float] = [0.0]  # _prefix[n] = sum of the first n entropies
        self.fired_at: int | None = None
        self.reason: str | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.entropies)

    @property
    def fired(self) -> bool:
        return self.fired_at is not None

    def update(self, top_logprobs: TopK) -> bool:
        """Feed one token's top-k logprobs; True when the loop should intervene after this token."""
        if not self.enabled or self.fired:
            return False
        return self.update_entropy(token_entropy(top_logprobs))

    def update_entropy(self, entropy: float) -> bool:
        """Feed one token's uncertainty directly (e.g. ``token_uncertainty`` without top-k)."""
        if not self.enabled or self.fired:
            return False
        self.entropies.append(entropy)
        self._prefix.append(self._prefix[-1] + entropy)
        n, w = len(self.entropies), self.window
        if n >= max(self.min_tokens, 2 * w):
            cur = (self._prefix[n] - self._prefix[n - w]) / w
            prev = (self._prefix[n - w] - self._prefix[n - 2 * w]) / w
            if abs(cur - prev) < self.threshold:
                self.fired_at, self.reason = n - 1, "plateau"
                return True
        if self.budget is not None and n >= self.budget:
            self.fired_at, self.reason = n - 1, "budget"
            return True
        return False

    def reset(self) -> None:
        """Start a new thinking span (a new turn)."""
        self.entropies.clear()
        self._prefix = [0.0]
        self.fired_at = self.reason = None


def should_intervene(
    entropies: Sequence[float], window: int = 32, threshold: float = 0.05, min_tokens: int = 64, budget: int | None = None
) -> int | None:
    """The 0-based index of the token after which ``ThinkingMonitor`` would intervene, or None."""
    monitor = ThinkingMonitor(window, threshold, min_tokens, budget)
    for h in entropies:
        if monitor.update_entropy(h):
            return monitor.fired_at
    return None


_TAG_TAIL = len(THINK_CLOSE) - 1  # characters of the text before a chunk that a tag ending in the chunk can start in


def thinking_tokens(text_before: str, chunk_text: str, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> list[bool]:
    """Which of a stream chunk's tokens ``token_ids`` are thinking tokens: token ``j`` is one when ``thinking_open``
    holds for the output up to and including it.

    ``text_before``: the output's text before the chunk; ``chunk_text``: the chunk's text; ``decode``: the text of some
    of the chunk's first tokens, asked for only when a ``<think>`` or ``</think>`` tag ends inside the chunk (otherwise
    every token of the chunk is in the same state, the one after the chunk)."""
    n = len(token_ids)
    tail = text_before[-_TAG_TAIL:] + chunk_text
    if "<think>" not in tail and THINK_CLOSE not in tail:
        return [thinking_open(text_before + chunk_text)] * n
    return [thinking_open(text_before + (chunk_text if j == n - 1 else decode(token_ids[: j + 1]))) for j in range(n)]


def chunk_cut(monitor: ThinkingMonitor, logprobs: Sequence[tuple[float, TopK]], thinking: Sequence[bool]) -> int | None:
    """Feed a stream chunk's thinking tokens to ``monitor`` one at a time, in order; the index in the chunk of the
    token it fires at (the output is cut right after it, not at the chunk's end), else None.

    ``logprobs``: each token's ``(logprob, top-k)``; ``thinking``: ``thinking_tokens`` of the chunk. Tokens that are
    not thinking are not fed (their uncertainty is not even computed)."""
    for j, ((lp, top), th) in enumerate(zip(logprobs, thinking, strict=True)):
        if th and monitor.update_entropy(token_uncertainty(lp, top)):
            return j
    return None


# ── Turn level: resampling ─────────────────────────────────────────────────────────────────────────────


def turn_uncertainty(entropies: Sequence[float]) -> float:
    """A turn's score ``u_t``: the mean token uncertainty of its response; 0.0 for an empty response."""
    return math.fsum(entropies) / len(entropies) if len(entropies) else 0.0


def should_resample(prev_turn_u: float | None, cur_turn_u: float, eta: float, tries_so_far: int, max_try: int) -> bool:
    """Regenerate the current turn? True iff there is a previous turn, ``tries_so_far < max_try`` and
    ``0 < |cur − prev| < eta``. Δ is absolute (the code's ``abs``): a small drop counts like a small rise."""
    if prev_turn_u is None or tries_so_far >= max_try:
        return False
    delta = abs(cur_turn_u - prev_turn_u)
    return 0.0 < delta < eta


RESAMPLE_SEEDS = (2**62, 2**63)  # [low, high): above every first-draft seed (run seed · 1000 + turn, run seeds below 4.6e15); int64
MAX_RUN_SEED = RESAMPLE_SEEDS[0] // 1000 - 1  # a run's seed: its turns' seeds (seed · 1000 + turn) stay below RESAMPLE_SEEDS


def resample_seed(run_seed: int | None, turn: int, draft: int) -> int | None:
    """The sampling seed of turn ``turn``'s ``draft``-th regeneration (``draft >= 1``; draft 0 is the turn's own seed).

    A regeneration is a fresh sample from the same context, so it never reuses a seed: None when the run has no
    seed (every draft of an unseeded run draws from the engine's own randomness), else a 62-bit hash of
    ``(run_seed, turn, draft)`` placed in ``RESAMPLE_SEEDS`` — the same on every rerun of that run, disjoint from the
    first drafts' seeds, and distinct from every other regeneration's unless two 62-bit hashes collide (for n
    regenerations, probability about n²/2⁶³)."""
    if draft < 1:
        raise ValueError(f"draft must be >= 1 (a regeneration), got {draft}")
    if run_seed is None:
        return None
    digest = hashlib.sha256(f"t2po-resample\0{run_seed}\0{turn}\0{draft}".encode()).digest()
    low, high = RESAMPLE_SEEDS
    return low + int.from_bytes(digest[:8], "big") % (high - low)


# ── Configuration and counters ─────────────────────────────────────────────────────────────────────────


class T2POConfig(BaseModel):
    """An agent's T²PO switches and knobs. Defaults: the T²PO code's where it fixes them, else our reading (marked)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    thinking_intervention: bool = Field(False, description="Cut thinking when the windowed uncertainty plateaus (token level).")
    turn_resample: bool = Field(False, description="Regenerate turns whose uncertainty barely moved from the previous turn (turn level).")
    window: int = Field(32, ge=1, description="(reading) tokens per sliding window of the thinking monitor.")
    threshold: float = Field(0.05, ge=0.0, description="(reading) nats; intervene when |windowed mean change| falls below this.")
    min_tokens: int = Field(64, ge=0, description="(reading) never intervene before this many thinking tokens (and never before 2·window).")
    think_budget: int | None = Field(
        500, ge=1, description="(T²PO code) num_think_tokens default 500: intervene at this many thinking tokens at the latest; None: no budget."
    )
    eta: float = Field(0.3, gt=0.0, description="(T²PO code) eta_threshold: resample when 0 < |Δu| < eta.")
    max_try: int = Field(2, ge=0, description="(T²PO code) TDS.max_try in all scripts: regenerations per turn at most.")
    top_logprobs: int = Field(20, ge=1, description="(reading) top-k logprobs to request per token for the entropy estimate (OpenAI's maximum).")

    def new_monitor(self) -> ThinkingMonitor:
        """A monitor for one thinking span; disabled (never fires) when ``thinking_intervention`` is off."""
        return ThinkingMonitor(self.window, self.threshold, self.min_tokens, self.think_budget, enabled=self.thinking_intervention)

    def resample(self, prev_turn_u: float | None, cur_turn_u: float, tries_so_far: int) -> bool:
        """``should_resample`` with this config's ``eta``/``max_try``; always False when ``turn_resample`` is off."""
        return self.turn_resample and should_resample(prev_turn_u, cur_turn_u, self.eta, tries_so_far, self.max_try)


@dataclass
class T2POCounters:
    """What T²PO did in one trajectory, for the trajectory record and metrics."""

    interventions: int = 0  # thinking spans cut by the monitor
    resamples: int = 0  # turn regenerations (discarded drafts)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
