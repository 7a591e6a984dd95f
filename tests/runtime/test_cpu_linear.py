"""The packed CPU linears give F.linear's results in fp32 and bf16 on whatever CPU runs the suite.

An AVX2-only CPU cannot pack bf16 weights in oneDNN (it raises at the reorder): before ``bf16_packable``
the bf16 engine (``--dtype bfloat16``) failed to build there; now those linears take ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.engines.cpu_linear import Packed, bf16_packable, pack, pack_linears


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_f_linear(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(5, 32, generator=g).to(dtype)
    p = Packed(w, b)
    torch.testing.assert_close(p(x), F.linear(x, w, b))  # oneDNN may sum in another order: dtype-default tolerances
    if dtype == torch.bfloat16:
        assert p.onednn == bf16_packable()


def test_stacked_and_patched_linears_in_bf16() -> None:
    torch.manual_seed(1)
    q, k = nn.Linear(32, 16, bias=False).bfloat16(), nn.Linear(32, 8, bias=False).bfloat16()
    x = torch.randn(3, 32).bfloat16()
    with torch.inference_mode():
        out = pack([q, k])(x)
        torch.testing.assert_close(out, torch.cat([F.linear(x, q.weight), F.linear(x, k.weight)], dim=-1), rtol=1.6e-2, atol=1e-2)
    model = nn.Sequential(nn.Linear(32, 32).bfloat16())
    with torch.inference_mode():
        want = F.linear(x, model[0].weight, model[0].bias)
        assert pack_linears(model) == (1 if bf16_packable() else 0)
        torch.testing.assert_close(model(x), want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_epilogues_equal_the_separate_ops(dtype: torch.dtype) -> None:
    """The fused epilogues (the lean runner's residual add, SiLU of the gate, × the up projection) give what the
    separate ops give: silu(xW^T + b), xW^T + b + r, (xW^T + b) * r; and leave ``r`` as it was."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 24, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    x = torch.randn(7, 24, generator=g).to(dtype)
    r = torch.randn(7, 40, generator=g).to(dtype)
    r0 = r.clone()
    p = Packed(w, b)
    tol = {} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-2}  # bf16: one rounding fewer fused
    y = F.linear(x.float(), w.float(), b.float())
    with torch.inference_mode():
        torch.testing.assert_close(p.silu(x).float(), F.silu(y), **tol)
        torch.testing.assert_close(p.add(x, r).float(), y + r.float(), **tol)
        torch.testing.assert_close(p.mul(x, r).float(), y * r.float(), **tol)
    assert torch.equal(r, r0)
