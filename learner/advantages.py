"""Advantage estimators: registered pure functions from turn samples to one scalar advantage per turn.

What it does
    Every estimator takes a sequence of :class:`TurnSample` (one turn of one trajectory) and returns one
    advantage per sample, in the same order, plus :class:`AdvantageStats`. Groups are formed from explicit
    ids (``group_id``, ``trajectory_id``, ``turn_index``, ``anchor``), never by reshape. Call sites go
    through the registry::

        adv = compute_advantages("grpo", samples, norm_by_std=True)   # list[float] with .stats
        adv.stats.n_excluded, adv.stats.frac_reward_zero_std

    Registered (sources and readings: ``docs/methods.md``):
    ``grpo``, ``drgrpo``, ``rloo``, ``gigpo``, ``turn_grpo`` (per turn index across a group, the
    MemoPilot/SVR reading), ``rtpo``, ``tcpo``, ``rank`` (LEAP).
    The TCPO pieces (:func:`tcpo_retrospective`, :func:`tcpo_hindsight`, :func:`tcpo_scores`,
    :func:`tcpo_counterfactual`) and LEAP's :func:`rank_wins` are public pure functions too.

The reward stream (one rule for process and outcome rewards; every estimator follows it)
    A trajectory's rewards are its turn rewards ``r_t`` (``TurnSample.reward``: process scores, per-turn
    feedback; a turn without one has ``r_t = 0``) and its outcome ``R`` (``TurnSample.trajectory_reward``),
    which arrives with its last turn: the stream is ``r_0, ..., r_{T-1} + R``. Both always count:
    * a turn's return-to-go (``turn_grpo``, GiGPO's step level, RTPO's sibling returns) is
      ``R_t = sum_{k>=t} gamma^(turn_k - turn_t) r_k`` over the stream and the turns present;
    * a trajectory's score (``grpo``, ``drgrpo``, ``rloo``, GiGPO's episode level, RTPO's un-branched
      turns) is the stream's undiscounted sum ``sum_t r_t + R``: the outcome alone when there are no turn
      rewards (outcome supervision), the turn rewards alone for live traffic rated turn by turn.
    Which sources' rewards are in the stream is the sample builder's choice (``SampleConfig.reward_sources``):
    to train on outcomes only, leave the process source out. Process rewards that are positive on every
    turn favour longer trajectories in both sums; give them mean zero (or ``gamma < 1``) if that matters.

Shared policy
    * A trajectory with neither a turn reward nor an outcome (``None`` or NaN), or with a NaN turn reward,
      is *excluded*: advantage 0.0, left out of every baseline, counted in ``stats.n_excluded``.
      ``+-inf`` rewards are an input error.
    * A normalisation group with fewer than two valid members, or whose std is at most
      ``zero_std_tol * max(1, max|value|)`` (so ``[0.1, 0.1 + 5e-13]`` counts), gives exactly 0.0 to every
      member. This deliberately differs from verl, where a singleton group gets mean 0 / std 1 (its raw
      reward): live traffic has singletons, and a lone reward carries no relative signal.
    * std is the unbiased sample std (``torch.std``, as verl and TRL use); ``A = (x - mean) / (std + eps)``.

What it does not do
    No torch (numpy only, so the runtime side stays light; ``learner/losses.py`` has the torch losses), no
    token-level broadcast (the trainer spreads a turn's scalar over its masked tokens), no rollouts: RTPO
    siblings and TCPO counterfactual scores are produced by the re-rollout code and passed in, which also plans
    them (RTPO's reverse sweep, TCPO's turn selection: ``learner/rerollout.py``). GiGPO's
    similarity-based anchor clustering (difflib) is not implemented; anchors are exact keys.

Readings (RTPO, TCPO and LEAP are known to us from abstracts only: ``docs/methods.md``; these are our choices)
    * rtpo: the sibling set is ``(group_id, anchor)`` where ``anchor`` is the branch-point id (hash of the
      exact stored context); a sibling's return is the return-to-go of its whole continuation (so the
      estimator needs the continuation's turns, not only the branch turn); sets of one fall back, like
      un-branched turns, to trajectory GRPO.
    * tcpo: a turn's score ``v_t`` is its turn reward (the verifier's score of that turn's candidate). A turn
      without one takes the trajectory's outcome if it is the last turn, else ``best_{t-1}`` (no measured
      progress: retrospective credit 0, hindsight credit from later progress), so trajectories with outcome
      rewards only still train; a trajectory with neither is excluded.
    * rank: per trajectory, ``correct``/``score`` of its last turn and the sum of its turns' ``n_tokens``;
      the token tie-break applies between correct participants only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "ADVANTAGES",
    "AdvantageFn",
    "AdvantageInputError",
    "AdvantageStats",
    "Advantages",
    "Estimator",
    "TurnSample",
    "UnknownEstimator",
    "compute_advantages",
    "get_advantage",
    "rank_wins",
    "register_advantage",
    "tcpo_counterfactual",
    "tcpo_hindsight",
    "tcpo_retrospective",
    "tcpo_scores",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]


# Errors: ValueError ▸ AdvantageInputError (inconsistent samples or params); KeyError ▸ UnknownEstimator.
class AdvantageInputError(ValueError):
    """Samples or parameters an estimator cannot use (inconsistent ids, infinite rewards, bad params).

    ``trajectory_ids`` names the samples' trajectories at fault when the error is about them (empty for bad
    parameters), so the learner quarantines those rather than their whole batch (``learner/quarantine.py``)."""

    def __init__(self, message: str, trajectory_ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.trajectory_ids = list(trajectory_ids)


class UnknownEstimator(KeyError):
    """No estimator is registered under that name."""


@dataclass(frozen=True)
class TurnSample:
    """One turn of one trajectory, as the estimators see it (no token ids needed here)."""

    trajectory_id: str
    group_id: str  # task key group (same problem); estimators normalise within a group
    turn_index: int
    reward: float | None  # the turn-level reward if any (process score, TCPO turn score)
    trajectory_reward: float | None  # the outcome reward of its trajectory (NaN/None excluded)
    n_tokens: int = 0  # output tokens (for rank tie-breaks / aggregation)
    correct: bool | None = None  # for rank rewards
    score: float | None = None  # for rank rewards (e.g. speedup)
    # what ``correct``/``score`` describe: this turn's own result ("turn", e.g. one kernel attempt's outcome), or its
    # trajectory's final outcome repeated on each of its turns ("trajectory"); rank's per="turn" ranks only the former
    result_of: Literal["turn", "trajectory"] = "turn"
    anchor: str | None = None  # the exact context's id: RTPO's sibling key (turns that share it were sampled from one context)
    state: str | None = None  # GiGPO's anchor state (the environment's state key, history excluded); None: use ``anchor``


@dataclass(frozen=True)
class AdvantageStats:
    """What an estimator saw: ``n_groups`` counts its normalisation groups that had a valid member."""

    n_samples: int
    n_excluded: int
    n_groups: int
    n_zero_std_groups: int

    @property
    def frac_reward_zero_std(self) -> float:
        """TRL's metric: the fraction of groups whose rewards had zero spread (0.0 when there are none)."""
        return self.n_zero_std_groups / self.n_groups if self.n_groups else 0.0


class Advantages(list[float]):
    """``list[float]`` (one advantage per sample, input order) that also carries the estimator's stats."""

    def __init__(self, values: Sequence[float], stats: AdvantageStats) -> None:
        super().__init__(values)
        self.stats = stats

    @property
    def n_excluded(self) -> int:
        return self.stats.n_excluded


AdvantageFn = Callable[..., tuple[FloatArray, AdvantageStats]]


class Estimator(StrEnum):
    GRPO = "grpo"
    DRGRPO = "drgrpo"
    RLOO = "rloo"
    GIGPO = "gigpo"
    TURN_GRPO = "turn_grpo"
    RTPO = "rtpo"
    TCPO = "tcpo"
    RANK = "rank"


ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator under ``name``; registering a name twice is an error (verl ``register_adv_est``)."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        key = str(name)
        if key in ADVANTAGES and ADVANTAGES[key] is not fn:
            raise ValueError(f"advantage estimator {key!r} is already registered")
        ADVANTAGES[key] = fn
        return fn

    return decorator


def get_advantage(name: str) -> AdvantageFn:
    try:
        return ADVANTAGES[str(name)]
    except KeyError:
        raise UnknownEstimator(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGES)}") from None


def compute_advantages(name: str, samples: Sequence[TurnSample], **params: Any) -> Advantages:
    """One scalar advantage per turn sample, same order; ``.stats`` has the excluded count and zero-std groups."""
    values, stats = get_advantage(name)(samples, **params)
    return Advantages([float(v) for v in values], stats)


# ---------------------------------------------------------------------------------------------------
# Shared vectorised helpers


def _codes(keys: Sequence[Hashable]) -> IntArray:
    """Dense integer codes for hashable keys, in order of first appearance."""
    table: dict[Hashable, int] = {}
    return np.fromiter((table.setdefault(k, len(table)) for k in keys), dtype=np.int64, count=len(keys))


def _float(x: float | None, what: str) -> float:
    """None and NaN -> NaN (excluded); +-inf is an input error."""
    if x is None:
        return math.nan
    v = float(x)
    if math.isinf(v):
        raise AdvantageInputError(f"{what} is infinite; use NaN or None to mark an unscorable sample")
    return v


@dataclass(frozen=True)
class _Batch:
    """Column view of the samples (all arrays have shape (N,))."""

    group: IntArray
    traj: IntArray  # trajectory code; every trajectory lies in exactly one group
    turn: IntArray
    reward: FloatArray  # NaN where None or NaN
    reward_given: BoolArray  # False where reward is None
    traj_reward: FloatArray  # NaN where None or NaN
    n_tokens: IntArray
    score: FloatArray  # the trajectory's score (sum of its reward stream), repeated on each of its turns; NaN = unscorable

    @property
    def n(self) -> int:
        return int(self.group.shape[0])


def _batch(samples: Sequence[TurnSample]) -> _Batch:
    traj_group: dict[str, str] = {}
    traj_reward: dict[str, float] = {}
    seen: set[tuple[str, int]] = set()
    for s in samples:
        tr = _float(s.trajectory_reward, f"trajectory_reward of {s.trajectory_id!r}")
        if traj_group.setdefault(s.trajectory_id, s.group_id) != s.group_id:
            raise AdvantageInputError(f"trajectory {s.trajectory_id!r} appears in two groups", [s.trajectory_id])
        prev = traj_reward.setdefault(s.trajectory_id, tr)
        if not (prev == tr or (math.isnan(prev) and math.isnan(tr))):
            raise AdvantageInputError(f"trajectory {s.trajectory_id!r} has two different trajectory rewards", [s.trajectory_id])
        if (s.trajectory_id, s.turn_index) in seen:
            raise AdvantageInputError(f"trajectory {s.trajectory_id!r} has turn {s.turn_index} twice", [s.trajectory_id])
        seen.add((s.trajectory_id, s.turn_index))
    traj = _codes([s.trajectory_id for s in samples])
    reward = np.array([_float(s.reward, f"reward of {s.trajectory_id!r}") for s in samples], dtype=np.float64)
    given = np.array([s.reward is not None for s in samples], dtype=np.bool_)
    outcome = np.array([_float(s.trajectory_reward, "trajectory_reward") for s in samples], dtype=np.float64)
    return _Batch(
        group=_codes([s.group_id for s in samples]),
        traj=traj,
        turn=np.array([s.turn_index for s in samples], dtype=np.int64),
        reward=reward,
        reward_given=given,
        traj_reward=outcome,
        n_tokens=np.array([s.n_tokens for s in samples], dtype=np.int64),
        score=_scores(traj, reward, given, outcome),
    )


def _scores(traj: IntArray, reward: FloatArray, given: BoolArray, outcome: FloatArray) -> FloatArray:
    """Per sample, its trajectory's score: the sum of its given turn rewards plus its outcome (module docstring: the stream).

    NaN when the trajectory has neither a turn reward nor an outcome, or a given turn reward is NaN."""
    if traj.shape[0] == 0:
        return np.zeros(0, dtype=np.float64)
    n_traj = int(traj.max()) + 1
    turn_sum = np.bincount(traj, weights=np.where(given, reward, 0.0), minlength=n_traj)  # NaN propagates through the sum
    n_given = np.bincount(traj, weights=given.astype(np.float64), minlength=n_traj)
    out_t = np.full(n_traj, np.nan)
    out_t[traj] = outcome  # one value per trajectory (checked equal across its turns)
    has_outcome = ~np.isnan(out_t)
    score = turn_sum + np.where(has_outcome, out_t, 0.0)
    score = np.where((n_given > 0) | has_outcome, score, np.nan)
    return np.asarray(score[traj], dtype=np.float64)


def _check(eps: float, zero_std_tol: float) -> None:
    if not eps > 0 or not zero_std_tol >= 0:
        raise AdvantageInputError(f"need eps > 0 and zero_std_tol >= 0, got eps={eps}, zero_std_tol={zero_std_tol}")


def _normalise(
    values: FloatArray, codes: IntArray, valid: BoolArray, *, norm_by_std: bool, eps: float, zero_std_tol: float
) -> tuple[FloatArray, int, int]:
    """Group-wise ``(x - mean) [/ (std + eps)]`` over valid entries; zero-spread groups and invalid entries -> 0.

    Shapes: values, codes, valid are (N,). Returns (advantages (N,), n_groups, n_zero_std_groups).
    """
    out = np.zeros(values.shape[0], dtype=np.float64)
    if not valid.any():
        return out, 0, 0
    c, x = codes[valid], values[valid]
    n_codes = int(codes.max()) + 1
    count = np.bincount(c, minlength=n_codes).astype(np.float64)  # (n_codes,)
    mean = np.bincount(c, weights=x, minlength=n_codes) / np.maximum(count, 1.0)
    dev = x - mean[c]
    ss = np.bincount(c, weights=dev * dev, minlength=n_codes)
    std = np.sqrt(ss / np.maximum(count - 1.0, 1.0))  # unbiased (ddof=1)
    scale = np.ones(n_codes)
    np.maximum.at(scale, c, np.abs(x))  # max(1, max|x|) per group
    present = count > 0
    zero = present & ((count < 2) | (std <= zero_std_tol * scale))
    adv = dev / (std[c] + eps) if norm_by_std else dev
    adv = np.where(zero[c], 0.0, adv)
    out[valid] = adv
    return out, int(present.sum()), int(zero.sum())


def _first_per_traj(b: _Batch) -> IntArray:
    """Index of the first sample of every trajectory code, shape (n_traj,)."""
    _, first = np.unique(b.traj, return_index=True)
    return first.astype(np.int64)


def _trajectory_normalise(b: _Batch, *, norm_by_std: bool, eps: float, zero_std_tol: float) -> tuple[FloatArray, int, int]:
    """GRPO over trajectories (one entry per trajectory, not per turn), broadcast back to its turns."""
    first = _first_per_traj(b)
    r = b.score[first]
    adv_t, n_g, n_z = _normalise(r, b.group[first], ~np.isnan(r), norm_by_std=norm_by_std, eps=eps, zero_std_tol=zero_std_tol)
    return adv_t[b.traj], n_g, n_z


def _segments(b: _Batch) -> tuple[IntArray, IntArray, IntArray]:
    """Samples sorted by (trajectory, turn): (order (N,), rank from the end of its trajectory (N,), next index (N,))."""
    order = np.lexsort((b.turn, b.traj)).astype(np.int64)
    st = b.traj[order]
    n = b.n
    start = np.r_[True, st[1:] != st[:-1]] if n else np.zeros(0, dtype=np.bool_)
    seg_id = np.cumsum(start) - 1
    seg_start = np.flatnonzero(start)
    seg_len = np.diff(np.r_[seg_start, n])
    pos = np.arange(n) - seg_start[seg_id]
    rank_from_end = seg_len[seg_id] - 1 - pos
    nxt = np.r_[order[1:], -1] if n else np.zeros(0, dtype=np.int64)
    return order, rank_from_end.astype(np.int64), nxt.astype(np.int64)


def _returns_to_go(b: _Batch, gamma: float) -> FloatArray:
    """``R_t = sum_{k>=t} gamma^(turn_k - turn_t) r_k`` per sample over the reward stream (module docstring). Shape (N,).

    NaN for every turn of an unscorable trajectory (no reward at all, or a NaN turn reward)."""
    n = b.n
    out = np.zeros(n, dtype=np.float64)
    if n == 0:
        return out
    order, rfe, nxt = _segments(b)
    r = np.where(b.reward_given, b.reward, 0.0)
    is_last = np.zeros(n, dtype=np.bool_)
    is_last[order[rfe == 0]] = True
    r = r + np.where(is_last & ~np.isnan(b.traj_reward), b.traj_reward, 0.0)  # the outcome arrives with the last turn
    bad = np.bincount(b.traj, weights=(np.isnan(r) | np.isnan(b.score)).astype(np.float64)) > 0
    # backward recursion, vectorised across trajectories: one pass per position-from-the-end
    rank_of = np.empty(n, dtype=np.int64)
    rank_of[order] = rfe
    next_of = np.empty(n, dtype=np.int64)
    next_of[order] = nxt
    for k in range(int(rfe.max()) + 1):
        idx = np.flatnonzero(rank_of == k)
        if k == 0:
            out[idx] = r[idx]
        else:
            j = next_of[idx]
            out[idx] = r[idx] + np.power(gamma, b.turn[j] - b.turn[idx]) * out[j]
    out[bad[b.traj]] = np.nan
    return out


def _stats(b: _Batch, valid: BoolArray, n_groups: int, n_zero: int) -> AdvantageStats:
    return AdvantageStats(n_samples=b.n, n_excluded=int(b.n - valid.sum()), n_groups=n_groups, n_zero_std_groups=n_zero)


# ---------------------------------------------------------------------------------------------------
# GRPO family


@register_advantage(Estimator.GRPO)
def grpo(
    samples: Sequence[TurnSample],
    *,
    norm_by_std: bool = True,
    std_scope: Literal["group", "batch"] = "group",
    eps: float = 1e-6,
    zero_std_tol: float = 1e-9,
) -> tuple[FloatArray, AdvantageStats]:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300): ``A_i = (R_i - mean_g R) / (std_g R + eps)`` per trajectory.

    Statistics are over trajectories of a group (each trajectory once, however many turns it has); every turn
    of trajectory i gets ``A_i``. ``norm_by_std=False`` is Dr.GRPO. ``std_scope="batch"`` divides by the std of
    all valid trajectory rewards in the batch (TRL ``scale_rewards="batch"``); zero-spread groups stay 0.
    """
    _check(eps, zero_std_tol)
    if std_scope not in ("group", "batch"):
        raise AdvantageInputError(f"std_scope must be 'group' or 'batch', got {std_scope!r}")
    b = _batch(samples)
    adv, n_g, n_z = _trajectory_normalise(b, norm_by_std=norm_by_std and std_scope == "group", eps=eps, zero_std_tol=zero_std_tol)
    if norm_by_std and std_scope == "batch":
        first = _first_per_traj(b)
        r = b.score[first]
        r = r[~np.isnan(r)]
        std = float(np.std(r, ddof=1)) if r.size > 1 else 0.0
        adv = adv / (std + eps)
    return adv, _stats(b, ~np.isnan(b.score), n_g, n_z)


@register_advantage(Estimator.DRGRPO)
def drgrpo(samples: Sequence[TurnSample], *, zero_std_tol: float = 1e-9) -> tuple[FloatArray, AdvantageStats]:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training", arXiv 2503.20783): ``A_i = R_i - mean_g R``.

    Pair it with the ``seq-mean-token-sum-norm`` loss aggregation (``learner/losses.py``).
    """
    return grpo(samples, norm_by_std=False, zero_std_tol=zero_std_tol)


@register_advantage(Estimator.RLOO)
def rloo(samples: Sequence[TurnSample], *, zero_std_tol: float = 1e-9) -> tuple[FloatArray, AdvantageStats]:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740).

    ``A_i = R_i - (1/(G-1)) sum_{k != i} R_k = G/(G-1) (R_i - mean_g R)`` over the G valid trajectories of
    the group; G < 2 or zero spread -> 0.
    """
    b = _batch(samples)
    centred, n_g, n_z = _trajectory_normalise(b, norm_by_std=False, eps=1.0, zero_std_tol=zero_std_tol)
    first = _first_per_traj(b)
    ok = ~np.isnan(b.score[first])
    g_count = np.bincount(b.group[first][ok], minlength=int(b.group.max(initial=-1)) + 1).astype(np.float64)
    g = g_count[b.group] if b.n else np.zeros(0)
    adv = np.where(g > 1, centred * g / np.maximum(g - 1.0, 1.0), 0.0)
    return adv, _stats(b, ~np.isnan(b.score), n_g, n_z)


# ---------------------------------------------------------------------------------------------------
# Turn-level estimators


@register_advantage(Estimator.GIGPO)
def gigpo(
    samples: Sequence[TurnSample],
    *,
    omega: float = 1.0,
    gamma: float = 0.95,
    norm_by_std: bool = True,
    cross_steps: bool = True,
    eps: float = 1e-6,
    zero_std_tol: float = 1e-9,
) -> tuple[FloatArray, AdvantageStats]:
    """GiGPO (Feng et al. 2025, arXiv 2505.10978; verl-agent ``gigpo/core_gigpo.py``).

    ``A_{i,t} = A^E_i + omega * A^S_{i,t}``:

    * episode level ``A^E_i = (R_i - mean) / (std + eps)`` over the group; with ``cross_steps=True``
      (verl-agent's ``compute_mean_std_cross_steps`` default) every turn sample counts once, so long
      trajectories weigh more; ``False`` is one entry per trajectory.
    * step level: the discounted return-to-go ``R_{i,t}`` (module docstring) normalised inside the anchor
      group ``(group_id, state)``: ``state`` is the environment's state key (the observation without the
      history, as verl-agent hashes it), so two trajectories that reach one state, at any turn and by any
      path, are compared there; without one the exact context id ``anchor`` is used (equal only for equal
      histories). Neither is a singleton (verl-agent would pool all ``None`` anchors together; we do not),
      and singletons get ``A^S = 0``.

    ``norm_by_std=True`` is verl-agent's ``mean_std_norm``, ``False`` its ``mean_norm``; it applies to both levels.
    ``stats`` counts episode-level groups.
    """
    _check(eps, zero_std_tol)
    b = _batch(samples)
    ret = _returns_to_go(b, gamma)
    valid = ~np.isnan(b.score) & ~np.isnan(ret)
    kw: dict[str, Any] = {"norm_by_std": norm_by_std, "eps": eps, "zero_std_tol": zero_std_tol}
    if cross_steps:
        ep, n_g, n_z = _normalise(b.score, b.group, valid, **kw)
    else:
        first = _first_per_traj(b)
        traj_valid = np.bincount(b.traj, weights=valid.astype(np.float64)) > 0
        ep_t, n_g, n_z = _normalise(b.score[first], b.group[first], traj_valid, **kw)
        ep = np.where(valid, ep_t[b.traj], 0.0)
    keys = [s.state if s.state is not None else s.anchor for s in samples]
    anchors: list[Hashable] = [(s.group_id, k) if k is not None else ("", "", i) for i, (s, k) in enumerate(zip(samples, keys, strict=True))]
    st, _, _ = _normalise(ret, _codes(anchors), valid, **kw)
    return ep + omega * st, _stats(b, valid, n_g, n_z)


@register_advantage(Estimator.TURN_GRPO)
def turn_grpo(
    samples: Sequence[TurnSample],
    *,
    source: Literal["return", "reward"] = "return",
    gamma: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    zero_std_tol: float = 1e-9,
) -> tuple[FloatArray, AdvantageStats]:
    """Turn-index GRPO (the "context-independent turn-level advantage" reading of MemoPilot/SVR, ``docs/methods.md``).

    ``A_{i,t} = (x_{i,t} - mean_{k} x_{k,t}) / (std_k x_{k,t} + eps)`` inside ``(group_id, turn_index)``,
    where ``x`` is the return-to-go with ``gamma`` (``source="return"``, default; with outcome-only rewards
    and ``gamma=1`` it is the trajectory reward) or the turn's own reward (``source="reward"``; a turn
    without one is excluded).
    """
    _check(eps, zero_std_tol)
    b = _batch(samples)
    if source == "return":
        x = _returns_to_go(b, gamma)
    elif source == "reward":
        x = np.where(b.reward_given, b.reward, np.nan)
    else:
        raise AdvantageInputError(f"source must be 'return' or 'reward', got {source!r}")
    valid = ~np.isnan(x)
    codes = _codes(list(zip(b.group.tolist(), b.turn.tolist(), strict=True)))
    adv, n_g, n_z = _normalise(x, codes, valid, norm_by_std=norm_by_std, eps=eps, zero_std_tol=zero_std_tol)
    return adv, _stats(b, valid, n_g, n_z)


@register_advantage(Estimator.RTPO)
def rtpo(
    samples: Sequence[TurnSample],
    *,
    gamma: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    zero_std_tol: float = 1e-9,
) -> tuple[FloatArray, AdvantageStats]:
    """RTPO sibling advantage (Reverse-Turn Policy Optimization; our reading, ``docs/methods.md#rtpo``).

    A turn whose ``anchor`` (the branch-point id: same exact stored context) is shared by at least two
    samples of its group is a sibling: ``A^{(b)}_{i,t} = (G^{(b)} - mean_{b'} G^{(b')}) / (std + eps)``
    over the sibling set, ``G`` its continuation return (return-to-go with ``gamma``; outcome-only rewards
    give the sibling's trajectory reward). Every other turn (no anchor, or an anchor nobody else shares)
    gets trajectory GRPO over its group, so with no branches (K=0, m=1) this *is* :func:`grpo`.
    The reverse update sweep is planned in ``learner/rerollout.py``. ``stats`` counts sibling sets and GRPO groups.
    """
    _check(eps, zero_std_tol)
    b = _batch(samples)
    kw: dict[str, Any] = {"norm_by_std": norm_by_std, "eps": eps, "zero_std_tol": zero_std_tol}
    base, n_g, n_z = _trajectory_normalise(b, **kw)
    valid = ~np.isnan(b.score)
    keys: list[Hashable] = [(s.group_id, s.anchor) if s.anchor is not None else ("", "", i) for i, s in enumerate(samples)]
    codes = _codes(keys)
    size = np.bincount(codes, minlength=int(codes.max(initial=-1)) + 1)[codes] if b.n else np.zeros(0, dtype=np.int64)
    sib = size >= 2
    if sib.any():
        ret = _returns_to_go(b, gamma)
        sib_valid = sib & ~np.isnan(ret)
        sib_adv, s_g, s_z = _normalise(ret, codes, sib_valid, **kw)
        base = np.where(sib, sib_adv, base)
        valid = np.where(sib, sib_valid, valid)
        n_g, n_z = n_g + s_g, n_z + s_z
    return base, _stats(b, valid, n_g, n_z)


# ---------------------------------------------------------------------------------------------------
# TCPO (our reading: docs/methods.md)


def tcpo_retrospective(scores: Sequence[float] | FloatArray, *, best0: float = 0.0) -> FloatArray:
    """Retrospective credit: ``retro_t = v_t - best_{t-1}``, ``best_{t-1} = max(best0, v_1..v_{t-1})``. Shape (T,)."""
    v = np.asarray(scores, dtype=np.float64)
    best_prev = np.maximum.accumulate(np.r_[best0, v])[:-1]
    return v - best_prev


def tcpo_hindsight(scores: Sequence[float] | FloatArray, *, lambda_h: float = 1.0, gamma: float = 0.9, best0: float = 0.0) -> FloatArray:
    """Hindsight delayed credit for non-improving turns. Shape (T,).

    ``hind_t = 1[retro_t <= 0] * lambda_h * gamma^(k*-t) * (v_{k*} - best_{t-1})`` with ``k*`` the first
    later turn whose score beats ``best_{t-1}``; 0 when there is none or the turn improved.
    """
    v = np.asarray(scores, dtype=np.float64)
    t_len = v.shape[0]
    best_prev = np.maximum.accumulate(np.r_[best0, v])[:-1]  # (T,)
    idx = np.arange(t_len)
    later = (idx[None, :] > idx[:, None]) & (v[None, :] > best_prev[:, None])  # (T, T): k after t and beats best_{t-1}
    has = later.any(axis=1)
    k_star = np.argmax(later, axis=1)
    gain = v[k_star] - best_prev
    hind = lambda_h * np.power(gamma, k_star - idx) * gain
    return np.where(has & (v - best_prev <= 0), hind, 0.0)


def tcpo_scores(turn_scores: Sequence[float] | FloatArray, outcome: float = math.nan, *, best0: float = 0.0) -> FloatArray:
    """TCPO's ``v_t`` per turn, with the fallbacks for unscored turns (NaN): the last turn takes ``outcome`` (if
    finite), any other turn ``best_{t-1}`` (no measured progress: retrospective credit 0). Shape (T,)."""
    v = np.asarray(turn_scores, dtype=np.float64).copy()
    if v.shape[0] and np.isnan(v[-1]) and math.isfinite(outcome):
        v[-1] = outcome
    best = best0
    for t in range(v.shape[0]):
        if np.isnan(v[t]):
            v[t] = best
        if not np.isnan(v[t]):
            best = max(best, float(v[t]))
    return v


def tcpo_counterfactual(score: float, alternative_scores: Sequence[float]) -> float:
    """Fixed-history counterfactual credit: ``cf_t = v_t - mean_m v(a'_m)`` over the M re-sampled alternatives."""
    if len(alternative_scores) == 0:
        raise AdvantageInputError("a counterfactual needs at least one alternative score")
    return float(score) - float(np.mean(np.asarray(alternative_scores, dtype=np.float64)))


@register_advantage(Estimator.TCPO)
def tcpo(
    samples: Sequence[TurnSample],
    *,
    lambda_h: float = 1.0,
    gamma: float = 0.9,
    best0: float = 0.0,
    mu: float = 1.0,
    counterfactual_scores: Mapping[tuple[str, int], Sequence[float]] | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    zero_std_tol: float = 1e-9,
) -> tuple[FloatArray, AdvantageStats]:
    """TCPO turn credit (our reading, ``docs/methods.md``) over the verifier scores ``v_t = TurnSample.reward``.

    Per trajectory, turns in ``turn_index`` order: ``credit_t = retro_t + hind_t``; where
    ``counterfactual_scores[(trajectory_id, turn_index)]`` holds the M alternative scores of a selected
    (high-surprisal) turn, ``credit_t = mu * cf_t + (1 - mu) * (retro_t + hind_t)``. Then
    ``A_{i,t} = (credit - mean) / (std + eps)`` over all turns of the group. Missing turn scores are filled by
    :func:`tcpo_scores` (the outcome on the last turn, no progress elsewhere); a trajectory with neither turn
    scores nor an outcome is excluded. ``cf_t`` compares like with like: a turn's own score against its
    alternatives' (process scores), or, for an unscored last turn, its run's outcome against theirs (a one-step
    alternative of the last turn ends its run too); an unscored earlier turn has no comparable value (its
    alternatives' truncated-run outcomes are not its filled-in score), so its counterfactual is ignored.
    """
    _check(eps, zero_std_tol)
    b = _batch(samples)
    cf = counterfactual_scores or {}
    credit = np.zeros(b.n, dtype=np.float64)
    valid = ~np.isnan(b.score)  # the stream rule's exclusions: no reward at all, or a NaN turn reward
    order, rfe, _ = _segments(b)
    ends = np.flatnonzero(rfe == 0)
    starts = np.r_[0, ends[:-1] + 1] if ends.size else ends
    for lo, hi in zip(starts.tolist(), (ends + 1).tolist(), strict=True):
        idx = order[lo:hi]
        if not valid[idx[0]]:
            continue
        v = tcpo_scores(b.reward[idx], float(b.traj_reward[idx[0]]), best0=best0)
        c = tcpo_retrospective(v, best0=best0) + tcpo_hindsight(v, lambda_h=lambda_h, gamma=gamma, best0=best0)
        for pos, i in enumerate(idx.tolist()):
            alts = cf.get((samples[i].trajectory_id, samples[i].turn_index))
            # like with like: an unscored non-final turn's v_t is a fill-in (best_{t-1}), not the outcome of a
            # one-step run as its alternatives' scores are; no comparable value, so no counterfactual for it
            if alts is not None and (not np.isnan(b.reward[i]) or pos == len(idx) - 1):
                c[pos] = mu * tcpo_counterfactual(float(v[pos]), alts) + (1.0 - mu) * c[pos]
        credit[idx] = c
    adv, n_g, n_z = _normalise(credit, b.group, valid, norm_by_std=norm_by_std, eps=eps, zero_std_tol=zero_std_tol)
    return adv, _stats(b, valid, n_g, n_z)


# ---------------------------------------------------------------------------------------------------
# LEAP rank rewards (our reading: docs/methods.md)


def rank_wins(
    correct: Sequence[bool],
    score: Sequence[float | None],
    n_tokens: Sequence[int],
    *,
    margin: float = 0.0,
    score_when_incorrect: bool = False,
) -> FloatArray:
    """Round-robin tournament inside one group: wins per participant, shape (G,); they sum to G(G-1)/2.

    ``beats(i,k)``: correct beats incorrect; on equal correctness (both correct, or any if
    ``score_when_incorrect``) the higher score wins when ``s_i > s_k (1 + margin)`` and not the reverse
    (a missing score ties); then, between two correct participants, fewer tokens wins (LEAP's token-efficiency
    penalty is for easy prompts: between two failures brevity earns nothing, so an all-wrong group ties
    everywhere and gets zero advantage); a full tie is 0.5 each. ``beats(i,k) + beats(k,i) = 1``.
    """
    c = np.asarray(correct, dtype=np.bool_)
    has = np.array([s is not None and not math.isnan(float(s)) for s in score], dtype=np.bool_)
    s = np.array([float(x) if ok and x is not None else 0.0 for x, ok in zip(score, has, strict=True)], dtype=np.float64)
    n = np.asarray(n_tokens, dtype=np.float64)
    g = c.shape[0]
    if not (s.shape[0] == n.shape[0] == g):
        raise AdvantageInputError("correct, score and n_tokens must have the same length")
    use_score = (has[:, None] & has[None, :]) & ((c[:, None] & c[None, :]) | bool(score_when_incorrect))  # (G, G)
    s_gt = (s[:, None] > s[None, :] * (1.0 + margin)) & use_score
    s_win = s_gt & ~s_gt.T
    s_tie = ~(s_win | s_win.T)
    c_win = c[:, None] & ~c[None, :]
    c_tie = c[:, None] == c[None, :]
    both_correct = c[:, None] & c[None, :]  # the token tie-break: only between correct kernels (failing ones are not "efficient")
    n_win = (n[:, None] < n[None, :]) & both_correct
    n_tie = ~(n_win | n_win.T)
    beats = np.where(c_win, 1.0, 0.0)
    beats = np.where(c_tie & s_win, 1.0, beats)
    beats = np.where(c_tie & s_tie & n_win, 1.0, beats)
    beats = np.where(c_tie & s_tie & n_tie, 0.5, beats)
    np.fill_diagonal(beats, 0.0)
    wins: FloatArray = beats.sum(axis=1)
    return wins


@register_advantage(Estimator.RANK)
def rank(
    samples: Sequence[TurnSample],
    *,
    per: Literal["trajectory", "turn"] = "trajectory",
    margin: float = 0.0,
    score_when_incorrect: bool = False,
    normalize: Literal["center", "std"] = "center",
    eps: float = 1e-6,
    zero_std_tol: float = 1e-9,
) -> tuple[FloatArray, AdvantageStats]:
    """LEAP rank-based reward (our reading, ``docs/methods.md``): ``r_i = wins_i / (G-1)`` in [0, 1], mean exactly 0.5.

    ``A_i = r_i - 0.5`` (``normalize="center"``) or ``(r_i - mean) / (std + eps)`` (``"std"``); all-tie
    groups give 0. ``per="trajectory"``: a participant is a trajectory, judged on its last turn's
    ``correct``/``score`` and the sum of its turns' ``n_tokens``; every turn gets its trajectory's advantage.
    ``per="turn"``: participants are the turns sharing ``(group_id, turn_index)``, each judged on its own result:
    a turn whose ``correct``/``score`` are its trajectory's final outcome (``result_of="trajectory"``) has no result
    of its own and is excluded, never ranked by the outcome. ``correct=None`` is excluded.
    """
    _check(eps, zero_std_tol)
    b = _batch(samples)
    if per == "trajectory":
        order, rfe, _ = _segments(b)
        last = order[rfe == 0]  # (n_traj,) one per trajectory
        unit = b.traj
        owner = np.empty(int(b.traj.max(initial=-1)) + 1, dtype=np.int64)
        owner[b.traj[last]] = last
        tokens = np.bincount(b.traj, weights=b.n_tokens.astype(np.float64)) if b.n else np.zeros(0)
        part_sample = owner  # participant u is represented by sample owner[u]
        part_tokens = tokens
        part_group = b.group[owner] if b.n else np.zeros(0, dtype=np.int64)
    elif per == "turn":
        unit = np.arange(b.n, dtype=np.int64)
        part_sample = unit
        part_tokens = b.n_tokens.astype(np.float64)
        part_group = _codes(list(zip(b.group.tolist(), b.turn.tolist(), strict=True)))
    else:
        raise AdvantageInputError(f"per must be 'trajectory' or 'turn', got {per!r}")
    part_ok = np.array(
        [samples[i].correct is not None and (per == "trajectory" or samples[i].result_of == "turn") for i in part_sample.tolist()],
        dtype=np.bool_,
    )
    r = np.zeros(part_sample.shape[0], dtype=np.float64)
    for grp in np.unique(part_group[part_ok]).tolist():
        members = np.flatnonzero((part_group == grp) & part_ok)
        if members.shape[0] < 2:
            r[members] = 0.5
            continue
        wins = rank_wins(
            [bool(samples[i].correct) for i in part_sample[members].tolist()],
            [samples[i].score for i in part_sample[members].tolist()],
            part_tokens[members].tolist(),
            margin=margin,
            score_when_incorrect=score_when_incorrect,
        )
        r[members] = wins / (members.shape[0] - 1)
    if normalize not in ("center", "std"):
        raise AdvantageInputError(f"normalize must be 'center' or 'std', got {normalize!r}")
    adv_p, n_g, n_z = _normalise(r, part_group, part_ok, norm_by_std=True, eps=eps, zero_std_tol=zero_std_tol)
    if normalize == "center":
        # r - 0.5 exactly (the group mean is 0.5 by construction); an all-tie group has r == 0.5 -> exactly 0
        adv_p = np.where(part_ok, r - 0.5, 0.0)
    return adv_p[unit], _stats(b, part_ok[unit], n_g, n_z)
