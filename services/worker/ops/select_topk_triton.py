"""The indexer's ordered top-k selection (``select_topk``'s contract) as one kernel per launch
(``select_topk_kernel.py``) for score widths up to ``MAX_WIDTH``, in place of the torch form's
mask, stable sort and padding (several kernels, a radix sort among them). Wider scores keep the
torch form: one program sorts a whole row in registers. Both give the same positions, exactly;
``select_topk_triton`` itself takes rows of up to ``KERNEL_WIDTH``."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.select_topk_kernel import select_topk_kernel

# The widest score row the kernel selects from: one program's bitonic top-k grows as
# S log^2 S and is slower than torch's radix sort beyond about 2K scores (bench: roofline).
MAX_WIDTH = 2048
KERNEL_WIDTH = 16384  # the widest row one program holds


def select_topk_triton(scores: torch.Tensor, num_visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, S] fp32 (S <= KERNEL_WIDTH), num_visible [T] -> positions [T, k] int64: score
    descending, ties by the lower position, -1 past the visible rows."""
    t, s = scores.shape
    if s > KERNEL_WIDTH:
        raise ValueError(f"{s} scores per query; one program selects from at most {KERNEL_WIDTH}")
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores must be fp32 with contiguous rows, not {scores.dtype}")
    out = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    if t == 0 or k == 0:
        return out
    block_k = triton.next_power_of_2(k)
    block_s = max(triton.next_power_of_2(s), block_k)
    select_topk_kernel[(t,)](
        scores, scores.stride(0), num_visible.to(torch.int32).contiguous(),
        out, out.stride(0),
        s, k,
        BLOCK_S=block_s, BLOCK_K=block_k,
        num_warps=16 if block_s >= 4096 else 4,
    )  # fmt: skip
    return out
