"""Dense weights into FP4 e2m1 with one power-of-two scale per 32 columns, the form
``fp4_e2m1`` reads (DeepSeek-V4's released routed experts): what a dense checkpoint's experts
or a random preset's become when they are held in FP4 (``--weight-dtype fp4``)."""

from __future__ import annotations

import torch

from services.worker.ops.fp4_e2m1 import FP4_GROUP

E2M1_MAX = 6.0
# midpoints between consecutive e2m1 magnitudes: a magnitude rounds to the nearer one (a tie
# to the smaller)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` (C a multiple of 32) -> ``(packed [R, C / 2] uint8, scale [R, C / 32]
    float8_e8m0fnu)``: each group of 32 columns scaled by the power of two at or above its
    amax / 6 (all-zero groups by 1), each value rounded to the nearest e2m1 magnitude with its
    sign, two codes per byte, the even column in the lower nibble."""
    if w.dim() != 2 or w.shape[1] % FP4_GROUP:
        raise ValueError(f"quantize_fp4 takes [R, C] with C a multiple of {FP4_GROUP}, got "
                         f"{tuple(w.shape)}")  # fmt: skip
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    amax = groups.abs().amax(dim=-1)  # [R, C / 32]
    if not torch.isfinite(amax).all():
        raise ValueError("quantize_fp4: the weight has non-finite values")
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(min=-127, max=127)
    scale = torch.where(amax > 0, torch.exp2(exponent), torch.ones_like(amax))
    q = groups / scale.unsqueeze(-1)
    mids = torch.tensor(_MIDPOINTS, device=w.device)
    magnitude = torch.bucketize(q.abs().clamp(max=E2M1_MAX), mids)  # [R, C/32, 32] in 0..7
    codes = (magnitude + 8 * (q < 0)).to(torch.uint8).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scale.to(torch.float8_e8m0fnu)
