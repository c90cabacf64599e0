"""Rounding an fp32 value to a narrower float dtype as a Triton device function, the same bits
on the GPU and under the interpreter: the interpreter's own fp32 -> bf16 cast truncates, so bf16
goes through its bits (``fp8_bits.bf16_bits``, round to nearest even); fp16 and fp32 casts are
already exact there."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.fp8_bits import bf16_bits, bf16_value


@triton.jit
def round_to(v, DTYPE: tl.constexpr):
    """fp32 ``v`` (finite) -> ``DTYPE`` (bf16, fp16 or fp32), round to nearest even, as torch's
    ``.to(dtype)``."""
    if DTYPE == tl.bfloat16:  # noqa: SIM300 (the constexpr on the left compares its value)
        return bf16_value(bf16_bits(v)).to(tl.bfloat16)
    else:
        return v.to(DTYPE)
