"""The host-read copy kernel: rows at element offsets of the host arena (a registered
/dev/shm mapping, read under UVA on a GPU) into rows of a device pool. The resolver queues its
misses for it; repopulation of optional history restores whole pages with it.

A persistent grid strides over a row count read on the device, so the resolver's launch needs
no host-side count (and no synchronisation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from services.worker.hierarchy.copy_kernel import copy_rows_kernel
from services.worker.hierarchy.host_backup import HostPointer
from services.worker.transfers import to_device


@dataclass(frozen=True)
class CopyLaunch:
    """The copy kernel's launch shape: a policy (every shape moves the same bytes).
    ``programs_per_sm`` persistent programs per SM, each moving ``rows`` rows per step with
    ``num_warps`` warps."""

    rows: int = 16
    programs_per_sm: int = 2
    num_warps: int = 4

    def grid(self, device: torch.device, max_rows: int) -> int:
        """Enough programs to keep the PCIe link busy (a handful starve it), never more than
        the work."""
        if device.type != "cuda":
            return 1  # the interpreter runs programs one after another
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(self.programs_per_sm * sms, triton.cdiv(max_rows, self.rows)))


DEFAULT_LAUNCH = CopyLaunch()


def copy_queued(
    pool: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    count: torch.Tensor,
    host: torch.Tensor,
    max_rows: int,
    launch: CopyLaunch = DEFAULT_LAUNCH,
) -> None:
    """The first ``count[0]`` (a device scalar) entries of ``src``/``dst``: host element
    offsets into pool rows; ``max_rows`` bounds it (sizes the grid)."""
    if host.element_size() != pool.element_size() or pool.stride(1) != 1:
        raise ValueError("pool rows must be contiguous, of the arena's element size")
    d = pool.shape[1]
    host_arg = HostPointer(host) if pool.is_cuda else host
    copy_rows_kernel[(launch.grid(pool.device, max_rows),)](
        host_arg, pool, pool.stride(0), src, dst, count, d,
        ROWS=launch.rows, DP=triton.next_power_of_2(d), num_warps=launch.num_warps,
    )  # fmt: skip


def copy_rows(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, host: torch.Tensor) -> None:
    """Host rows at element offsets ``src`` into pool rows ``dst`` ([n] int64 each)."""
    n = src.numel()
    if n:
        count = to_device([n], pool.device)
        copy_queued(pool, src, dst, count, host, n)
