"""T²PO: top-k entropy, the thinking monitor on constructed logprob sequences, turn resampling (agents/t2po.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from agents.t2po import (
    INTERVENTION_TEXT,
    T2POConfig,
    T2POCounters,
    ThinkingMonitor,
    intervention_text,
    should_intervene,
    should_resample,
    thinking_open,
    token_entropy,
    token_uncertainty,
    turn_uncertainty,
)


def topk_of(probs: list[float]) -> list[tuple[int, float]]:
    """(token id, logprob) pairs, best first, as the engine returns them."""
    return [(i, math.log(p)) for i, p in sorted(enumerate(probs), key=lambda x: -x[1])]


def uniform_top(k: int) -> list[tuple[int, float]]:
    return topk_of([1.0 / k] * k)


# ── token_entropy ──────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("top", "expected"),
    [
        (uniform_top(2), math.log(2)),
        (uniform_top(20), math.log(20)),
        ([(5, 0.0)], 0.0),  # k = 1: no uncertainty visible
        (topk_of([0.5, 0.25, 0.25]), 1.5 * math.log(2)),
        ([math.log(0.5), math.log(0.25), math.log(0.25)], 1.5 * math.log(2)),  # bare logprobs
        # truncated top-2 of (0.4, 0.4, 0.2): renormalised to (0.5, 0.5), the tail ignored
        (topk_of([0.4, 0.4]), math.log(2)),
        ([(1, math.log(0.9)), (2, -math.inf)], 0.0),  # -inf has zero probability
        ([(1, -1000.0), (2, -1000.0)], math.log(2)),  # stable far from 0
    ],
)
def test_token_entropy(top: list, expected: float) -> None:
    assert token_entropy(top) == pytest.approx(expected, abs=1e-12)


def test_token_entropy_matches_scipy_on_renormalised_topk() -> None:
    from scipy.stats import entropy

    rng = np.random.default_rng(0)
    for _ in range(20):
        full = rng.dirichlet(np.ones(50))
        top = np.sort(full)[::-1][:20]
        got = token_entropy([(i, float(np.log(p))) for i, p in enumerate(top)])
        assert got == pytest.approx(float(entropy(top / top.sum())), rel=1e-10)
        assert got <= math.log(20) + 1e-12


@pytest.mark.parametrize("bad", [[], [(1, math.nan)], [(1, math.inf)], [-math.inf, -math.inf]])
def test_token_entropy_rejects(bad: list) -> None:
    with pytest.raises(ValueError):
        token_entropy(bad)


def test_token_uncertainty_falls_back_to_surprisal() -> None:
    assert token_uncertainty(-2.5) == 2.5
    assert token_uncertainty(-2.5, uniform_top(4)) == pytest.approx(math.log(4))


# ── thinking monitor ───────────────────────────────────────────────────────────────────────────────────

W, THR = 8, 0.05


def test_flat_high_entropy_fires_once_two_windows_are_full() -> None:
    flat = [2.5] * 100
    assert should_intervene(flat, window=W, threshold=THR, min_tokens=0) == 2 * W - 1


def test_flat_fires_from_real_topk_through_the_monitor() -> None:
    m = ThinkingMonitor(window=W, threshold=THR, min_tokens=0)
    fired = [m.update(uniform_top(20)) for _ in range(40)]
    assert fired.index(True) == 2 * W - 1
    assert fired.count(True) == 1  # at most once
    assert (m.fired_at, m.reason, m.n_tokens) == (2 * W - 1, "plateau", 2 * W)
    assert m.entropies[0] == pytest.approx(math.log(20))


def test_steadily_decreasing_does_not_fire_until_the_plateau() -> None:
    # decreasing by 0.02/token: windows 8 apart differ by 0.16 > 0.05; then flat from token 60 on
    decreasing = [3.0 - 0.02 * i for i in range(60)]
    seq = decreasing + [decreasing[-1]] * 60
    k = should_intervene(seq, window=W, threshold=THR, min_tokens=0)
    assert k is not None and k >= 60
    # the windows are 8 tokens: the change drops under 0.05 once the older window is almost all plateau
    cur = np.mean(seq[k - W + 1 : k + 1])
    prev = np.mean(seq[k - 2 * W + 1 : k - W + 1])
    assert abs(cur - prev) < THR
    assert should_intervene(decreasing, window=W, threshold=THR, min_tokens=0) is None


def test_fires_at_the_first_flat_index_exactly() -> None:
    # the marginal change is |mean(last W) − mean(W before)|; compute the first index by brute force
    rng = np.random.default_rng(1)
    seq = list(np.concatenate([np.linspace(3, 1, 50), 1 + 0.01 * rng.standard_normal(50)]))
    expected = next(k for k in range(2 * W - 1, len(seq)) if abs(np.mean(seq[k - W + 1 : k + 1]) - np.mean(seq[k - 2 * W + 1 : k - W + 1])) < THR)
    assert should_intervene(seq, window=W, threshold=THR, min_tokens=0) == expected


def test_increasing_uncertainty_does_not_fire() -> None:
    assert should_intervene([0.5 + 0.03 * i for i in range(200)], window=W, threshold=THR, min_tokens=0) is None


@pytest.mark.parametrize(("min_tokens", "expected"), [(0, 2 * W - 1), (2 * W, 2 * W - 1), (40, 39), (100, None)])
def test_min_tokens_respected(min_tokens: int, expected: int | None) -> None:
    assert should_intervene([2.0] * 60, window=W, threshold=THR, min_tokens=min_tokens) == expected


@pytest.mark.parametrize(("budget", "expected", "reason"), [(None, None, None), (30, 29, "budget"), (1, 0, "budget")])
def test_budget_ends_thinking(budget: int | None, expected: int | None, reason: str | None) -> None:
    seq = [0.5 + 0.03 * i for i in range(60)]  # never plateaus
    assert should_intervene(seq, window=W, threshold=THR, min_tokens=0, budget=budget) == expected
    m = ThinkingMonitor(W, THR, 0, budget)
    for h in seq:
        m.update_entropy(h)
    assert m.reason == reason


def test_plateau_before_budget_wins() -> None:
    m = ThinkingMonitor(W, THR, 0, budget=2 * W)
    for h in [1.0] * (2 * W):
        m.update_entropy(h)
    assert (m.fired_at, m.reason) == (2 * W - 1, "plateau")


def test_threshold_zero_never_fires_on_a_plateau() -> None:
    assert should_intervene([1.0] * 100, window=W, threshold=0.0, min_tokens=0) is None


def test_switch_off_never_fires() -> None:
    m = T2POConfig(window=W, threshold=THR, min_tokens=0).new_monitor()
    assert not any(m.update(uniform_top(20)) for _ in range(1000))
    assert not m.update([])  # off: the argument is not even looked at (no top-k was requested)
    assert not m.fired and m.n_tokens == 0


def test_switch_on_config_monitor_fires() -> None:
    m = T2POConfig(thinking_intervention=True, window=W, threshold=THR, min_tokens=0, think_budget=None).new_monitor()
    assert [m.update(uniform_top(20)) for _ in range(2 * W)][-1] is True


def test_monitor_reset_starts_a_new_span() -> None:
    m = ThinkingMonitor(W, THR, 0)
    assert any(m.update_entropy(1.0) for _ in range(2 * W))
    assert not m.update_entropy(1.0)  # fired already
    m.reset()
    assert (m.fired, m.n_tokens) == (False, 0)
    assert [m.update_entropy(1.0) for _ in range(2 * W)].index(True) == 2 * W - 1


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"threshold": -1.0}, {"threshold": math.nan}, {"min_tokens": -1}, {"budget": 0}])
def test_monitor_rejects_bad_params(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ThinkingMonitor(**kwargs)


# ── intervention text and thinking state ───────────────────────────────────────────────────────────────


def test_intervention_text() -> None:
    assert INTERVENTION_TEXT == "\n</think>\n"
    assert intervention_text() == "\n</think>\n"
    assert intervention_text("solution") == "\n</think>\n<solution>"


@pytest.mark.parametrize(
    ("text", "prefilled", "expected"),
    [
        ("", False, False),
        ("", True, True),
        ("<think>let me", False, True),
        ("<think>a</think> answer", False, False),
        ("a</think> answer", True, False),
        ("<think>a</think><think>b", False, True),
        ("plain answer", False, False),
    ],
)
def test_thinking_open(text: str, prefilled: bool, expected: bool) -> None:
    assert thinking_open(text, prefilled=prefilled) is expected


# ── turn-level resampling ──────────────────────────────────────────────────────────────────────────────


def test_turn_uncertainty() -> None:
    assert turn_uncertainty([1.0, 2.0, 3.0]) == 2.0
    assert turn_uncertainty([]) == 0.0


RESAMPLE_TABLE = [
    # (id, prev, cur, eta, tries, max_try, expected)
    ("first turn", None, 1.0, 0.3, 0, 2, False),
    ("Δ = 0 excluded", 1.0, 1.0, 0.3, 0, 2, False),
    ("0 < Δ < η", 1.0, 1.1, 0.3, 0, 2, True),
    ("Δ < 0, small: absolute", 1.0, 0.9, 0.3, 0, 2, True),
    ("Δ < 0, large: absolute", 1.0, 0.5, 0.3, 0, 2, False),
    ("Δ = η excluded", 1.0, 1.25, 0.25, 0, 2, False),
    ("Δ > η", 1.0, 2.0, 0.3, 0, 2, False),
    ("one try left", 1.0, 1.1, 0.3, 1, 2, True),
    ("max_try reached", 1.0, 1.1, 0.3, 2, 2, False),
    ("max_try 0 disables", 1.0, 1.1, 0.3, 0, 0, False),
]


@pytest.mark.parametrize(("prev", "cur", "eta", "tries", "max_try", "expected"), [t[1:] for t in RESAMPLE_TABLE], ids=[t[0] for t in RESAMPLE_TABLE])
def test_should_resample(prev: float | None, cur: float, eta: float, tries: int, max_try: int, expected: bool) -> None:
    assert should_resample(prev, cur, eta, tries, max_try) is expected


def test_resample_loop_as_in_the_t2po_code() -> None:
    """The loop a rollout runs: regenerate while 0 < Δ < η, at most max_try times, keep the last draft."""
    cfg = T2POConfig(turn_resample=True, eta=0.3, max_try=2)
    counters = T2POCounters()
    drafts = iter([1.05, 1.1, 1.2, 9.0])  # every draft qualifies: the cap stops it after 2 regenerations
    prev, u, tries = 1.0, next(drafts), 0
    while cfg.resample(prev, u, tries):
        u, tries = next(drafts), tries + 1
        counters.resamples += 1
    assert (u, tries, counters.as_dict()) == (1.2, 2, {"interventions": 0, "resamples": 2})


def test_resample_switch_off() -> None:
    assert T2POConfig().resample(1.0, 1.1, 0) is False
    assert T2POConfig(turn_resample=True).resample(1.0, 1.1, 0) is True


# ── config ─────────────────────────────────────────────────────────────────────────────────────────────


def test_config_defaults_are_off_and_frozen() -> None:
    cfg = T2POConfig()
    assert (cfg.thinking_intervention, cfg.turn_resample) == (False, False)
    assert (cfg.eta, cfg.max_try, cfg.think_budget) == (0.3, 2, 500)
    with pytest.raises(ValidationError):
        cfg.eta = 0.5  # type: ignore[misc]


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"eta": 0.0}, {"max_try": -1}, {"top_logprobs": 0}, {"unknown": 1}])
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValidationError):
        T2POConfig(**kwargs)


# ── a fresh seed per regeneration ──────────────────────────────────────────────────────────────────────


def test_each_regeneration_gets_its_own_seed_reproducibly() -> None:
    from agents.t2po import RESAMPLE_SEEDS, resample_seed

    # a regeneration is a new sample: never a seed that another draft of these runs samples with. The first drafts
    # sample with run seed · 1000 + turn (turn < 64, AgentConfig.max_turns); take runs 0..29, turns 0..29, 3 regenerations each
    first_drafts = {run * 1000 + turn for run in range(30) for turn in range(64)}
    seeds = [resample_seed(run, turn, d) for run in range(30) for turn in range(30) for d in (1, 2, 3)]
    assert len(set(seeds)) == len(seeds) == 30 * 30 * 3  # distinct per (run, turn, draft)
    assert not first_drafts & set(seeds)
    assert all(isinstance(s, int) and RESAMPLE_SEEDS[0] <= s < RESAMPLE_SEEDS[1] <= 2**63 for s in seeds)  # int64, as the engines take
    assert resample_seed(7, 3, 2) == resample_seed(7, 3, 2)  # the same run reruns the same regenerations
    # an unseeded run samples every draft from the engine's own randomness, regenerations included
    assert resample_seed(None, 3, 1) is None and resample_seed(None, 3, 2) is None
    with pytest.raises(ValueError):
        resample_seed(7, 3, 0)  # draft 0 is the turn's own sample, seeded by the loop


# ── thinking tokens of a stream chunk, one token at a time ────────────────────────────────────────────


def decoder_of(texts: list[str]):
    """``decode`` of a chunk whose tokens (ids 0, 1, ...) decode to ``texts``."""
    return lambda ids: "".join(texts[i] for i in ids)


def no_decode(ids) -> str:
    raise AssertionError("no tag ends in this chunk: its tokens need not be decoded one by one")


@pytest.mark.parametrize(
    ("before", "texts", "expected"),
    [
        ("", ["<think>", " a", " b"], [True, True, True]),  # the token that opens the span is a thinking token
        ("", ["x", "<think>", " a", "</think>", " y"], [False, True, True, False, False]),  # the closing token is not
        ("<thi", ["nk>", " a"], [True, True]),  # a tag split across chunks
        ("<think> a </th", ["ink>", " b"], [False, False]),
        ("", ["<", "think", ">", " a"], [False, False, True, True]),  # a tag of several tokens opens at its last
    ],
)
def test_thinking_tokens_of_a_chunk(before: str, texts: list[str], expected: list[bool]) -> None:
    from agents.t2po import thinking_tokens

    assert thinking_tokens(before, "".join(texts), list(range(len(texts))), decoder_of(texts)) == expected


def test_thinking_tokens_without_a_tag_in_the_chunk_decode_nothing() -> None:
    from agents.t2po import thinking_tokens

    assert thinking_tokens("<think> a", " b c d", [0, 1, 2], no_decode) == [True, True, True]
    assert thinking_tokens("<think> a</think>", " b c", [0, 1], no_decode) == [False, False]
    assert thinking_tokens("plain", " b", [0], no_decode) == [False]


def test_chunk_cut_fires_at_the_token_not_at_the_chunk_end() -> None:
    from agents.t2po import chunk_cut

    # window 2, min_tokens 0: flat uncertainty fires at the 4th thinking token (two full windows, Δ = 0)
    m = ThinkingMonitor(window=2, threshold=0.05, min_tokens=0)
    chunk = [(math.nan, ()), *[(-1.0, ())] * 6]  # token 0 is no thinking token: its (invalid) logprob is never read
    thinking = [False, *[True] * 6]
    assert chunk_cut(m, chunk, thinking) == 4  # chunk index of the 4th thinking token; tokens 5 and 6 are cut off
    assert (m.fired_at, m.n_tokens) == (3, 4)
    # a chunk that ends before the monitor fires: fed whole, no cut; the next chunk fires at its first token
    m = ThinkingMonitor(window=2, threshold=0.05, min_tokens=0)
    assert chunk_cut(m, [(-1.0, ())] * 3, [True] * 3) is None
    assert chunk_cut(m, [(-1.0, ())] * 3, [True] * 3) == 0
