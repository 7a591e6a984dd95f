"""Evaluation statistics for agents: success-rate confidence intervals and calibration of stated confidence.

* ``brier_score`` — mean squared gap between stated P(correct) and the outcome.
* ``expected_calibration_error`` — equal-width bins over [0, 1], each bin's |mean confidence − mean
  outcome| weighted by its share of the samples.
* ``wilson_interval`` — the Wilson score interval for a binomial proportion (scipy's ``binomtest``).
* ``summarize`` — the numbers ``loopwise eval`` (``experiments/agent_eval.py``) prints, as a frozen dataclass with ``as_dict``.

Confidences are the model's stated probability that its answer is correct (for SVR use
``SelfCheck.p_correct`` / ``StopDecision.p_correct``, i.e. 1 − confidence after an Incorrect verdict).
Outcomes are 0/1 (or booleans); fractional verifier rewards in [0, 1] are accepted by the calibration
scores as the probability of being right.

Not here: running episodes, choosing what counts as a success (the eval CLI), plots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats


def _pair(confidences: Sequence[float], outcomes: Sequence[float | bool]) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(confidences, dtype=np.float64)  # (N,)
    o = np.asarray(outcomes, dtype=np.float64)  # (N,)
    if c.ndim != 1 or o.ndim != 1 or c.shape != o.shape:
        raise ValueError(f"confidences and outcomes must be 1-D and of equal length, got {c.shape} and {o.shape}")
    if c.size == 0:
        raise ValueError("calibration needs at least one sample")
    for name, a in (("confidences", c), ("outcomes", o)):
        if not np.all((a >= 0.0) & (a <= 1.0)):  # also rejects NaN
            raise ValueError(f"{name} must lie in [0, 1]")
    return c, o


def brier_score(confidences: Sequence[float], outcomes: Sequence[float | bool]) -> float:
    """Mean of (confidence − outcome)²; 0 is perfect, 0.25 is a constant 0.5 guess on balanced outcomes."""
    c, o = _pair(confidences, outcomes)
    return float(np.mean((c - o) ** 2))


def expected_calibration_error(confidences: Sequence[float], outcomes: Sequence[float | bool], n_bins: int = 10) -> float:
    """ECE with ``n_bins`` equal-width bins ``[i/n, (i+1)/n)``, the last one closed at 1.0; empty bins add 0."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    c, o = _pair(confidences, outcomes)
    idx = np.minimum(np.floor(c * n_bins).astype(np.int64), n_bins - 1)  # (N,) bin of each sample
    count = np.bincount(idx, minlength=n_bins).astype(np.float64)  # (n_bins,)
    conf_sum = np.bincount(idx, weights=c, minlength=n_bins)  # (n_bins,)
    out_sum = np.bincount(idx, weights=o, minlength=n_bins)  # (n_bins,)
    # Σ_b (n_b / N) · |conf_sum_b / n_b − out_sum_b / n_b| = Σ_b |conf_sum_b − out_sum_b| / N
    return float(np.sum(np.abs(conf_sum - out_sum)) / c.size) if count.sum() else 0.0


def wilson_interval(successes: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """The Wilson score interval at confidence level ``1 − alpha``; ``(0.0, 1.0)`` when ``n == 0``."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if n == 0:
        return 0.0, 1.0
    ci = stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=1.0 - alpha, method="wilson")
    return float(ci.low), float(ci.high)


@dataclass(frozen=True)
class EvalSummary:
    n: int
    successes: int
    success_rate: float | None  # None when n == 0
    ci_low: float  # Wilson interval at level 1 − alpha
    ci_high: float
    alpha: float
    mean_turns: float | None
    mean_tokens: float | None
    verified_stops: int | None  # runs that stopped on their own self-check (reason "verified")
    wrong_stop_rate: float | None  # among verified stops, the fraction whose answer was wrong
    n_calibrated: int  # runs with a stated confidence (the rest did not parse)
    brier: float | None
    ece: float | None

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def _mean(xs: Sequence[float] | None) -> float | None:
    return float(np.mean(np.asarray(xs, dtype=np.float64))) if xs is not None and len(xs) else None


def summarize(
    successes: Sequence[bool],
    *,
    confidences: Sequence[float | None] | None = None,
    turns: Sequence[int] | None = None,
    tokens: Sequence[int] | None = None,
    verified: Sequence[bool] | None = None,
    alpha: float = 0.05,
    n_bins: int = 10,
) -> EvalSummary:
    """Summarize ``n`` runs. Every given sequence is per run, aligned with ``successes``.

    ``confidences``: the stated P(correct) of each run's final answer, None where there was none (those
    runs are left out of Brier/ECE and counted in ``n - n_calibrated``). ``verified``: whether the run
    stopped on its own self-check; the wrong-stop rate is P(wrong | verified stop) (§5 "would stop
    wrongly"), None when no run stopped verified.
    """
    n = len(successes)
    for name, seq in (("confidences", confidences), ("turns", turns), ("tokens", tokens), ("verified", verified)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries for {n} runs")
    k = sum(1 for s in successes if s)
    low, high = wilson_interval(k, n, alpha)

    brier = ece = None
    n_cal = 0
    if confidences is not None:
        pairs = [(c, float(bool(s))) for c, s in zip(confidences, successes, strict=True) if c is not None]
        n_cal = len(pairs)
        if pairs:
            cs, os_ = [p[0] for p in pairs], [p[1] for p in pairs]
            brier, ece = brier_score(cs, os_), expected_calibration_error(cs, os_, n_bins)

    n_verified = wrong = None
    if verified is not None:
        n_verified = sum(1 for v in verified if v)
        wrong = sum(1 for v, s in zip(verified, successes, strict=True) if v and not s) / n_verified if n_verified else None

    return EvalSummary(
        n=n,
        successes=k,
        success_rate=k / n if n else None,
        ci_low=low,
        ci_high=high,
        alpha=alpha,
        mean_turns=_mean(turns),
        mean_tokens=_mean(tokens),
        verified_stops=n_verified,
        wrong_stop_rate=wrong,
        n_calibrated=n_cal,
        brier=brier,
        ece=ece,
    )
