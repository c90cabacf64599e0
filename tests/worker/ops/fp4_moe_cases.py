"""Data and error bounds shared by the FP4 MoE tests (CPU and GPU).

Bounds. The kernel multiplies exactly the weights the reference dequantizes (every e2m1 value
times a UE8M0 scale is exact in bf16 and fp32) by exactly the same activations, so each GEMM
differs from the reference only in the order of its fp32 sums: ``(K + 16) * 2**-23 * (|a| @
|W|^T)``, as W8A16's FP8 GEMM (``test_fp8_moe.py``); the SwiGLU (clamped or not) and the sum over
choices carry it as ``fp8_moe_cases.swiglu_bound`` and ``sum_bound`` state."""

from __future__ import annotations

import torch

from services.worker.model.fp4_experts import FP4Experts
from services.worker.ops.fp4_moe import dequantize_expert, fp4_moe_gemm_ref
from tests.worker.ops.fp8_moe_cases import ULP, sum_bound, swiglu_bound

E2M1_RMS = 2.93  # sqrt(mean(v**2)) over the eight e2m1 magnitudes


def fp4_pair(rows: int, cols: int, std: float, g: torch.Generator, device="cpu", spread=3):
    """A checkpoint pair for ``W [rows, cols]``: random codes packed int8 ``[rows, cols / 2]``
    and float8_e8m0fnu scales ``[rows, cols / 32]``, powers of two spread over ``2 * spread + 1``
    binades around the one that gives the weights about ``std``."""
    codes = torch.randint(0, 256, (rows, cols // 2), generator=g, device=device, dtype=torch.uint8)
    base = round(torch.log2(torch.tensor(std / E2M1_RMS)).item())
    exps = (
        base
        + 127
        + torch.randint(-spread, spread + 1, (rows, cols // 32), generator=g, device=device)
    )
    return codes.view(torch.int8), exps.to(torch.uint8).view(torch.float8_e8m0fnu)


def make_fp4_experts(seed: int, e: int, d: int, i: int, device="cpu", spread=3):
    """Fresh FP4 experts as the checkpoint holds them: per expert (gate, up, down) pairs."""
    g = torch.Generator(device=device).manual_seed(seed)
    gates = [fp4_pair(i, d, d**-0.5, g, device, spread) for _ in range(e)]
    ups = [fp4_pair(i, d, d**-0.5, g, device, spread) for _ in range(e)]
    downs = [fp4_pair(d, i, i**-0.5, g, device, spread) for _ in range(e)]
    return gates, ups, downs


def stacked(layer: FP4Experts):
    """The layer's buffers in the ops' order: (gate_up, its scale, down, its scale)."""
    return layer.gate_up_proj, layer.gate_up_proj_scale, layer.down_proj, layer.down_proj_scale


def pair_matmul(af, weight, scale, idx, absolute: bool = False) -> torch.Tensor:
    """``af [P, K]`` fp32 times each pair's dequantized expert weight (|W| when ``absolute``):
    ``[P, N]`` fp32; pairs of an expert held elsewhere stay zero."""
    flat = idx.reshape(-1)
    out = torch.zeros(af.shape[0], weight.shape[1], device=af.device)
    for e in flat.unique().tolist():
        if e >= weight.shape[0]:
            continue
        sel = (flat == e).nonzero().squeeze(1)
        we = dequantize_expert(weight[e], scale[e])
        out[sel] = af[sel] @ (we.abs() if absolute else we).T
    return out


def gemm_bound(a, weight, scale, idx, pairs_per_row, rel, pair_weight, y_ref) -> torch.Tensor:
    """The plain GEMM's bound ``rel * (|a| @ |W|^T) * |w_p|``, plus one output-dtype step."""
    rows = a[torch.arange(idx.numel(), device=a.device) // pairs_per_row].float()
    b = rel * pair_matmul(rows.abs(), weight, scale, idx, absolute=True)
    b = b * pair_weight.reshape(-1, 1).float().abs()
    return b + ULP[y_ref.dtype] * y_ref.float().abs()


def glu_bound(x, gate_up, scale, idx, rel, act_ref, limit=None) -> torch.Tensor:
    """``swiglu_bound`` of the gate_up GEMM's pre-activations."""
    rows = x[torch.arange(idx.numel(), device=x.device) // idx.shape[1]].float()
    h = pair_matmul(rows, gate_up, scale, idx)
    habs = pair_matmul(rows.abs(), gate_up, scale, idx, absolute=True)
    return swiglu_bound(h, habs, rel, act_ref, limit)


def moe_bound(x, idx, w, weights, rel1, rel2, y_ref, limit=None) -> torch.Tensor:
    """The end-to-end bound [T, D]: the SwiGLU output's bound ``dact`` carried through the down
    projection (``rel2``) and summed over the choices (``sum_bound``)."""
    gate_up, gu_scale, down, d_scale = weights
    if idx.shape[0] == 0:
        return torch.zeros_like(y_ref, dtype=torch.float32)
    act = fp4_moe_gemm_ref(x, gate_up, gu_scale, idx, idx.shape[1], True, limit=limit)
    dact = glu_bound(x, gate_up, gu_scale, idx, rel1, act, limit)
    q = act.float().abs()
    dy = pair_matmul(rel2 * (q + dact) + dact, down, d_scale, idx, absolute=True)
    y_abs = pair_matmul(q, down, d_scale, idx, absolute=True)
    return sum_bound(dy, y_abs, w, y_ref, x.dtype)
