"""What every grouped MoE over (token, choice) pairs shares, whatever format holds its experts'
weights (``fp8_moe.py``: FP8 blocks; ``fp4_moe.py``: FP4 e2m1): the routing's contract, the
rows of a tile by the batch's shape and the block plan they give, the torch form of one GEMM
over the pairs (the SwiGLU, clamped or not, and the routing weight), and the sum over each
token's choices.

Pair ``p`` is ``token * top_k + choice``; ``idx.reshape(-1)[p]`` is its expert, ``n_experts``
(one past the last) for an expert held elsewhere, which adds nothing."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from services.worker.ops.fusion import fused
from services.worker.ops.moe_align import MoEBlocks
from services.worker.ops.moe_align_triton import align
from services.worker.ops.moe_combine_triton import combine_triton, fits


def check_routing(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
    """Raises ValueError unless ``x [T, D]``, ``idx [T, k]`` and ``w [T, k]``."""
    if x.dim() != 2 or idx.dim() != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and idx {tuple(idx.shape)}: not [T, D] and [T, k]")
    if tuple(w.shape) != tuple(idx.shape):
        raise ValueError(f"routing weights {tuple(w.shape)} do not match idx {tuple(idx.shape)}")


def check_limit(limit: float | None, glu: bool) -> None:
    """Raises ValueError for a clamp limit that is not positive or not on a SwiGLU GEMM."""
    if limit is None:
        return
    if not glu:
        raise ValueError("a limit clamps the SwiGLU: it applies to the gate_up GEMM (glu) only")
    if not limit > 0:
        raise ValueError(f"the SwiGLU limit must be positive, got {limit}")


def block_rows(n_pairs: int, n_experts: int, interpret: bool) -> int:
    """The rows of a grouped kernel's tile (``block_m``) for a batch shape, from the average pairs
    per expert (a shape, not the routing). Decode leaves most experts 0-2 pairs: the GEMM is
    bound by weight bytes, so the fewest padded rows (16, tl.dot's minimum); larger batches take
    taller tiles. A fixed table, not autotuned (nothing may tune inside a CUDA graph, and the
    interpreter cannot)."""
    if interpret:
        return 16
    per_expert = n_pairs / n_experts
    if per_expert <= 16:
        return 16
    if per_expert <= 48:
        return 32
    return 64


def plan(idx: torch.Tensor, n_experts: int) -> MoEBlocks:
    """The grouped kernels' block alignment of ``idx [T, top_k]`` (static shapes, on idx's
    device): ``align_blocks``' output in blocks of ``block_rows``, by its Triton kernels where
    ``align`` takes them."""
    return align(idx, n_experts, block_rows(idx.numel(), n_experts, idx.device.type == "cpu"))


def gemm_output(
    a: torch.Tensor, blocks: MoEBlocks, n_out: int, out_dtype: torch.dtype | None,
    pair_weight: torch.Tensor | None, block_m: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """A grouped GEMM's output ``[P, n_out]`` (``out_dtype``, a's by default; uninitialised) and
    its pairs' routing weights as the kernels read them (fp32, ``[P]``); ValueError when the
    kernel's tile of ``block_m`` rows is not the one ``blocks`` were aligned to."""
    if block_m != blocks.block_m:
        raise ValueError(f"blocks of {blocks.block_m} rows, the tile has {block_m}: use plan()")
    out = torch.empty(blocks.n_pairs, n_out, dtype=out_dtype or a.dtype, device=a.device)
    if pair_weight is not None:
        pair_weight = pair_weight.reshape(-1).to(torch.float32).contiguous()  # [P]
    return out, pair_weight


def swiglu_ref(h: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``h [P, 2N]`` (gate columns, then up) -> ``silu(gate) * up`` [P, N]; with ``limit``,
    V4's clamped form ``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    n = h.shape[1] // 2
    gate, up = h[:, :n], h[:, n:]
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def pair_gemm_ref(
    rows: torch.Tensor,
    idx: torch.Tensor,
    n_experts: int,
    expert_weight: Callable[[int], torch.Tensor],
    n_out: int,
    glu: bool,
    limit: float | None,
    pair_weight: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``rows [P, K]`` fp32, pair ``p``'s activation row, times its expert's weight
    ``expert_weight(e) [N, K]`` fp32 (``[2 * n_out, K]`` with ``glu``) -> ``[P, n_out]`` in
    ``out_dtype``: ``rows @ W^T`` in fp32, ``swiglu_ref`` of it with ``glu``, times
    ``pair_weight [P]`` when given. Only the experts some pair uses are asked for; pairs of an
    expert held elsewhere stay zero. Not capturable (it reads the routing)."""
    flat = idx.reshape(-1).to(torch.int64)
    out = torch.zeros(rows.shape[0], n_out, dtype=torch.float32, device=rows.device)
    for e in flat.unique().tolist():
        if e >= n_experts:
            continue  # an expert held elsewhere: its pairs stay zero
        sel = (flat == e).nonzero().squeeze(1)
        h = rows[sel] @ expert_weight(e).T
        out[sel] = swiglu_ref(h, limit) if glu else h
    if pair_weight is not None:
        out = out * pair_weight.reshape(-1, 1).to(torch.float32)
    return out.to(out_dtype)


def sum_choices(y: torch.Tensor) -> torch.Tensor:
    """``y [T, k, D]`` -> ``[T, D]``: pairwise halves, the same order for every token and batch
    (elementwise adds only, so no reduction kernel chooses an order by the batch's shape)."""
    while y.shape[1] > 1:
        h = y.shape[1] // 2
        y = torch.cat([y[:, :h] + y[:, h : 2 * h], y[:, 2 * h :]], dim=1)
    return y[:, 0]


def combine(y: torch.Tensor, idx: torch.Tensor, n_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """``y [T * k, D]`` fp32, the weighted down projection of every pair (the rows of pairs held
    elsewhere undefined) -> ``[T, D]`` in ``dtype``: each token's rows summed by
    ``sum_choices``, in one kernel where ``combine_triton`` takes it (bit for bit the torch
    lines)."""
    t, k = idx.shape
    if fused(y, "moe_combine") and fits(k):
        return combine_triton(y, idx, n_experts, dtype)
    # pairs of experts held elsewhere (id E) are computed by no block: their rows are undefined
    y = torch.where((idx.reshape(-1, 1) < n_experts), y, 0)
    return sum_choices(y.view(t, k, -1)).to(dtype)
