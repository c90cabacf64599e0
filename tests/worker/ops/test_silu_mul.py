"""SwiGLU's activation kernel (``silu_mul_triton``) under the interpreter against torch's
``F.silu(gate) * up`` (``MLP.forward``'s torch form), on fresh random values over a wide range
(silu's tails included): every element is torch's or one step of the dtype from it (the
kernel's exp against torch's, a last fp32 bit that a rounding may carry), nearly all equal in
bf16 and fp16; in fp32 within 8 ulps."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from services.worker.ops.silu_mul_triton import silu_mul_triton

# exp(-g) overflows to inf for very negative g, giving silu = -0 as torch's; numpy warns
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

STEP = {torch.float32: 8 * 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2048), (5, 300), (3, 2, 1500), (7, 1)])
def test_silu_mul_matches_torch(shape, dtype) -> None:
    g = torch.Generator().manual_seed(shape[-1])
    scale = torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1), generator=g).float())
    gate = (torch.randn(shape, generator=g) * scale * 4).to(dtype)
    up = (torch.randn(shape, generator=g) * scale).to(dtype)
    out = silu_mul_triton(gate, up)
    ref = F.silu(gate) * up
    assert out.dtype == dtype and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    assert (diff <= STEP[dtype] * ref.float().abs()).all()
    if dtype != torch.float32:  # the last fp32 bit shows after a rounding only rarely
        assert (out == ref).float().mean() >= 0.99


def test_silu_mul_tails_and_strides() -> None:
    """Saturated silu (-0 and the identity), a non-contiguous up, and no rows."""
    gate = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, -1.5]])
    up = torch.full((6, 2), 3.0)[:, 0].unsqueeze(0)  # column view: stride 2
    out = silu_mul_triton(gate, up)
    assert torch.equal(out, F.silu(gate) * up)
    assert torch.equal(torch.signbit(out), torch.signbit(F.silu(gate) * up))
    empty = torch.zeros(0, 8, dtype=torch.bfloat16)
    assert silu_mul_triton(empty, empty).shape == (0, 8)
    with pytest.raises(ValueError):
        silu_mul_triton(gate, up.double())
