"""FP4 e2m1 weights with per-32 UE8M0 scales (``fp4_e2m1.py``) re-held as e4m3 with one fp32
scale per 128x128 block (``fp8_blockwise.py``), so the FP8 kernels can serve DeepSeek-V4's
experts.

A block's scale is ``2**(s_max - 6)``, ``s_max`` the largest scale exponent among the block's
per-32 scales: its largest magnitude ``6 * 2**s_max`` maps to 384 <= 448, e4m3's largest. A
value ``e2m1 * 2**s`` becomes ``e2m1 * 2**(s - s_max + 6)``: e2m1 has one mantissa bit and e4m3
three, so it is exact unless it falls under e4m3's subnormal step ``2**-9``, that is exact for
every value when the block's scales span at most 14 binades (``0.5 * 2**-8 = 2**-9``). Beyond
that span the small values round to the nearest multiple of ``2**-9``: an error of at most
``2**(s_max - 16)``, and ``inexact`` counts them."""

from __future__ import annotations

from typing import NamedTuple

import torch

from services.worker.ops.fp4_e2m1 import FP4_GROUP, dequantize_fp4
from services.worker.ops.fp8_blockwise import FP8_DTYPE, scale_grid, scale_to_float

BLOCK = 128
HEADROOM = 6  # log2 of the block scale's divisor: 6 * 2**6 = 384 <= 448


class FP8Blocks(NamedTuple):
    weight: torch.Tensor  # [R, C] float8_e4m3fn
    scale: torch.Tensor  # [ceil(R / 128), ceil(C / 128)] float32 powers of two
    inexact: int  # values whose e4m3 times its block's scale is not the FP4 value


def fp4_to_fp8_blocks(packed: torch.Tensor, scale: torch.Tensor) -> FP8Blocks:
    """``packed [R, C / 2]`` int8 / uint8 with ``scale [R, C / 32]`` (float8_e8m0fnu, or float32
    / bfloat16 powers of two) -> ``FP8Blocks`` on packed's device (see the module docstring).
    Counting ``inexact`` reads a value back: a load-time conversion."""
    w = dequantize_fp4(packed, scale)  # [R, C] fp32
    rows, cols = w.shape
    _, exps = torch.frexp(scale_to_float(scale).to(w.device))  # scale = 0.5 * 2**exps
    grid_r, grid_c = scale_grid((rows, cols), (BLOCK, BLOCK))
    per_block = BLOCK // FP4_GROUP
    padded = torch.full(
        (grid_r * BLOCK, grid_c * per_block), torch.iinfo(torch.int32).min, device=w.device,
        dtype=torch.int32,
    )  # fmt: skip
    padded[:rows, : cols // FP4_GROUP] = exps - 1
    s_max = padded.view(grid_r, BLOCK, grid_c, per_block).amax(dim=(1, 3))  # [grid_r, grid_c]
    block_scale = torch.ldexp(torch.ones(s_max.shape, device=w.device), s_max - HEADROOM)
    per_value = block_scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    q = (w / per_value).to(FP8_DTYPE)
    inexact = int((q.to(torch.float32) * per_value != w).sum())
    return FP8Blocks(q, block_scale, inexact)
