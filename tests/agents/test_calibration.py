"""Brier score, ECE, Wilson intervals and the eval summary against hand-computed values and scipy (agents/calibration.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from agents.calibration import brier_score, expected_calibration_error, summarize, wilson_interval


@pytest.mark.parametrize(
    ("conf", "out", "expected"),
    [
        ([1.0, 0.0], [1, 0], 0.0),
        ([0.0, 1.0], [1, 0], 1.0),
        ([0.5, 0.5, 0.5, 0.5], [1, 0, 1, 0], 0.25),
        ([0.9, 0.6, 0.2], [True, False, False], (0.01 + 0.36 + 0.04) / 3),
        ([0.8], [0.5], 0.09),  # fractional reward
    ],
)
def test_brier_score(conf: list[float], out: list, expected: float) -> None:
    assert brier_score(conf, out) == pytest.approx(expected)


ECE_TABLE = [
    # (confidences, outcomes, n_bins, expected) — hand-computed
    ([0.9, 0.9, 0.9, 0.9], [1, 1, 1, 0], 10, abs(0.9 - 0.75)),
    # bins [0.0,0.5) and [0.5,1.0]: {0.1,0.3} vs {0,1} → |0.2−0.5|; {0.7,0.9} vs {1,1} → |0.8−1.0|; weights ½, ½
    ([0.1, 0.3, 0.7, 0.9], [0, 1, 1, 1], 2, 0.5 * 0.3 + 0.5 * 0.2),
    # 1.0 falls into the last bin; 0.0 into the first
    ([1.0, 0.0], [1, 0], 10, 0.0),
    ([1.0, 0.0], [0, 1], 10, 1.0),
    # one bin: |mean confidence − accuracy|
    ([0.2, 0.4, 0.9], [1, 0, 0], 1, abs(0.5 - 1 / 3)),
    # three samples in three bins, weights ⅓ each
    ([0.05, 0.55, 0.95], [0, 0, 1], 10, (0.05 + 0.55 + 0.05) / 3),
    # perfectly calibrated within a bin
    ([0.75] * 4, [1, 1, 1, 0], 10, 0.0),
]


@pytest.mark.parametrize(("conf", "out", "n_bins", "expected"), ECE_TABLE)
def test_ece_hand_computed(conf: list[float], out: list[int], n_bins: int, expected: float) -> None:
    assert expected_calibration_error(conf, out, n_bins) == pytest.approx(expected)


def test_ece_matches_a_loop_reference() -> None:
    rng = np.random.default_rng(0)
    for n_bins in (1, 5, 10, 15):
        conf = rng.uniform(0, 1, 300)
        out = (rng.uniform(0, 1, 300) < conf**2).astype(float)
        ref = 0.0
        for b in range(n_bins):
            lo, hi = b / n_bins, (b + 1) / n_bins
            sel = (conf >= lo) & ((conf < hi) if b < n_bins - 1 else (conf <= hi))
            if sel.any():
                ref += sel.sum() / conf.size * abs(conf[sel].mean() - out[sel].mean())
        assert expected_calibration_error(conf.tolist(), out.tolist(), n_bins) == pytest.approx(ref)


@pytest.mark.parametrize(
    ("conf", "out", "match"),
    [
        ([], [], "at least one"),
        ([0.5], [1, 0], "equal length"),
        ([1.2], [1], "confidences"),
        ([0.5], [2], "outcomes"),
        ([math.nan], [1], "confidences"),
    ],
)
def test_calibration_input_errors(conf: list[float], out: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        brier_score(conf, out)
    with pytest.raises(ValueError, match=match):
        expected_calibration_error(conf, out)


def test_ece_rejects_zero_bins() -> None:
    with pytest.raises(ValueError, match="n_bins"):
        expected_calibration_error([0.5], [1], 0)


def wilson_by_hand(k: int, n: int, alpha: float) -> tuple[float, float]:
    z = stats.norm.ppf(1 - alpha / 2)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


@pytest.mark.parametrize(("k", "n", "alpha"), [(0, 10, 0.05), (10, 10, 0.05), (7, 20, 0.05), (113, 200, 0.05), (3, 9, 0.1), (50, 100, 0.01)])
def test_wilson_interval(k: int, n: int, alpha: float) -> None:
    low, high = wilson_interval(k, n, alpha)
    ref = wilson_by_hand(k, n, alpha)
    assert (low, high) == pytest.approx(ref, abs=1e-12)
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=1 - alpha, method="wilson")
    assert (low, high) == pytest.approx((ci.low, ci.high))
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_wilson_known_value() -> None:
    # 7 of 20 at 95 %: p̂ = 0.35, z = 1.96 → centre 0.3742, half-width 0.1930
    low, high = wilson_interval(7, 20)
    assert (round(low, 3), round(high, 3)) == (0.181, 0.567)


def test_wilson_edge_cases() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    for k, n in [(-1, 3), (4, 3), (0, -1)]:
        with pytest.raises(ValueError, match="successes"):
            wilson_interval(k, n)
    with pytest.raises(ValueError, match="alpha"):
        wilson_interval(1, 2, alpha=1.0)


def test_summarize_everything() -> None:
    s = summarize(
        [True, False, True, False],
        confidences=[0.9, 0.8, None, 0.3],
        turns=[1, 3, 6, 2],
        tokens=[100, 300, 600, 200],
        verified=[True, True, False, False],
    )
    assert (s.n, s.successes, s.success_rate) == (4, 2, 0.5)
    assert (s.ci_low, s.ci_high) == pytest.approx(wilson_interval(2, 4))
    assert (s.mean_turns, s.mean_tokens) == (3.0, 300.0)
    assert (s.verified_stops, s.wrong_stop_rate) == (2, 0.5)
    assert s.n_calibrated == 3
    assert s.brier == pytest.approx((0.01 + 0.64 + 0.09) / 3)
    assert s.ece == pytest.approx(expected_calibration_error([0.9, 0.8, 0.3], [1, 0, 0]))
    d = s.as_dict()
    assert d["success_rate"] == 0.5 and d["alpha"] == 0.05 and set(d) >= {"brier", "ece", "wrong_stop_rate", "ci_low", "ci_high"}


def test_summarize_minimal_and_empty() -> None:
    s = summarize([True, True, False])
    assert (s.successes, s.brier, s.ece, s.n_calibrated, s.mean_turns, s.verified_stops, s.wrong_stop_rate) == (2, None, None, 0, None, None, None)
    e = summarize([])
    assert (e.n, e.success_rate, e.ci_low, e.ci_high) == (0, None, 0.0, 1.0)
    assert summarize([False], verified=[False]).wrong_stop_rate is None
    assert summarize([True], confidences=[None]).brier is None


def test_summarize_length_mismatch() -> None:
    with pytest.raises(ValueError, match="turns has 1 entries for 2 runs"):
        summarize([True, False], turns=[1])
