"""FP8 quantize-and-store as a Triton kernel: what a layer's KV write does in fp8 (MLA rows
and index keys alike, by their ``Fp8RowFormat``). Matches ``fp8_store_ref`` bit for bit; the
kernel itself is ``fp8_store_kernel.py``; this module checks shapes and picks the grid."""

from __future__ import annotations

import torch
import triton

from dhisparse.family.fp8_kv_format import Fp8RowFormat
from services.worker.ops.fp8_store_kernel import fp8_store_kernel


def check_pool(fmt: Fp8RowFormat, pool: torch.Tensor) -> None:
    if pool.dtype != torch.uint8 or pool.ndim != 2 or pool.shape[1] != fmt.row_bytes:
        raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype}: want uint8 "
                         f"[S, {fmt.row_bytes}]")  # fmt: skip
    if pool.stride(1) != 1:
        raise ValueError("pool rows must be contiguous bytes")


def fp8_store_triton(
    fmt: Fp8RowFormat, pool: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor
) -> None:
    """Same contract as ``fp8_store_ref``: rows [N, width] bf16/fp32 are packed into pool
    (uint8 [S, row_bytes]) at rows dst [N] int (``-1``: skipped); destinations are distinct."""
    check_pool(fmt, pool)
    if rows.ndim != 2 or rows.shape[1] != fmt.width or dst.shape != (len(rows),):
        raise ValueError(f"rows {tuple(rows.shape)} / dst {tuple(dst.shape)} do not match "
                         f"width {fmt.width}")  # fmt: skip
    if rows.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"rows must be fp32 or bf16, not {rows.dtype}")
    if len(rows) == 0:
        return
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    fp8_store_kernel[(len(rows),)](
        rows, rows.stride(0),
        dst.contiguous(),
        pool, pool.stride(0),
        N_VALUES=fmt.n_values, TILE=fmt.tile, N_TAIL=fmt.n_tail,
        TAIL_P=triton.next_power_of_2(max(fmt.n_tail, 1)), MIN_EXP=fmt.min_scale_exp,
        SRC_BF16=rows.dtype == torch.bfloat16,
    )  # fmt: skip
