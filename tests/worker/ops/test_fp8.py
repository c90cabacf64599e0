"""Block-wise FP8 against a plain-torch reference (the scale grid widened to the weight)."""

from __future__ import annotations

import pytest
import torch

from services.worker.ops.fp8_blockwise import (
    FP8_MAX,
    decode_e8m0,
    dequantize_blockwise,
    quantize_blockwise,
    scale_grid,
)
from tests.worker.checkpoint_files import fp8_bound

SHAPES = [(576, 300), (130, 257), (64, 64), (300, 128)]
BLOCKS = [(128, 128), (32, 48)]


def reference_dequantize(w_fp8, scale, block):
    (rows, cols), (bm, bn) = w_fp8.shape, block
    s = scale.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    return w_fp8.float() * s


def test_the_grid_is_ceil_div() -> None:
    assert scale_grid((576, 7168), (128, 128)) == (5, 56)  # kv_a_proj_with_mqa
    assert scale_grid((130, 257), (128, 128)) == (2, 3)
    assert scale_grid((64, 64), (128, 128)) == (1, 1)
    assert scale_grid((256, 256), (128, 128)) == (2, 2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("scale_dtype", ["F32", "F8_E8M0"])
def test_round_trip_is_within_e4m3_rounding(shape, block, scale_dtype) -> None:
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1] + block[1] + len(scale_dtype))
    w = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(3) * 3
    w_fp8, scale = quantize_blockwise(w, block, scale_dtype)
    assert w_fp8.dtype == torch.float8_e4m3fn and tuple(w_fp8.shape) == shape
    assert tuple(scale.shape) == scale_grid(shape, block)
    assert scale.dtype == {"F32": torch.float32, "F8_E8M0": torch.float8_e8m0fnu}[scale_dtype]
    out = dequantize_blockwise(w_fp8, scale, block)
    assert out.dtype == torch.float32
    assert torch.equal(out, reference_dequantize(w_fp8, scale, block))
    assert ((out - w).abs() <= fp8_bound(w, scale, block)).all()
    rel = (out - w).norm() / w.norm()
    assert rel < 2**-4


def test_each_block_uses_e4m3s_range() -> None:
    """F32 scales map each block's amax onto 448; E8M0 scales onto (224, 448]."""
    w = torch.randn(130, 257, generator=torch.Generator().manual_seed(1))
    for scale_dtype, low in (("F32", FP8_MAX), ("F8_E8M0", FP8_MAX / 2)):
        w_fp8, _ = quantize_blockwise(w, scale_dtype=scale_dtype)
        amax = torch.stack(
            [b.float().abs().amax() for row in w_fp8.split(128) for b in row.split(128, 1)]
        )
        assert (amax > low * 0.99).all() and (amax <= FP8_MAX).all(), scale_dtype


def test_an_all_zero_block_has_scale_one() -> None:
    w = torch.zeros(200, 200)
    w[:128, :128] = 1.0
    w_fp8, scale = quantize_blockwise(w)
    assert torch.equal(scale, torch.tensor([[1 / FP8_MAX, 1.0], [1.0, 1.0]]))
    assert torch.equal(dequantize_blockwise(w_fp8, scale, (128, 128)), w)


def test_e8m0_values_are_powers_of_two_and_round_trip() -> None:
    powers = torch.ldexp(torch.ones(255), torch.arange(-127, 128))
    stored = powers.to(torch.float8_e8m0fnu)
    assert torch.equal(stored.view(torch.uint8), torch.arange(255, dtype=torch.uint8))
    assert torch.equal(decode_e8m0(stored.view(torch.uint8)), powers)
    assert decode_e8m0(torch.tensor([255], dtype=torch.uint8)).isnan().all()
    w = torch.randn(300, 300, generator=torch.Generator().manual_seed(2))
    _, scale = quantize_blockwise(w, scale_dtype="F8_E8M0")
    s = decode_e8m0(scale.view(torch.uint8))
    assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5))


def test_values_on_the_e4m3_grid_come_back_exactly() -> None:
    """A block whose values are e4m3 numbers times a power of two, with amax 448 times it,
    quantizes to those e4m3 numbers under either scale encoding."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (200, 140), generator=g, dtype=torch.uint8)
    grid = codes.view(torch.float8_e4m3fn).float().nan_to_num(0.0)
    grid[::128, ::128] = FP8_MAX
    w = grid * 2.0**-7
    for scale_dtype in ("F32", "F8_E8M0"):
        w_fp8, scale = quantize_blockwise(w, scale_dtype=scale_dtype)
        assert torch.equal(dequantize_blockwise(w_fp8, scale, (128, 128)), w), scale_dtype


def test_a_scale_grid_of_the_wrong_shape_is_refused() -> None:
    w_fp8, scale = quantize_blockwise(torch.randn(576, 300))
    with pytest.raises(ValueError, match=r"\(4, 3\).*\(576, 300\)"):
        dequantize_blockwise(w_fp8, scale[:4], (128, 128))
