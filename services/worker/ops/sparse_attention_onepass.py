"""Sparse MQA attention over selected rows, one pass over each row (decode and verification):
``sparse_attention_ref``'s contract, as ``sparse_attention_triton`` with ``OnePassTiles``.

Where ``sparse_attention_kernel.py`` loads a row's keys in chunks of 64 columns (with the
query's heads reloaded per chunk) and its values again per block of value columns, the one-pass
kernel (``sparse_attention_onepass_kernel.py``) loads each block of rows once, whole: its first
``d_v`` columns serve as both the keys' first part and the values, so a row leaves memory once
per head block, and a program holds every value column (its fp32 accumulator is heads x d_v,
padded to a power of two). Row splits (flash-decoding) and their combine are the tiled
kernel's (``sparse_attention_splits.py``). A ``PackedRows`` pool is packed FP8 rows
(``fp8_kv_format.py``, values = the first d_v columns, tail = the rest) read and dequantized in
the kernel, in place of ``fp8_gather``'s dequantized copy; the result equals attention over the
``fp8_gather_ref`` rows up to floating-point reassociation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from dhisparse.family.fp8_kv_format import Fp8RowFormat
from services.worker.ops.arrivals import arrival_counters
from services.worker.ops.fusion import fused
from services.worker.ops.sparse_attention_onepass_kernel import sparse_attention_onepass_kernel
from services.worker.ops.sparse_attention_splits import combine_splits, head_sinks, row_splits


@dataclass(frozen=True)
class OnePassTiles:
    """A one-pass program's share of a launch: ``heads`` heads (a power of two, >= 16: tl.dot's
    minimum) of one token with every value column, ``block_k`` rows per step, ``warps`` warps,
    ``stages`` software-pipeline stages; ``cast_fp8``: packed FP8 values decoded by the
    device's fp8 conversion (sm_89 and later) rather than from their bits in integer
    arithmetic (both exact); ``max_splits``: at most this many row splits (0: as many as
    ``row_splits`` chooses; each split writes an fp32 partial of heads x d_v per token, at
    small batches more bytes than the rows it reads)."""

    heads: int = 32
    block_k: int = 32
    warps: int = 8
    stages: int = 2
    cast_fp8: bool = False
    max_splits: int = 0

    def __post_init__(self) -> None:
        for name in ("heads", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} = {v} must be a power of two >= 16")


@dataclass(frozen=True)
class PackedRows:
    """A pool of packed FP8 rows: uint8 [S, fmt.row_bytes]."""

    pool: torch.Tensor
    fmt: Fp8RowFormat


def sparse_attention_onepass(  # noqa: PLR0913 (the reference's eight, then the launch choices by name)
    q: torch.Tensor,
    pool: torch.Tensor | PackedRows,
    locs: torch.Tensor,
    d_v: int,
    scale: float,
    win_pool: torch.Tensor | None = None,
    win_locs: torch.Tensor | None = None,
    *,
    splits: int | None = None,
    combine: bool | None = None,
    tiles: OnePassTiles | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sparse_attention_triton``'s contract (q [N, H, d_kv], locs [N, k], -1 pads, optional
    window, optional sinks [H] -> [N, H, d_v]), the pool [S, d_kv] in q's dtype, or
    ``PackedRows`` whose values are the first d_v columns."""
    n, h, d = q.shape
    if locs.shape[0] != n or not 0 < d_v <= d:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, locs {tuple(locs.shape)}, "
                         f"d_v {d_v}")  # fmt: skip
    fmt = pool.fmt if isinstance(pool, PackedRows) else None
    pool = pool.pool if isinstance(pool, PackedRows) else pool
    if q.stride(2) != 1 or pool.stride(1) != 1:
        raise ValueError("pool rows and query heads must be contiguous")
    t = tiles or OnePassTiles()
    sinks = head_sinks(sinks, h)
    if fmt is None:
        if pool.shape[1] != d or pool.dtype != q.dtype:
            raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype} is not rows of {d} {q.dtype}")
        rows, scales, tail, tail_off, tile = pool, pool, pool, d_v, 1
        stride_rows = stride_scales = stride_tail = pool.stride(0)
    else:
        rows, scales, tail, tail_off = _fp8_views(fmt, pool, d, d_v)
        stride_rows, stride_scales, stride_tail = pool.stride(0), scales.stride(0), tail.stride(0)
        tile = fmt.tile
    locs = locs.contiguous()
    has_win = win_locs is not None
    if has_win:
        assert win_pool is not None
        if win_pool.dtype != q.dtype or win_pool.shape[1] != d:
            raise ValueError(f"window rows {tuple(win_pool.shape)} {win_pool.dtype} are not "
                             f"rows of {d} {q.dtype}")  # fmt: skip
        win_locs = win_locs.contiguous()
    else:
        win_pool, win_locs = q, locs  # unused
    out = torch.empty(n, h, d_v, dtype=q.dtype, device=q.device)
    da = max(16, triton.next_power_of_2(d_v))
    db = max(16, triton.next_power_of_2(max(d - d_v, 1)))
    k = locs.shape[1]
    hblocks = triton.cdiv(h, t.heads)
    splits, per = onepass_splits(t, n * hblocks, k, q.device.type == "cpu", splits)
    if n == 0:
        return out
    split = splits > 1
    part = torch.empty(n, splits, h, da, dtype=torch.float32, device=q.device) if split else out
    ml = torch.empty(2, n, splits, h, dtype=torch.float32, device=q.device) if split else out
    combine = split and (fused(q, "attention_combine") if combine is None else combine)
    counts = arrival_counters(q.device, n * hblocks) if combine else ml
    sparse_attention_onepass_kernel[(n, hblocks, splits)](
        q, q.stride(0), q.stride(1),
        rows, stride_rows, scales, stride_scales, tail, stride_tail, tail_off,
        locs, locs.stride(0), k,
        win_pool, win_pool.stride(0),
        win_locs, win_locs.stride(0), win_locs.shape[1] if has_win else 0,
        out, out.stride(0), out.stride(1),
        part, part.stride(0), part.stride(1) if split else 0, part.stride(-2), ml, counts,
        q if sinks is None else sinks,  # q: unused without sinks
        h, d_v, d - d_v, scale, per,
        HB=t.heads, DA=da, DB=db, BLOCK_K=t.block_k, FP8=fmt is not None, TILE=tile,
        CAST=t.cast_fp8, HAS_WIN=has_win,
        # fp32 models get fp32 products (no TF32), so they match the reference closely.
        PREC="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=split, COMBINE=combine,
        HAS_SINK=sinks is not None,
        num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip
    if split and not combine:
        combine_splits(part[..., :d_v], ml[0], ml[1], out, sinks)
    return out


def onepass_splits(
    tiles: OnePassTiles, programs: int, k: int, interpret: bool, want: int | None = None
) -> tuple[int, int]:
    """``row_splits``' (splits, rows per split) for ``tiles``' programs, at most
    ``tiles.max_splits`` splits when it is set."""
    splits, per = row_splits(programs, k, interpret, want, tiles.block_k)
    if tiles.max_splits and splits > tiles.max_splits:
        return row_splits(programs, k, interpret, tiles.max_splits, tiles.block_k)
    return splits, per


def _fp8_views(
    fmt: Fp8RowFormat, pool: torch.Tensor, d: int, d_v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(the values' bytes, the scales as int32 from the row's first scale, the tail as bf16,
    the tail's first bf16 column) of a packed pool."""
    if pool.dtype != torch.uint8 or pool.shape[1] != fmt.row_bytes:
        raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype} is not packed rows of "
                         f"{fmt.row_bytes} bytes")  # fmt: skip
    if fmt.n_values != d_v or fmt.width != d:
        raise ValueError(f"{fmt} does not hold rows of {d} with values of {d_v}")
    if fmt.row_bytes % 4 or pool.stride(0) % 4 or pool.storage_offset() % 4:
        raise ValueError("packed rows must be 4-byte aligned to read their scales")
    scales = pool.view(torch.int32)[:, fmt.scales_offset // 4 :]
    return pool, scales, pool.view(torch.bfloat16), fmt.tail_offset // 2
