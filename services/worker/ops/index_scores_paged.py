"""A decode pass's index scores over each request's visible keys, read from the paged key
storage by one kernel (``index_scores_kernel.py``) instead of gathering the keys, widening them
and scoring them in torch (``index_scores_ref``, the torch form).

The kernel gives ``index_scores(q, w, keys)`` of the key rows ``0 .. visible[r] - 1`` of each
request's slot, and 0 for the rows beyond (which ``select_topk`` masks), over ``width`` rows,
as the torch form (``IndexKeys.decode_scores`` unfused) does; the two agree up to the order of
the fp32 sums over d and heads. A request's scores do not depend on the rest of the batch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dhisparse.family.fp8_kv_format import Fp8RowFormat
from services.worker.ops.index_scores_kernel import index_scores_kernel

_DOT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
BLOCK_S = 64  # rows per program


def _check(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, fmt: Fp8RowFormat | None) -> None:
    if q.dim() != 3 or w.shape != q.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)} and w {tuple(w.shape)}: not [R, H, D] and [R, H]")
    if q.dtype not in _DOT or q.stride(2) != 1:
        raise ValueError(f"q must be fp32, bf16 or fp16 with contiguous d, not {q.dtype}")
    if fmt is None:
        if keys.dim() != 2 or keys.shape[1] < q.shape[2] or keys.stride(1) != 1:
            raise ValueError(f"keys {tuple(keys.shape)} do not hold d = {q.shape[2]}")
        return
    if keys.dtype != torch.uint8 or keys.shape[1] < fmt.row_bytes or keys.stride(1) != 1:
        raise ValueError(f"fp8 keys must be uint8 [S, >= {fmt.row_bytes}], not {keys.dtype}")
    if fmt.n_tiles != 1 or fmt.n_tail or fmt.n_values != q.shape[2]:
        raise ValueError(f"the fp8 key format {fmt} is not one scaled tile of d = {q.shape[2]}")
    if keys.stride(0) % 4:
        raise ValueError(f"fp8 key rows of {keys.stride(0)} B do not align their fp32 scale")


def index_scores_paged(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    table: torch.Tensor,
    page: int,
    slots: torch.Tensor,
    visible: torch.Tensor,
    width: int,
    fmt: Fp8RowFormat | None = None,
    split: bool | None = None,
) -> torch.Tensor:
    """q [R, H, D] (one decode token per request), w [R, H] fp32, keys [S, >= D] the key
    storage (uint8 [S, >= row_bytes] in ``fmt``'s FP8 format), table [slots, pages] int64 its
    page table (``page`` rows per page), slots [R], visible [R] -> scores [R, width] fp32,
    0 beyond ``visible``. Static shapes, no host read: capturable in a CUDA graph.

    ``split``: fp32 queries scored as three bf16 parts on tensor cores (the kernel's ``SPLIT``)
    rather than by the IEEE fp32 dot; None: wherever the keys are bf16 or FP8, which bf16
    holds exactly. The two differ only in the order of the fp32 sums."""
    _check(q, w, keys, fmt)
    exact_in_bf16 = fmt is not None or keys.dtype == torch.bfloat16
    if split is None:
        split = q.dtype == torch.float32 and exact_in_bf16
    elif split and not (q.dtype == torch.float32 and exact_in_bf16):
        raise ValueError(f"split scores fp32 queries over bf16 or fp8 keys, not {q.dtype} over "
                         f"{keys.dtype}")  # fmt: skip
    r, h, d = q.shape
    out = torch.empty(r, width, dtype=torch.float32, device=q.device)
    if r == 0 or width == 0:
        return out
    interpret = q.device.type == "cpu"
    grid = (r, triton.cdiv(width, BLOCK_S))
    index_scores_kernel[grid](
        q, q.stride(0), q.stride(1),
        w, w.stride(0),
        keys, keys.stride(0),
        table, table.stride(0),
        slots.contiguous(), visible.to(torch.int32).contiguous(),
        out, out.stride(0),
        h, d, width,
        PAGE=page, BLOCK_H=max(16, triton.next_power_of_2(h)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_S=BLOCK_S,
        FP8=fmt is not None,
        # the interpreter's bf16 dot is wrong: fp32 there, the same exact products
        DOT_DTYPE=tl.float32 if interpret else tl.bfloat16 if split else _DOT[q.dtype],
        SPLIT=split,
    )  # fmt: skip
    return out
