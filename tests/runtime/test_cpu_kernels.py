"""The compiled attention kernels against the definition of attention, computed in float64.

    prompt: out[i, h] = softmax_j<=start+i(q[i, h] . k[h // G, j] * scale) @ v[h // G, :start+i+1]
    decode: out[r, h] = softmax_j<=lengths[r](q[r, h] . k[r, h // G, j] * scale) @ v[r, h // G, :lengths[r]+1]

The kernel rounds what bf16 hardware rounds (its inputs, the probabilities before ``P v``, the output), so the bound is
a few bf16 steps of the values' scale; a wrong causal offset, head group, stride or padded key is off by the values'
whole scale. It skips where the kernels are not used (no AVX512-BF16, or AMX), saying so.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.engines import cpu_kernels


def _ops() -> cpu_kernels.Ops:
    if cpu_kernels.why_not() is not None:
        pytest.skip(f"the kernels are not used on this machine: {cpu_kernels.why_not()}")
    ops = cpu_kernels.ops()
    if ops is None:
        pytest.skip("the kernels did not build here (see the log's cpu_kernels.unavailable)")
    return ops


def _definition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    n, H, _ = q.shape
    G = H // k.shape[0]
    out = torch.empty(n, H, q.shape[2], dtype=torch.float64)
    for i in range(n):
        for h in range(H):
            keys, vals = k[h // G, : start + i + 1].double(), v[h // G, : start + i + 1].double()
            w = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ vals
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 90),
    start=st.integers(0, 300),
    extra=st.integers(0, 70),  # staging room past the chunk's end (a prompt longer than this chunk)
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([64, 128]),
    spread=st.sampled_from([0.5, 3.0, 12.0]),  # score scale: flat to peaked softmax
    seed=st.integers(0, 2**16),
)
def test_the_prompt_kernel_is_causal_attention(
    n: int, start: int, extra: int, kv_heads: int, group: int, head_dim: int, spread: float, seed: int
) -> None:
    op = _ops().prompt
    g = torch.Generator().manual_seed(seed)
    H, L = kv_heads * group, start + n + extra
    # q as the runner passes it: a strided view of the fused (n, H + 2K, D) projection
    fused = torch.randn(n, H + 2 * kv_heads, head_dim, generator=g).mul(spread).bfloat16()
    q = fused[:, :H]
    k = torch.randn(kv_heads, L, head_dim, generator=g).bfloat16()
    v = torch.randn(kv_heads, L, head_dim, generator=g).bfloat16()
    v[:, start + n :] = float("nan")  # keys past the chunk's end must not be read into the output
    scale = head_dim**-0.5
    got = op(q, k, v, start, scale)
    assert got.shape == (n, H, head_dim) and got.dtype == torch.bfloat16
    want = _definition(q, k, v, start, scale)
    bound = 2**-6 * float(v[:, : start + n].abs().max())  # P rounded to bf16 (2^-9 relative) summed, the output's rounding
    err = (got.double() - want).abs().max().item()
    assert err <= bound, (err, bound)


def test_the_first_query_sees_only_the_first_key() -> None:
    """start 0: query 0's output is v[0] exactly (one key, probability 1), whatever the scores."""
    op = _ops().prompt
    q = torch.randn(5, 6, 64).mul(30).bfloat16()
    k, v = torch.randn(2, 5, 64).bfloat16(), torch.randn(2, 5, 64).bfloat16()
    out = op(q, k, v, 0, 0.125)
    for h in range(6):
        assert torch.equal(out[0, h], v[h // 3, 0])


def test_bad_shapes_are_refused() -> None:
    op = _ops().prompt
    q, k = torch.randn(4, 2, 64).bfloat16(), torch.randn(1, 4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="keys 0 .. start"):
        op(q, k, k, 1, 0.1)  # 5 keys needed, 4 given
    with pytest.raises(RuntimeError, match="multiple of 64"):
        op(torch.randn(4, 2, 32).bfloat16(), torch.randn(1, 4, 32).bfloat16(), torch.randn(1, 4, 32).bfloat16(), 0, 0.1)
    with pytest.raises(RuntimeError, match="bf16"):
        op(q.float(), k, k, 0, 0.1)
    assert not cpu_kernels.takes(32, torch.bfloat16) and not cpu_kernels.takes(64, torch.float32)


def test_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWISE_CPU_KERNELS", "torch")
    assert cpu_kernels.why_not() == "LOOPWISE_CPU_KERNELS=torch"
    cpu_kernels.ops.cache_clear()
    try:
        assert cpu_kernels.ops() is None
    finally:
        cpu_kernels.ops.cache_clear()


def _decode_definition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    n, H, D = q.shape
    G = H // k.shape[1]
    out = torch.empty(n, H, D, dtype=torch.float64)
    for r in range(n):
        keys = int(lengths[r]) + 1
        for h in range(H):
            w = torch.softmax(k[r, h // G, :keys].double() @ q[r, h].double() * scale, dim=0)
            out[r, h] = w @ v[r, h // G, :keys].double()
    return out


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 20),
    spare=st.integers(0, 5),  # rows allocated past the ones in use
    cap=st.sampled_from([8, 64, 100, 256]),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 6),
    head_dim=st.sampled_from([64, 128]),
    spread=st.sampled_from([0.5, 3.0, 12.0]),
    write_new=st.booleans(),  # the kernel first writes this step's key and value into the pool (the runner's way)
    data=st.data(),
)
def test_the_decode_kernel_is_attention_over_each_rows_keys(
    n: int, spare: int, cap: int, kv_heads: int, group: int, head_dim: int, spread: float, write_new: bool, data: st.DataObject
) -> None:
    op = _ops().decode
    seed = data.draw(st.integers(0, 2**16))
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, cap - 1), min_size=n, max_size=n)), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    H = kv_heads * group
    fused = torch.randn(n, H + 2 * kv_heads, head_dim, generator=g).mul(spread).bfloat16()
    q = fused[:, :H]  # strided, as the runner passes it (q, k and v are column ranges of one projection)
    k_new, v_new = fused[:, H : H + kv_heads], fused[:, H + kv_heads :]
    k = torch.randn(n + spare, kv_heads, cap, head_dim, generator=g).bfloat16()
    v = torch.randn(n + spare, kv_heads, cap, head_dim, generator=g).bfloat16()
    for r in range(n):  # a row's columns past its length must not be read
        k[r, :, int(lengths[r]) + 1 :] = float("nan")
        v[r, :, int(lengths[r]) + 1 :] = float("nan")
    k[n:] = float("nan")
    v[n:] = float("nan")
    k_after, v_after = k.clone(), v.clone()  # the pools as they must be after the call
    if write_new:
        for r in range(n):
            at = int(lengths[r])
            k_after[r, :, at], v_after[r, :, at] = k_new[r], v_new[r]
            k[r, :, at] = v[r, :, at] = float("nan")  # unwritten, the step's column would poison the output
    scale = head_dim**-0.5
    got = op(q, k, v, lengths, scale, k_new, v_new) if write_new else op(q, k, v, lengths, scale)
    assert got.shape == (n, H, head_dim) and got.dtype == torch.bfloat16
    # bit for bit, NaN included: the step's columns written, nothing else touched
    assert torch.equal(k.view(torch.int16), k_after.view(torch.int16)) and torch.equal(v.view(torch.int16), v_after.view(torch.int16))
    want = _decode_definition(q, k, v, lengths, scale)
    bound = 2**-7 * float(torch.nan_to_num(v[:n], nan=0.0).abs().max())  # the output's bf16 rounding and fp32 sums
    err = (got.double() - want).abs().max().item()
    assert err <= bound, (err, bound)


def test_the_decode_kernel_refuses_a_length_outside_the_pool() -> None:
    op = _ops().decode
    q, k = torch.randn(2, 3, 64).bfloat16(), torch.randn(2, 1, 16, 64).bfloat16()
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, k, k, torch.tensor([3, 16]), 0.1)
    with pytest.raises(RuntimeError, match="int64"):
        op(q, k, k, torch.tensor([3, 5], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="both or neither"):
        op(q, k, k, torch.tensor([3, 5]), 0.1, torch.randn(2, 1, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match="k_new and v_new"):
        op(q, k, k, torch.tensor([3, 5]), 0.1, torch.randn(2, 2, 64).bfloat16(), torch.randn(2, 2, 64).bfloat16())


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    vocab=st.integers(1, 3000),
    grid=st.sampled_from([0.0, 0.5, 4.0]),  # values rounded to multiples of it: ties (0: none forced)
    spread=st.sampled_from([1.0, 30.0]),
    masked=st.floats(0.0, 0.95),  # the share set to -inf, as a grammar mask does
    seed=st.integers(0, 2**16),
)
def test_argmax_lse_is_each_rows_first_maximum_and_log_sum_exp(rows: int, vocab: int, grid: float, spread: float, masked: float, seed: int) -> None:
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * spread
    if grid:
        x = torch.round(x / grid) * grid
    x[torch.rand(rows, vocab, generator=g) < masked] = float("-inf")
    x[:, int(torch.randint(vocab, (1,), generator=g))] = 0.0  # at least one allowed token per row
    ids, lse = _ops().argmax_lse(x)
    assert ids.dtype == torch.long and lse.dtype == torch.float32 and ids.shape == lse.shape == (rows,)
    assert ids.tolist() == [int(np.argmax(r)) for r in x.numpy()]  # numpy's argmax: the first of tied maxima
    want = torch.logsumexp(x.double(), dim=-1)
    # fp32 terms and sums (a relative 1e-6 of the sum: 1e-6 of the log), then the result's own rounding
    bound = 2e-6 + 2 * torch.from_numpy(np.spacing(want.abs().float().numpy())).double()
    assert ((lse.double() - want).abs() <= bound).all(), ((lse.double() - want).abs().max(), bound.max())


def test_argmax_lse_gives_a_non_finite_lse_where_a_row_is_no_distribution() -> None:
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.0, nan, 3.0], [-inf, -inf, -inf], [1.0, inf, 2.0], [2.0, 5.0, 5.0]])
    ids, lse = _ops().argmax_lse(x)
    assert torch.isnan(lse[0]) and lse[1].item() == -inf and not torch.isfinite(lse[2])
    assert ids[3].item() == 1 and lse[3].item() == pytest.approx(math.log(math.exp(2) + 2 * math.exp(5)), abs=1e-6)
    with pytest.raises(RuntimeError, match="fp32"):
        _ops().argmax_lse(x.double())
    with pytest.raises(RuntimeError, match="rows contiguous"):
        _ops().argmax_lse(x.t())


def _torch_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm as the runner's PyTorch path computes it."""
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * w


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), width=st.sampled_from([64, 576, 1024]), spread=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**16))
def test_rms_norm_is_transformers_rmsnorm_in_bf16(rows: int, width: int, spread: float, seed: int) -> None:
    """The same bf16 numbers as the PyTorch path, up to the fp32 sum's order: rarely, the normalised value rounds to
    the neighbouring bf16 number before the weight multiplies it (then the product rounds again)."""
    ops = _ops()
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, width + 32, generator=g).mul(spread).bfloat16()
    x = wide[:, :width]  # rows strided, as a slice of a wider activation
    w = torch.randn(width, generator=g).bfloat16()
    got, want = ops.rms_norm(x, w, 1e-5), _torch_rms(x, w, 1e-5)
    differ = got != want
    assert int(differ.sum()) <= max(1, got.numel() // 1000)
    step = want.float().abs() * 2**-7 + 1e-30  # one bf16 step at the value's scale, at most
    # one step of the normalised value carried through the weight, plus the product's own rounding
    assert bool(((got.float() - want.float()).abs() <= 2 * step).all())


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), heads=st.integers(1, 5), extra=st.integers(0, 3), head_dim=st.sampled_from([64, 128]), seed=st.integers(0, 2**16))
def test_rope_is_transformers_rotary_in_bf16_in_place(rows: int, heads: int, extra: int, head_dim: int, seed: int) -> None:
    """x cos + rotate_half(x) sin with bf16 rounding after each op, exactly; the heads past ``heads`` are untouched."""
    ops = _ops()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads + extra, head_dim, generator=g).mul(4).bfloat16()
    angle = torch.rand(rows, head_dim // 2, generator=g) * 300
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1).bfloat16(), torch.cat([angle.sin(), angle.sin()], -1).bfloat16()
    half = head_dim // 2
    rot = x[:, :heads]
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)  # transformers' rotate_half
    want = rot * cos[:, None] + rotated * sin[:, None]
    before = x.clone()
    ops.rope_(x, cos, sin, heads)
    assert torch.equal(x[:, :heads], want)
    assert torch.equal(x[:, heads:], before[:, heads:])


def test_a_failed_build_leaves_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler, no ninja, an assembler without AVX512-BF16: ``ops()`` is None (the runner then serves through
    PyTorch's ops), on any CPU."""
    from torch.utils import cpp_extension

    def broken(**_: object) -> None:
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(cpu_kernels, "why_not", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", broken)
    cpu_kernels.ops.cache_clear()
    try:
        assert cpu_kernels.ops() is None
    finally:
        cpu_kernels.ops.cache_clear()
