"""The host-read copy kernel (launched by ``copy_triton.copy_queued``): a persistent grid
strides over the first ``count[0]`` queued copies, ``ROWS`` rows a step, each row ``D``
elements from host element offset ``plan_src[i]`` to pool row ``plan_dst[i]``.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_rows_kernel(
    host_ptr,  # flat host arena, KV dtype
    pool_ptr,  # [P, D] device rows
    stride_pool,
    plan_src_ptr,  # host element offsets
    plan_dst_ptr,  # pool rows
    count_ptr,
    D,
    ROWS: tl.constexpr,
    DP: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    count = tl.load(count_ptr)
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    for start in range(pid * ROWS, count, nprog * ROWS):
        idx = start + offs_r
        m = idx < count
        src = tl.load(plan_src_ptr + idx, mask=m, other=0)
        dst = tl.load(plan_dst_ptr + idx, mask=m, other=0)
        mm = m[:, None] & dmask[None, :]
        vals = tl.load(host_ptr + src[:, None] + offs_d[None, :], mask=mm)
        tl.store(pool_ptr + dst[:, None] * stride_pool + offs_d[None, :], vals, mask=mm)
