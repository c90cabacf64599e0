"""FP4 e2m1 weights re-held as e4m3 in 128x128 blocks: exact when each block's per-32 scales
span at most 14 binades, within ``2**(s_max - 16)`` beyond, ``inexact`` counting the values
that moved; FP8Experts built from the converted experts hold the FP4 experts' weights."""

from __future__ import annotations

import torch

from services.worker.model.fp4_experts import FP4Experts
from services.worker.model.fp8_experts import FP8Experts
from services.worker.ops.fp4_e2m1 import dequantize_fp4
from services.worker.ops.fp4_to_fp8 import fp4_to_fp8_blocks
from services.worker.ops.fp8_blockwise import FP8_DTYPE, dequantize_blockwise
from tests.worker.ops.fp4_moe_cases import make_fp4_experts


def _fp4(seed: int, rows: int, cols: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes; each 128x128 block's scale exponents in ``[b, b + span]``, ``b`` drawn per
    block over 40 binades (so the blocks' scales differ widely), every block spanning the whole
    range once."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    groups = cols // 32
    base = torch.randint(-20, 20, (-(-rows // 128), -(-groups // 4)), generator=g)
    base = base.repeat_interleave(128, 0)[:rows].repeat_interleave(4, 1)[:, :groups]
    offset = torch.randint(0, span + 1, (rows, groups), generator=g)
    offset[::128, ::4], offset[1::128, ::4] = 0, span  # the span is reached in every block
    exps = (base + offset + 127).to(torch.uint8)
    return packed, exps.view(torch.float8_e8m0fnu)


def test_exact_within_14_binades() -> None:
    for seed, (rows, cols) in enumerate([(256, 512), (200, 320), (64, 96)]):
        packed, scale = _fp4(seed, rows, cols, 14)
        blocks = fp4_to_fp8_blocks(packed, scale)
        assert blocks.weight.dtype == FP8_DTYPE and blocks.weight.shape == (rows, cols)
        assert blocks.scale.shape == (-(-rows // 128), -(-cols // 128))
        assert blocks.inexact == 0
        w = dequantize_fp4(packed, scale)
        assert torch.equal(dequantize_blockwise(blocks.weight, blocks.scale, (128, 128)), w)
        assert blocks.weight.float().abs().max() <= 384
        # the float32 form of the same scales gives the same blocks
        again = fp4_to_fp8_blocks(packed.view(torch.int8), scale.float())
        assert torch.equal(again.weight.view(torch.uint8), blocks.weight.view(torch.uint8))
        assert torch.equal(again.scale, blocks.scale)


def test_bounded_error_beyond_14_binades() -> None:
    for seed, span in enumerate((15, 18, 24)):
        packed, scale = _fp4(10 + seed, 200, 320, span)
        blocks = fp4_to_fp8_blocks(packed, scale)
        w = dequantize_fp4(packed, scale)
        err = (dequantize_blockwise(blocks.weight, blocks.scale, (128, 128)) - w).abs()
        assert blocks.inexact == int((err > 0).sum()) > 0
        # the block scale is 2**(s_max - 6): the error is at most 2**(s_max - 16)
        bound = (blocks.scale * 2.0**-10).repeat_interleave(128, 0)[:200]
        assert (err <= bound.repeat_interleave(128, 1)[:, :320]).all()
        # values whose scale is within 14 binades of their block's largest stay exact
        s_max = torch.log2(blocks.scale) + 6
        near = (
            torch.log2(scale.float())
            >= s_max.repeat_interleave(128, 0)[:200].repeat_interleave(4, 1)[:, :10] - 14
        )
        assert (err[near.repeat_interleave(32, 1)] == 0).all()


def test_fp8_experts_from_converted_fp4_experts_hold_the_same_weights() -> None:
    gates, ups, downs = make_fp4_experts(3, 3, 256, 192)
    fp4 = FP4Experts.from_checkpoint(gates, ups, downs, 10.0)

    def convert(pairs):
        return [fp4_to_fp8_blocks(*p)[:2] for p in pairs]

    fp8 = FP8Experts.from_checkpoint(convert(gates), convert(ups), convert(downs), limit=10.0)
    for a, b in zip(fp4.dequantized(), fp8.dequantized(), strict=True):
        assert torch.equal(a, b)
