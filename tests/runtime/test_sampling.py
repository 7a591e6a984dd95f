"""runtime/engines/sampling.py: batched per-row sampling, logprobs and top-p, on hand-made logits; and each choice's seed (runtime/generation.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.engines import cpu_kernels
from runtime.engines.sampling import ArgmaxLse, RowSampling, _top_p_probs, sample_next


@pytest.fixture(params=["torch", "compiled"])
def compiled(request: pytest.FixtureRequest) -> ArgmaxLse | None:
    """None (PyTorch's argmax and logsumexp), or the compiled ``argmax_lse`` where this machine builds the kernels."""
    if request.param == "torch":
        return None
    ops = cpu_kernels.ops() if cpu_kernels.why_not() is None else None
    if ops is None:
        pytest.skip(f"the compiled kernels are not used here: {cpu_kernels.why_not() or 'the build failed'}")
    return ops.argmax_lse


def row(temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None, top_logprobs: int = 0) -> RowSampling:
    return RowSampling(temperature=temperature, top_p=top_p, generator=generator, top_logprobs=top_logprobs)


LOGITS = torch.tensor(
    [
        [1.0, 3.0, 2.0, -1.0, 0.5],
        [0.0, -2.0, 0.1, 4.0, 3.9],
    ]
)


def test_greedy_picks_argmax_with_log_softmax_logprob() -> None:
    out = sample_next(LOGITS.clone(), [row(), row()])
    assert out.token_ids == [1, 3]
    expected = torch.log_softmax(LOGITS, dim=-1)
    assert out.logprobs == pytest.approx([expected[0, 1].item(), expected[1, 3].item()], abs=1e-6)
    # hand check of row 0: log(e^3 / sum e^x)
    denom = sum(math.exp(x) for x in [1.0, 3.0, 2.0, -1.0, 0.5])
    assert out.logprobs[0] == pytest.approx(3.0 - math.log(denom), abs=1e-6)
    assert out.top == [[], []]


@pytest.mark.parametrize("where", [[17, 60], [3, 19], [40, 41, 95], [0, 99]])
def test_greedy_takes_the_first_of_tied_maxima(where: list[int], compiled: ArgmaxLse | None) -> None:
    """Ties in one 16-wide lane, across lanes and across blocks: the lowest index, as ``torch.argmax`` documents."""
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(sum(where)))
    logits[1, where] = 9.0
    logits[2, :] = float("-inf")  # a grammar allowing two tokens, tied
    logits[2, where[-2:]] = 0.5
    out = sample_next(logits.clone(), [row(), row(), row()], compiled)
    assert out.token_ids[1:] == [where[0], where[-2]]
    assert out.logprobs[2] == pytest.approx(math.log(0.5), abs=1e-6)


def test_temperature_scales_the_logprobs() -> None:
    g = torch.Generator().manual_seed(0)
    out = sample_next(LOGITS.clone(), [row(temperature=0.5, generator=g), row(temperature=2.0, generator=g)])
    lp0 = torch.log_softmax(LOGITS[0] / 0.5, dim=-1)
    lp1 = torch.log_softmax(LOGITS[1] / 2.0, dim=-1)
    assert out.logprobs[0] == pytest.approx(lp0[out.token_ids[0]].item(), abs=1e-6)
    assert out.logprobs[1] == pytest.approx(lp1[out.token_ids[1]].item(), abs=1e-6)
    # and they differ from the unscaled distribution
    raw = torch.log_softmax(LOGITS, dim=-1)
    assert abs(out.logprobs[0] - raw[0, out.token_ids[0]].item()) > 1e-3


def test_temperature_logprobs_in_top_list_are_scaled() -> None:
    out = sample_next(LOGITS[:1].clone(), [row(temperature=0.5, generator=torch.Generator().manual_seed(1), top_logprobs=5)])
    lp = torch.log_softmax(LOGITS[0] / 0.5, dim=-1)
    assert [i for i, _ in out.top[0]] == [1, 2, 0, 4, 3]
    assert [v for _, v in out.top[0]] == pytest.approx([lp[i].item() for i in [1, 2, 0, 4, 3]], abs=1e-6)


def test_tiny_top_p_always_picks_argmax_when_sampling() -> None:
    logits = torch.tensor([[0.0, 0.2, 0.1, 0.15]])  # nearly flat: sampling would wander without top-p
    g = torch.Generator().manual_seed(123)
    picks = {sample_next(logits.clone(), [row(temperature=1.0, top_p=1e-6, generator=g)]).token_ids[0] for _ in range(50)}
    assert picks == {1}


def test_flat_distribution_without_top_p_does_wander() -> None:
    # the counterpart of the test above: it is top-p, not the logits, that pins the choice
    logits = torch.tensor([[0.0, 0.2, 0.1, 0.15]])
    g = torch.Generator().manual_seed(123)
    picks = {sample_next(logits.clone(), [row(temperature=1.0, generator=g)]).token_ids[0] for _ in range(50)}
    assert len(picks) >= 3


def test_seeded_generator_reproduces_draws() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(7))

    def draws(seed: int) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(seed + i) for i in range(3)]
        rows = [row(temperature=1.0, generator=g) for g in gens]
        return [sample_next(logits.clone(), rows).token_ids for _ in range(20)]

    a, b, c = draws(10), draws(10), draws(99)
    assert a == b
    assert a != c


def test_mixed_top_logprobs_per_row() -> None:
    out = sample_next(LOGITS.clone(), [row(top_logprobs=0), row(top_logprobs=3)])
    assert out.top[0] == []
    assert len(out.top[1]) == 3
    lp1 = torch.log_softmax(LOGITS[1], dim=-1)
    assert [i for i, _ in out.top[1]] == [3, 4, 2]
    vals = [v for _, v in out.top[1]]
    assert vals == sorted(vals, reverse=True)
    assert vals == pytest.approx([lp1[3].item(), lp1[4].item(), lp1[2].item()], abs=1e-6)
    # the chosen (greedy) token is the first of its top list, with the same logprob
    assert out.top[1][0][0] == out.token_ids[1]
    assert out.top[1][0][1] == pytest.approx(out.logprobs[1], abs=1e-7)


def test_greedy_and_sampled_rows_in_one_batch() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, -30.0, 30.0], [9.0, 0.0, 0.0]])
    out = sample_next(logits.clone(), [row(), row(temperature=1.0, generator=g), row()])
    assert out.token_ids == [1, 2, 0]


def test_masked_tokens_are_never_sampled() -> None:
    inf = float("-inf")
    logits = torch.tensor([[5.0, inf, 0.0, inf, -1.0], [inf, 0.0, inf, 0.0, inf]])
    g = torch.Generator().manual_seed(5)
    seen: set[tuple[int, int]] = set()
    for _ in range(200):
        out = sample_next(logits.clone(), [row(temperature=2.0, generator=g), row(temperature=1.0, generator=g)])
        seen.add((0, out.token_ids[0]))
        seen.add((1, out.token_ids[1]))
        assert all(math.isfinite(lp) for lp in out.logprobs)
    assert {t for r, t in seen if r == 0} == {0, 2, 4}
    assert {t for r, t in seen if r == 1} == {1, 3}


def test_masked_tokens_greedy_logprob_after_mask() -> None:
    inf = float("-inf")
    logits = torch.tensor([[10.0, 1.0, inf, 1.0]])
    logits[0, 0] = inf  # the grammar forbids the model's favourite
    out = sample_next(logits.clone(), [row(top_logprobs=2)])
    assert out.token_ids == [1]  # first of the tied maxima
    assert out.logprobs[0] == pytest.approx(math.log(0.5), abs=1e-6)


def test_top_p_hand_computed_example() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = _top_p_probs(probs, torch.tensor([0.7]))
    assert out[0].tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])


def test_top_p_keeps_the_token_crossing_the_threshold_and_respects_order() -> None:
    probs = torch.tensor([[0.05, 0.15, 0.5, 0.3], [0.25, 0.25, 0.25, 0.25]])
    out = _top_p_probs(probs, torch.tensor([0.81, 0.45]))
    # row 0: 0.5 + 0.3 = 0.8 < 0.81, so 0.15 (crossing it) stays; 0.05 goes
    assert out[0].tolist() == pytest.approx([0.0, 0.15, 0.5, 0.3])
    # row 1: ties; 0.25 < 0.45 so a second token is needed, 0.5 > 0.45 so not a third
    assert int((out[1] > 0).sum()) == 2
    assert float(out[1].sum()) == pytest.approx(0.5)


def test_top_p_one_is_identity() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.equal(_top_p_probs(probs, torch.tensor([1.0])), probs)


def test_top_p_mixed_rows_only_truncate_their_own_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = _top_p_probs(probs, torch.tensor([1.0, 0.4]))
    assert out[0].tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])
    assert out[1].tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(-(2**63), 2**63 - 1), i=st.integers(0, 15))
def test_each_choices_seed_is_seed_plus_i_wrapped_into_int64(seed: int, i: int) -> None:
    """Choice i of a request is seeded ``seed + i``; at ``seed = 2**63 - 1`` that left int64, which vLLM and SGLang refuse
    (a 400 naming the engine's field, not the client's)."""
    from runtime.generation import _choice_seed

    got = _choice_seed(seed, i)
    assert -(2**63) <= got < 2**63
    assert got == (seed + i if seed + i < 2**63 else seed + i - 2**64)


@pytest.mark.parametrize(
    ("temperature", "top_p", "expected"),
    [
        # softmax(log p / T) at T = 1 is p itself; token 1 is masked (-inf), token 3's mass is 0.3
        (1.0, 1.0, [0.1, 0.0, 0.6, 0.3]),
        # T = 0.5 squares and renormalises: p^2 / sum p^2 = [0.01, 0, 0.36, 0.09] / 0.46
        (0.5, 1.0, [0.01 / 0.46, 0.0, 0.36 / 0.46, 0.09 / 0.46]),
        # top-p 0.85 at T = 1: 0.6 (cum before 0) and 0.3 (cum before 0.6 < 0.85) stay, 0.1 (cum before 0.9) goes
        (1.0, 0.85, [0.0, 0.0, 2 / 3, 1 / 3]),
    ],
)
def test_sampled_frequencies_follow_the_distribution(temperature: float, top_p: float, expected: list[float]) -> None:
    """The drawn tokens' frequencies match the distribution they are drawn from (within 5 standard errors over 40,000
    draws), and a token of probability 0 (masked or cut by top-p) is never drawn."""
    logits = torch.tensor([[math.log(0.1), -math.inf, math.log(0.6), math.log(0.3)]]).repeat(4_000, 1)
    gens = [torch.Generator().manual_seed(1_000 + i) for i in range(4_000)]
    rows = [row(temperature=temperature, top_p=top_p, generator=g) for g in gens]
    counts = [0] * 4
    for _ in range(10):
        for t in sample_next(logits.clone(), rows).token_ids:
            counts[t] += 1
    n = sum(counts)
    for tok, p in enumerate(expected):
        if p == 0.0:
            assert counts[tok] == 0, (tok, counts)
        else:
            assert abs(counts[tok] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (tok, counts[tok] / n, p)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    spec=st.lists(
        st.tuples(
            st.lists(st.one_of(st.floats(-30, 30), st.just(-math.inf)), min_size=7, max_size=7),
            st.sampled_from(["ok", "nan", "all_masked", "pos_inf"]),
            st.sampled_from([0.0, 0.3, 1.0, 1.7]),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_logprobs_and_failures_follow_the_definition(spec: list[tuple[list[float], str, float, int]], compiled: ArgmaxLse | None) -> None:
    """Any batch: a row fails exactly when its logits hold a NaN or +inf or allow nothing; every other row's logprob is
    ``log_softmax(logits / T)`` at its token (T = 1 for greedy rows), computed here in float64, its greedy token is the
    first argmax of its logits, and its top list is the best ``top_logprobs`` finite logprobs of that distribution. With
    PyTorch's argmax and logsumexp, and with the compiled kernel where it is built."""
    rows_logits, rows = [], []
    for values, kind, temperature, k in spec:
        v = list(values)
        if kind == "nan":
            v[3] = math.nan
        elif kind == "all_masked":
            v = [-math.inf] * len(v)
        elif kind == "pos_inf":
            v[2] = math.inf
        elif all(x == -math.inf for x in v):
            v[0] = 0.0
        rows_logits.append(v)
        rows.append(row(temperature=temperature, generator=torch.Generator().manual_seed(7), top_logprobs=k))
    logits = torch.tensor(rows_logits, dtype=torch.float32)
    out = sample_next(logits.clone(), rows, compiled)
    for i, (_, kind, temperature, k) in enumerate(spec):
        assert out.failed[i] == (kind != "ok"), (i, kind)
        if out.failed[i]:
            continue
        t = 1.0 if temperature == 0.0 else temperature
        ref = torch.log_softmax(logits[i].double() / t, dim=-1)
        tok = out.token_ids[i]
        assert ref[tok].item() > -math.inf  # a masked token is never chosen
        assert out.logprobs[i] == pytest.approx(ref[tok].item(), abs=1e-4)
        if temperature == 0.0:
            assert tok == logits[i].tolist().index(logits[i].max().item())  # the first of tied maxima, as torch.argmax
        finite = sorted((x for x in ref.tolist() if x > -math.inf), reverse=True)[:k]
        assert [v for _, v in out.top[i]] == pytest.approx(finite, abs=1e-4)
        assert all(ref[j].item() == pytest.approx(v, abs=1e-4) for j, v in out.top[i])


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 1300),
    st.lists(st.tuples(st.integers(0, 1299), st.floats(1e-6, 5.0)), min_size=1, max_size=12),
    st.integers(0, 2**31 - 1),
)
def test_inverse_cdf_draws_the_token_a_full_cumulative_sum_names(vocab: int, mass: list[tuple[int, float]], seed: int) -> None:
    """The draw is the first token whose float64 cumulative mass exceeds ``u`` times the total, with ``u`` the row's one
    uniform draw, whatever the vocabulary (a partial last block, mass spread over several blocks, empty blocks), and
    never a token of mass 0."""
    from runtime.engines.sampling import _inverse_cdf

    probs = torch.zeros(3, vocab)
    for tok, m in mass:
        probs[0, tok % vocab] += m
    probs[1, -1] = 1.0  # all mass on the last token
    probs[2] = 1.0  # flat
    gens = [torch.Generator().manual_seed(seed + i) for i in range(3)]
    us = [torch.rand(1, generator=torch.Generator().manual_seed(seed + i), dtype=torch.float64).item() for i in range(3)]
    got = _inverse_cdf(probs, gens).tolist()
    for r, (u, tok) in enumerate(zip(us, got, strict=True)):
        cdf = probs[r].double().cumsum(0)
        expected = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=torch.float64), right=True).item())
        assert probs[r, tok] > 0
        assert tok == min(expected, vocab - 1), (r, u, tok, expected)
