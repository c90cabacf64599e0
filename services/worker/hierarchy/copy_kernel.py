"""The host-read copy kernel (launched by ``copy_triton.copy_queued``): a persistent grid
strides over the first ``count[0]`` queued copies, ``ROWS`` rows a step, each row ``W`` words
from host element offset ``plan_src[i]`` to pool row ``plan_dst[i]``. Words are ``WBYTES``
wide; every row starts at a multiple of ``VEC`` words on both sides, which lets each lane move
``VEC`` words in one access.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_rows_kernel(
    host_ptr,  # flat host arena, in words
    pool_ptr,  # [P, STRIDE] device rows, in words
    plan_src_ptr,  # host element offsets
    plan_dst_ptr,  # pool rows
    count_ptr,
    W: tl.constexpr,  # words of a row
    STRIDE: tl.constexpr,  # words between pool rows
    ESIZE: tl.constexpr,  # bytes of a KV element (plan_src's unit)
    WBYTES: tl.constexpr,  # bytes of a word
    VEC: tl.constexpr,  # every row starts at a multiple of VEC words, in the arena and the pool
    ROWS: tl.constexpr,
    WP: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    count = tl.load(count_ptr)
    offs_r = tl.arange(0, ROWS)
    offs_w = tl.arange(0, WP)
    wmask = offs_w < W
    for start in range(pid * ROWS, count, nprog * ROWS):
        idx = start + offs_r
        m = idx < count
        src = tl.load(plan_src_ptr + idx, mask=m, other=0) * ESIZE // WBYTES
        src = tl.multiple_of(src, VEC)
        dst = tl.load(plan_dst_ptr + idx, mask=m, other=0) * STRIDE
        mm = m[:, None] & wmask[None, :]
        vals = tl.load(host_ptr + src[:, None] + offs_w[None, :], mask=mm)
        tl.store(pool_ptr + dst[:, None] + offs_w[None, :], vals, mask=mm)
