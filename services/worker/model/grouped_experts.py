"""Routed experts as one grouped GEMM over the (token, choice) pairs sorted by expert, shared by
the families' mixtures of experts: static shapes and no host synchronisation whatever the
routing (the per-expert offsets stay on the device), so the pass is capturable."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

# The public op where torch has it (2.10+); older releases expose the same kernel privately.
_GROUPED_MM = getattr(F, "grouped_mm", None) or torch._grouped_mm  # noqa: SLF001

# (gate [M, I], up [M, I]) -> the activation [M, I] the down projection reads
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of x [M, K] times w[e] [K, N] -> [M, N]; offsets:
    [E] int32 cumulative row counts on the device.

    torch's grouped GEMM runs it on the CPU and, on a GPU, in bf16; other GPU dtypes (fp32,
    which the exactness tests use) take a batched matmul of each row with its expert's weight,
    gathered: the same static shapes, M x K x N elements of workspace."""
    if x.is_cuda and x.dtype != torch.bfloat16:
        rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
        expert = torch.searchsorted(offsets, rows, right=True).clamp(max=w.shape[0] - 1)
        return torch.bmm(x.unsqueeze(1), w[expert]).squeeze(1)
    return _GROUPED_MM(x, w, offs=offsets)


def routed_experts(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, act: Activation = swiglu,
) -> torch.Tensor:  # fmt: skip
    """x [N, D], idx / w [N, k] -> sum_j w[:, j] * expert_{idx[:, j]}(x), [N, D], for experts
    held as ``gate_up`` [E, 2I, D] (gate rows first) and ``down`` [E, D, I]. An id of E (one
    past the experts held: another rank's expert) contributes nothing."""
    n, k = idx.shape
    if n == 0:
        return torch.zeros_like(x)
    held_experts = gate_up.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.zeros(held_experts + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync with the host
    offsets = torch.cumsum(counts[:held_experts], 0).to(torch.int32)
    token = order // k
    gate, up = grouped_mm(x[token], gate_up.transpose(1, 2), offsets).chunk(2, -1)
    y = grouped_mm(act(gate, up), down.transpose(1, 2), offsets)
    # rows past the held experts' are not computed (their values are undefined)
    held = (flat[order] < held_experts).unsqueeze(-1)
    y = torch.where(held, y * w.reshape(-1)[order].unsqueeze(-1), 0)
    # back to (token, choice) order, then each token's k expert outputs summed
    unsorted = torch.empty_like(y).index_copy_(0, order, y)
    return unsorted.view(n, k, -1).sum(dim=1).to(x.dtype)
