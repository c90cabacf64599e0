"""The host-read copy kernel: rows at element offsets of the host arena (a registered
/dev/shm mapping, read under UVA on a GPU) into rows of a device pool. The resolver queues its
misses for it; repopulation of optional history restores whole pages with it.

A persistent grid strides over a row count read on the device, so the resolver's launch needs
no host-side count (and no synchronisation). Rows move as words as wide as their alignment
allows (16-byte vectors for MLA rows of 1,152 B and 656 B in regions the store aligns): a row
read element by element issues a PCIe read per few bytes of FP8 and starves the link."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from services.worker.hierarchy.copy_kernel import copy_rows_kernel
from services.worker.hierarchy.host_backup import HostPointer
from services.worker.kv.transfers import to_device

_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_MAX_VECTOR_BYTES = 16  # one global load per thread, 4 x int32


@dataclass(frozen=True)
class CopyLaunch:
    """The copy kernel's launch shape: a policy (every shape moves the same bytes).
    ``programs_per_sm`` persistent programs per SM, each moving ``rows`` rows per step with
    ``num_warps`` warps; ``wide``: rows as the widest words their alignment allows (else one
    KV element per lane)."""

    rows: int = 16
    programs_per_sm: int = 2
    num_warps: int = 4
    wide: bool = True

    def grid(self, device: torch.device, max_rows: int) -> int:
        """Enough programs to keep the PCIe link busy (a handful starve it), never more than
        the work."""
        if device.type != "cuda":
            return 1  # the interpreter runs programs one after another
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(self.programs_per_sm * sms, triton.cdiv(max_rows, self.rows)))


DEFAULT_LAUNCH = CopyLaunch()


def _vector_bytes(pool: torch.Tensor, host: torch.Tensor, src_align_bytes: int) -> int:
    """The widest power-of-two byte count (<= 16) that every row start divides, in the arena
    (``src_align_bytes``: what every queued offset is a multiple of, in bytes) and the pool."""
    esize = pool.element_size()
    g = math.gcd(
        _MAX_VECTOR_BYTES,
        src_align_bytes,
        pool.shape[1] * esize,
        pool.stride(0) * esize,
        host.data_ptr(),
        pool.data_ptr(),
    )
    return max(esize, g & -g)


def copy_queued(
    pool: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    count: torch.Tensor,
    host: torch.Tensor,
    max_rows: int,
    src_align_bytes: int | None = None,
    launch: CopyLaunch = DEFAULT_LAUNCH,
) -> None:
    """The first ``count[0]`` (a device scalar) entries of ``src``/``dst``: host element
    offsets into pool rows; ``max_rows`` bounds it (sizes the grid). Every offset is a multiple
    of ``src_align_bytes`` bytes (default: one element; the resolver's offsets lie in regions
    aligned to ``host_backup.REGION_ALIGN_BYTES``, at whole rows)."""
    esize = pool.element_size()
    if host.element_size() != esize or pool.stride(1) != 1:
        raise ValueError("pool rows must be contiguous, of the arena's element size")
    d = pool.shape[1]
    vec = _vector_bytes(pool, host, src_align_bytes or esize) if launch.wide else esize
    wbytes = max(esize, min(vec, 4))
    words_pool, words_host = pool, host
    if wbytes != esize:
        per = wbytes // esize
        words_pool = pool.view(_WORD_DTYPES[wbytes])
        words_host = host[: host.numel() - host.numel() % per].view(_WORD_DTYPES[wbytes])
    w = d * esize // wbytes
    host_arg = HostPointer(words_host) if pool.is_cuda else words_host
    copy_rows_kernel[(launch.grid(pool.device, max_rows),)](
        host_arg, words_pool, src, dst, count,
        W=w, STRIDE=pool.stride(0) * esize // wbytes, ESIZE=esize, WBYTES=wbytes,
        VEC=vec // wbytes, ROWS=launch.rows, WP=triton.next_power_of_2(w),
        num_warps=launch.num_warps,
    )  # fmt: skip


def copy_rows(
    pool: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    host: torch.Tensor,
    src_align_bytes: int | None = None,
) -> None:
    """Host rows at element offsets ``src`` into pool rows ``dst`` ([n] int64 each)."""
    n = src.numel()
    if n:
        count = to_device([n], pool.device)
        copy_queued(pool, src, dst, count, host, n, src_align_bytes)
