"""Flash-decoding row splits of the sparse attention kernels: how many splits a launch takes,
and the splits' partial softmaxes combined in torch (when the kernel does not combine them),
with the heads' sinks, if any, in the form the kernels read them (``head_sinks``)."""

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
    acc: torch.Tensor,
    m: torch.Tensor,
    den: torch.Tensor,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """The splits' partial softmaxes into ``out`` [N, H, dv]: acc [N, S, H, dv] unnormalised,
    m / den [N, S, H] each split's running max and denominator (-inf / 0 for a split that read
    no row). ``sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) den_s + e^(sink - M))``, M the max
    over splits and the head's sink (sinks: [H] fp32, the term absent without them)."""
    top = m.amax(dim=1, keepdim=True)
    if sinks is not None:
        top = torch.maximum(top, sinks.view(1, 1, -1))
    top = torch.where(top == float("-inf"), 0.0, top)
    w = torch.exp(m - top)  # [N, S, H]
    num = (acc * w[..., None]).sum(dim=1)
    den = (den * w).sum(dim=1)
    if sinks is not None:
        den = den + torch.exp(sinks.view(1, -1) - top[:, 0])
    out.copy_(num / den[..., None])


def head_sinks(sinks: torch.Tensor | None, h: int) -> torch.Tensor | None:
    """The heads' sink logits as the kernels read them: fp32 [h], contiguous (None: no sink)."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks {tuple(sinks.shape)} are not one per head of {h}")
    return sinks.float().contiguous()
