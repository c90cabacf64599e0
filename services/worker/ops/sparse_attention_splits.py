"""Flash-decoding row splits of the sparse attention kernels: how many splits a launch takes,
and the splits' partial softmaxes combined in torch (when the kernel does not combine them)."""

from __future__ import annotations

import torch
import triton

from services.worker.ops.launch import TARGET_PROGRAMS

BLOCK_K = 32  # rows gathered per step


def row_splits(
    programs: int, k: int, interpret: bool, want: int | None = None, block_k: int = BLOCK_K
) -> tuple[int, int]:
    """(splits, rows per split, a multiple of block_k) for a launch of ``programs`` (token,
    head block, value block) programs over k selected rows: one split when the launch already
    fills the GPU, and under the interpreter; ``want`` splits when given (no more than
    ``block_k``-row chunks)."""
    chunks = max(1, triton.cdiv(k, block_k))
    if want is None:
        fills = interpret or programs >= TARGET_PROGRAMS
        want = 1 if fills else triton.cdiv(TARGET_PROGRAMS, programs)
    per = triton.cdiv(chunks, min(want, chunks)) * block_k
    return max(1, triton.cdiv(k, per)), per


def combine_splits(
    acc: torch.Tensor, m: torch.Tensor, den: torch.Tensor, out: torch.Tensor
) -> None:
    """The splits' partial softmaxes into ``out`` [N, H, dv]: acc [N, S, H, dv] unnormalised,
    m / den [N, S, H] each split's running max and denominator (-inf / 0 for a split that read
    no row). ``sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) den_s``, M the max over splits."""
    top = m.amax(dim=1, keepdim=True)
    w = torch.exp(m - torch.where(top == float("-inf"), 0.0, top))  # [N, S, H]
    num = (acc * w[..., None]).sum(dim=1)
    den = (den * w).sum(dim=1)
    out.copy_(num / den[..., None])
