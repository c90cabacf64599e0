"""Sparse MQA attention over selected rows, as a Triton kernel (decode and verification).

One program per (query token, block of heads, split of the selected rows): the query's rows are
gathered from the pool by location, BLOCK_K at a time, and an online softmax accumulates over
them (and, in the first split, over its local-window rows). Decode batches have few tokens, so
the rows are split (flash-decoding) until the launch has ``TARGET_PROGRAMS`` programs, and the
splits' partial softmaxes are combined by the last split to finish (fused; in torch here
otherwise, ``combine_splits``); a launch of many tokens takes one split. A head's sink (optional)
is one more logit of its softmax, joined once: when the splits are combined, or when one split
normalises. The split count is a function of the shapes only, so equal batches compute in the
same order. Scores are accumulated over the row width in chunks of DC so that wide rows
(576 elements in GLM/DeepSeek MLA) stay within registers and shared memory; every head of the
block shares each gathered row (MQA), so a row is read once per head block. Matches
``sparse_attention_ref`` up to floating-point reassociation. The kernel itself is
``sparse_attention_kernel.py``; this module checks shapes and picks the grid."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from services.worker.ops.arrivals import arrival_counters
from services.worker.ops.fusion import fused
from services.worker.ops.sparse_attention_kernel import sparse_attention_kernel
from services.worker.ops.sparse_attention_onepass import (
    OnePassTiles,
    PackedRows,
    sparse_attention_onepass,
)
from services.worker.ops.sparse_attention_splits import (
    BLOCK_K,
    combine_splits,
    head_sinks,
    row_splits,
)


def sparse_attention_triton(  # noqa: PLR0913 (the reference's eight, then the launch choices by name)
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
    tiles: AttentionTiles | OnePassTiles | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``sparse_attention_ref``: q [N, H, d_kv], pool [S, d_kv], locs [N, k]
    int (-1 pads), optional win_pool [W, d_kv] / win_locs [N, w], optional sinks [H] (each
    head's sink logit, on the scores' scale) -> [N, H, d_v]. ``splits``:
    the row splits to aim for (default ``row_splits``'s choice). ``combine``: whether the
    kernel combines its splits itself (default: ``fused(q)``) or ``combine_splits`` does.
    ``tiles``: the programs' shape (default ``attention_tiles``'s); ``OnePassTiles`` runs the
    one-pass kernel (``sparse_attention_onepass``), which alone reads a pool of ``PackedRows``."""
    dvp = triton.next_power_of_2(d_v)
    t = tiles or attention_tiles(q.shape[1], q.shape[0])
    if isinstance(t, OnePassTiles):
        return sparse_attention_onepass(
            q, pool, locs, d_v, scale, win_pool, win_locs, splits=splits, combine=combine,
            tiles=t, sinks=sinks,
        )  # fmt: skip
    if isinstance(pool, PackedRows):
        raise ValueError("packed FP8 rows are read by the one-pass kernel (OnePassTiles)")
    n, h, d = q.shape
    if pool.shape[1] != d or locs.shape[0] != n:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, pool {tuple(pool.shape)}, "
                         f"locs {tuple(locs.shape)}")  # fmt: skip
    if pool.stride(1) != 1 or q.stride(2) != 1:
        raise ValueError("pool rows and query heads must be contiguous")
    sinks = head_sinks(sinks, h)
    locs = locs.contiguous()
    has_win = win_locs is not None
    if has_win:
        assert win_pool is not None
        win_locs = win_locs.contiguous()
    else:
        win_pool, win_locs = pool, locs  # unused
    out = torch.empty(n, h, d_v, dtype=q.dtype, device=q.device)
    hb, vb = t.heads, min(t.values, dvp)
    vblocks = triton.cdiv(d_v, vb)
    k = locs.shape[1]
    programs = n * triton.cdiv(h, hb) * vblocks
    splits, per = row_splits(programs, k, q.device.type == "cpu", splits, t.block_k)
    if n == 0:
        return out
    split = splits > 1
    part = torch.empty(n, splits, h, dvp, dtype=torch.float32, device=q.device) if split else out
    ml = torch.empty(2, n, splits, h, dtype=torch.float32, device=q.device) if split else out
    grid = (n, triton.cdiv(h, hb), splits * vblocks)
    combine = split and (fused(q, "attention_combine") if combine is None else combine)
    counts = arrival_counters(q.device, n * grid[1] * vblocks) if combine else ml
    sparse_attention_kernel[grid](
        q, q.stride(0), q.stride(1),
        pool, pool.stride(0),
        locs, locs.stride(0), k,
        win_pool, win_pool.stride(0),
        win_locs, win_locs.stride(0), win_locs.shape[1] if has_win else 0,
        out, out.stride(0), out.stride(1),
        part, part.stride(0), part.stride(1) if split else 0, part.stride(-2), ml, counts,
        q if sinks is None else sinks,  # q: unused without sinks
        h, d, d_v, scale, per, vblocks,
        HB=hb, DC=64, VB=vb, BLOCK_K=t.block_k, HAS_WIN=has_win,
        # fp32 models get fp32 products (no TF32), so they match the reference closely.
        PREC="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=split, COMBINE=combine,
        HAS_SINK=sinks is not None,
        num_warps=t.warps, num_stages=2,
    )  # fmt: skip
    if split and not combine:
        combine_splits(part[..., :d_v], ml[0], ml[1], out, sinks)
    return out


@dataclass(frozen=True)
class AttentionTiles:
    """A program's share of a launch: ``heads`` heads (a power of two, >= 16: tl.dot's
    minimum) and ``values`` value columns (a power of two) of one token, ``block_k`` rows per
    step, ``warps`` warps. Its fp32 accumulator is heads x values."""

    heads: int
    values: int
    block_k: int = BLOCK_K
    warps: int = 4


def attention_tiles(h: int, tokens: int) -> OnePassTiles:
    """The programs' shape for ``tokens`` query tokens of ``h`` heads: the one-pass kernel,
    which reads each selected row once per head block with every value column (the tiled
    kernel reads it once per block of values too). Up to 4 tokens (a decode step of a few
    streams), 16 heads per program in 4 warps, so the launch has programs enough; more
    tokens, 8 warps over 64 heads per program from 128 heads (32 rows per step), else 32 (64
    rows per step), never more than the heads there are (at least 16: tl.dot's minimum).
    ``python -m bench sparse-attention`` sweeps the shapes at the real models' widths, the
    tiled kernel's (``AttentionTiles``) beside them; ``docs/results`` holds what it measured."""
    if tokens <= 4:
        return OnePassTiles(16, 32, 4)
    heads = max(16, min(64 if h >= 128 else 32, triton.next_power_of_2(h)))
    return OnePassTiles(heads, 32 if heads == 64 else 64, 8)
