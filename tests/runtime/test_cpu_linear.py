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
