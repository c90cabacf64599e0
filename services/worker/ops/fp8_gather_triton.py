"""FP8 gather-and-dequantize as a Triton kernel: what attention's (or selection's) input gather
does over an fp8 pool. Matches ``fp8_gather_ref`` bit for bit; the kernel itself is
``fp8_gather_kernel.py``; this module checks shapes and picks the grid."""

from __future__ import annotations

import torch
import triton

from dhisparse.family.fp8_kv_format import Fp8RowFormat
from services.worker.ops.fp8_gather_kernel import fp8_gather_kernel
from services.worker.ops.fp8_store_triton import check_pool


def fp8_gather_triton(
    fmt: Fp8RowFormat,
    pool: torch.Tensor,
    src: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``fp8_gather_ref``: pool uint8 [S, row_bytes], src [M] int (``-1``:
    padding) -> [M, width] in ``dtype`` (fp32 or bf16), zeros for padding. ``out``: the
    [M, width] ``dtype`` tensor to write (a fixed workspace's rows), else a new one."""
    check_pool(fmt, pool)
    if src.ndim != 1:
        raise ValueError(f"src must be [M], not {tuple(src.shape)}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be fp32 or bf16, not {dtype}")
    if out is None:
        out = torch.empty(len(src), fmt.width, dtype=dtype, device=pool.device)
    elif out.shape != (len(src), fmt.width) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: want [{len(src)}, {fmt.width}] "
                         f"{dtype} with contiguous rows")  # fmt: skip
    if len(src) == 0:
        return out
    fp8_gather_kernel[(len(src),)](
        pool, pool.stride(0),
        src.contiguous(),
        out, out.stride(0),
        N_VALUES=fmt.n_values, TILE=fmt.tile, N_TAIL=fmt.n_tail,
        TAIL_P=triton.next_power_of_2(max(fmt.n_tail, 1)),
    )  # fmt: skip
    return out
