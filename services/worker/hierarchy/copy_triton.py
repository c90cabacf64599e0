"""The host-read copy kernel: rows at element offsets of the host arena (a registered
/dev/shm mapping, read under UVA on a GPU) into rows of a device pool. The resolver queues its
misses for it; repopulation of optional history restores whole pages with it.

A persistent grid strides over a row count read on the device, so the resolver's launch needs
no host-side count (and no synchronisation)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.hierarchy.host_backup import HostPointer
from services.worker.kv.transfers import to_device


@triton.jit
def _copy_rows_kernel(
    host_ptr,  # flat host arena, KV dtype
    pool_ptr,  # [P, D] device rows
    stride_pool,
    plan_src_ptr,
    plan_dst_ptr,
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


def _copy_grid(device: torch.device, rows_per_program: int, max_rows: int) -> int:
    """Persistent copy programs: enough to keep the PCIe link busy (a handful of programs
    starve it; past one or two per SM the grid barely matters), never more than the work."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(2 * sms, triton.cdiv(max_rows, rows_per_program)))


_COPY_ROWS = 16


def copy_queued(
    pool: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    count: torch.Tensor,
    host: torch.Tensor,
    max_rows: int,
) -> None:
    """The first ``count[0]`` (a device scalar) entries of ``src``/``dst``: host element
    offsets into pool rows; ``max_rows`` bounds it (sizes the grid)."""
    d = pool.shape[1]
    host_arg = HostPointer(host) if pool.is_cuda else host
    _copy_rows_kernel[(_copy_grid(pool.device, _COPY_ROWS, max_rows),)](
        host_arg, pool, pool.stride(0), src, dst, count, d,
        ROWS=_COPY_ROWS, DP=triton.next_power_of_2(d),
    )  # fmt: skip


def copy_rows(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, host: torch.Tensor) -> None:
    """Host rows at element offsets ``src`` into pool rows ``dst`` ([n] int64 each)."""
    n = src.numel()
    if n:
        count = to_device([n], pool.device)
        copy_queued(pool, src, dst, count, host, n)
