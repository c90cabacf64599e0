"""Bit-level FP8 e4m3 / bf16 / fp32 conversions as Triton device functions, in integer
arithmetic only: the Triton interpreter's own float8 and bf16 casts do not round to nearest even
(subnormals, bf16 ties), so the store and gather kernels build every stored byte themselves and
agree bit for bit with torch on the CPU and on the GPU."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_exp(amax):
    """The k of the smallest 2^k with amax <= 448 * 2^k (448 * 2^k = 1.75 * 2^(k+8)), for a
    finite fp32 amax >= 0 (zero and fp32 subnormals give a very negative k)."""
    u = amax.to(tl.int32, bitcast=True)
    e = ((u >> 23) & 0xFF) - 127
    return e - 8 + ((u & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def pow2(k):
    """2^k as fp32, for -126 <= k <= 127."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(x):
    """fp32 -> e4m3 byte (int32 in [0, 255]): saturated to +-448, round to nearest even,
    subnormals (multiples of 2^-9) included."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 31) & 1
    e = ((u >> 23) & 0xFF) - 127
    m = (u & 0x7FFFFF) | 0x800000  # 24-bit significand, value m * 2^(e-23)
    # keep 3 fraction bits in the normal range (e >= -6), fewer below (quantum 2^-9)
    s = tl.minimum(20 + tl.maximum(-6 - e, 0), 25)
    one = tl.full(s.shape, 1, tl.int32)
    r = m >> s
    rem = m & ((one << s) - 1)
    half = one << (s - 1)
    r += ((rem > half) | ((rem == half) & ((r & 1) == 1))).to(tl.int32)
    # a carry out of the significand (r = 16, or 8 from a subnormal) lands on the next exponent
    return ((tl.maximum(e, -6) + 6) * 8 + r) | (sign << 7)


@triton.jit
def e4m3_value(b):
    """e4m3 byte (int32) -> fp32, exact (0x7f / 0xff, never stored, read as +-480; 0x80 is
    -0.0: the sign is set as a bit, which no compiler folds away for a zero)."""
    e = (b >> 3) & 15
    mant = b & 7
    sig = tl.where(e == 0, mant, mant + 8).to(tl.float32)
    v = sig * pow2(tl.maximum(e, 1) - 10)
    bits = v.to(tl.int32, bitcast=True) | (((b >> 7) & 1) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(v):
    """fp32 ``v`` rounded to the nearest e4m3 value (ties to even, subnormals included,
    saturated to +-448), still fp32 and exact: casting it to float8e4nv is then exact on the
    GPU and under the interpreter alike (the interpreter's own cast of an unrounded value
    rounds half up and drops the carry into the exponent: 31.98 becomes 16)."""
    return e4m3_value(e4m3_bits(v))


@triton.jit
def bf16_bits(x):
    """fp32 -> bf16 bits (int32 in [0, 65535]), round to nearest even (finite x)."""
    u = x.to(tl.uint32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)


@triton.jit
def bf16_value(bits):
    """bf16 bits (int32 in [0, 65535]) -> fp32, exact."""
    return (bits << 16).to(tl.float32, bitcast=True)
