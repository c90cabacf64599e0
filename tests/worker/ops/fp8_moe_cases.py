"""Data and error bounds shared by the FP8 MoE tests (CPU and GPU); the bounds are explained in
``test_fp8_moe.py``."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from services.worker.model.fp8_experts import FP8Experts
from services.worker.ops.fp8_blockwise import FP8_DTYPE, dequantize_blockwise, quantize_blockwise
from services.worker.ops.fp8_linear import act_dequant_ref, act_quant_ref
from services.worker.ops.fp8_moe import dequantize_gate_up, fp8_moe_gemm_ref
from services.worker.ops.moe_pairs import sum_choices

EPS32 = 2.0**-23
# The spacing of the SwiGLU output's dtype relative to a value: two roundings of nearby values
# land at most one such step apart.
ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
SILU_LIP = 1.1  # max |silu'(g)| = 1.0998 (at g = 2.3994)
SILU_REL = 2.0**-16  # silu(g) * u evaluated twice (torch; the kernel's g / (1 + exp(-g)))
ROUTINGS = ("random", "one_expert", "few_experts")


def _block_magnitudes(w: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``w [R, C]`` times one log-normal magnitude per 128x128 block (so block scales matter)."""
    r, c = w.shape
    mag = torch.exp(torch.randn(-(-r // 128), -(-c // 128), generator=g, device=w.device))
    return w * mag.repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c]


def make_experts(seed: int, e: int, d: int, i: int, scale_dtype: str = "F32", device="cpu"):
    """Fresh expert weights quantized as the checkpoint writer does, as the checkpoint holds
    them: per expert ``(gate, up, down)`` pairs of (e4m3 weight, scale grid)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def pair(rows: int, cols: int, std: float):
        w = torch.randn(rows, cols, generator=g, device=device) * std
        return quantize_blockwise(_block_magnitudes(w, g), (128, 128), scale_dtype)

    gates = [pair(i, d, d**-0.5) for _ in range(e)]
    ups = [pair(i, d, d**-0.5) for _ in range(e)]
    downs = [pair(d, i, i**-0.5) for _ in range(e)]
    return gates, ups, downs


def make_inputs(seed: int, t: int, k: int, e: int, d: int, routing: str, x_dtype, device="cpu"):
    """x [T, D] with rows of very different magnitudes and a few outliers; idx [T, k] (distinct
    experts per token for "random"; every pair on one expert for "one_expert"; choices among two
    experts, the rest empty, for "few_experts"); positive routing weights w [T, k]."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, d, generator=g, device=device)
    x = x * torch.exp(torch.randn(t, 1, generator=g, device=device))
    x[torch.rand(t, d, generator=g, device=device) < 0.01] *= 20.0
    if routing == "random":
        scores = torch.rand(t, e, generator=g, device=device)
        idx = scores.topk(k, dim=1).indices
    elif routing == "one_expert":
        idx = torch.full((t, k), e - 1, dtype=torch.int64, device=device)
    else:
        idx = torch.randint(0, min(2, e), (t, k), generator=g, device=device) * (e // 2)
    w = 0.1 + torch.rand(t, k, generator=g, device=device)
    return x.to(x_dtype), idx, w


def stacked(gates, ups, downs, mode: str = "w8a16"):
    """The pairs as ``FP8Experts`` stacks them: (gate_up, its scale, down, its scale)."""
    layer = FP8Experts.from_checkpoint(gates, ups, downs, mode)
    return (
        layer.gate_up_proj, layer.gate_up_proj_scale_inv,
        layer.down_proj, layer.down_proj_scale_inv,
    )  # fmt: skip


def abs_fp8(w: torch.Tensor) -> torch.Tensor:
    """|w| of an e4m3 tensor, exactly (the sign bit cleared)."""
    return (w.view(torch.uint8) & 0x7F).view(FP8_DTYPE)


def _rows(a: torch.Tensor, idx: torch.Tensor, mode: str, pairs_per_row: int) -> torch.Tensor:
    """The fp32 activation row of each pair, as the GEMM multiplies it (quantized for w8a8)."""
    rows = a[torch.arange(idx.numel(), device=a.device) // pairs_per_row]
    return act_dequant_ref(*act_quant_ref(rows)) if mode == "w8a8" else rows.float()


def pair_matmul(af, weight, scale, idx, gate_up: bool) -> torch.Tensor:
    """``af [P, K]`` fp32 times each pair's dequantized expert weight: ``[P, N]`` fp32."""
    flat = idx.reshape(-1)
    out = torch.zeros(af.shape[0], weight.shape[1], device=af.device)
    for e in flat.unique().tolist():
        sel = (flat == e).nonzero().squeeze(1)
        if gate_up:
            we = dequantize_gate_up(weight[e], scale[e])
        else:
            we = dequantize_blockwise(weight[e], scale[e], (128, 128))
        out[sel] = af[sel] @ we.T
    return out


def gemm_bound(a, weight, scale, idx, mode, pairs_per_row, rel, pair_weight=None, y_ref=None):
    """The plain GEMM's bound ``rel * (|a| @ |W|^T) * |w_p|``, plus one output-dtype step."""
    af = _rows(a, idx, mode, pairs_per_row)
    b = rel * pair_matmul(af.abs(), abs_fp8(weight), scale, idx, gate_up=False)
    if pair_weight is not None:
        b = b * pair_weight.reshape(-1, 1).float().abs()
    if y_ref is not None and y_ref.dtype in ULP:
        b = b + ULP[y_ref.dtype] * y_ref.float().abs()
    return b


def swiglu_bound(h, habs, rel, act_ref, limit=None) -> torch.Tensor:
    """The bound on the SwiGLU output [P, I] from the pre-activations ``h [P, 2I]`` (gate, up)
    and ``habs = |x| @ |W|^T``: gate and up are each within ``rel * habs`` (bg, bu), and so are
    their clamps by ``limit`` (1-Lipschitz); silu is 1.1-Lipschitz; then silu's own evaluation
    and the rounding of the product to its dtype (one step)."""
    i = h.shape[1] // 2
    gate, up, bg, bu = h[:, :i], h[:, i:], rel * habs[:, :i], rel * habs[:, i:]
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    sg = F.silu(gate)
    d = SILU_LIP * bg * (up.abs() + bu) + (sg.abs() + SILU_LIP * bg) * bu
    d = d + SILU_REL * (sg * up).abs()
    return d + ULP[act_ref.dtype] * (act_ref.float().abs() + d)


def glu_bound(x, gate_up, scale, idx, mode, rel, act_ref, limit=None) -> torch.Tensor:
    """``swiglu_bound`` of the FP8 gate_up GEMM's pre-activations."""
    k = idx.shape[1]
    af = _rows(x, idx, mode, k)
    h = pair_matmul(af, gate_up, scale, idx, gate_up=True)
    habs = pair_matmul(af.abs(), abs_fp8(gate_up), scale, idx, gate_up=True)
    return swiglu_bound(h, habs, rel, act_ref, limit)


def sum_bound(dy, y_abs, w, y_ref, x_dtype) -> torch.Tensor:
    """The end-to-end bound [T, D] from each pair's down-projection bound ``dy [P, D]`` and
    magnitude ``y_abs [P, D]``: times the routing weights, the k choices summed in the same order
    on both sides (one fp32 rounding per add, each side), then one step of x's dtype."""
    t, k = w.shape
    wp = w.reshape(-1, 1).float().abs()
    dy, y_abs = (dy * wp).view(t, k, -1), (y_abs * wp).view(t, k, -1)
    b = sum_choices(dy) + k * EPS32 * sum_choices(y_abs + dy)
    return b + ULP[x_dtype] * (y_ref.float().abs() + b)


def moe_bound(x, idx, w, weights, mode, rel1, rel2, y_ref, limit=None) -> torch.Tensor:
    """The end-to-end bound [T, D]: the SwiGLU output's bound ``dact`` (``glu_bound``) and,
    for w8a8, its quantization (each side within half an e4m3 step of what it quantizes, as
    ``act_quant_ref``'s test states, so the two within ``dact`` plus two half steps), carried
    through the down projection (``rel2``) and summed over the choices (``sum_bound``)."""
    gate_up, gu_scale, down, d_scale = weights
    t, k = idx.shape
    if t == 0:
        return torch.zeros_like(y_ref, dtype=torch.float32)
    act = fp8_moe_gemm_ref(x, gate_up, gu_scale, idx, mode, k, True, limit=limit)  # [P, I]
    dact = glu_bound(x, gate_up, gu_scale, idx, mode, rel1, act, limit)
    a = act.float()
    if mode == "w8a8":
        q, s = act_quant_ref(a)
        q = act_dequant_ref(q, s)
        _, s_d = act_quant_ref(dact)  # >= the group max of dact / 448
        per_col = (s + s_d).repeat_interleave(128, 1)[
            :, : a.shape[1]
        ]  # the kernel's scale, at most
        half = torch.maximum(2.0**-4 * (a.abs() + dact), 2.0**-10 * per_col) * (1 + 1e-6)
        dq = dact + 2 * half
    else:
        q, dq = a, dact
    wabs = abs_fp8(down)
    dy = pair_matmul(rel2 * (q.abs() + dq) + dq, wabs, d_scale, idx, gate_up=False)
    y_abs = pair_matmul(q.abs(), wabs, d_scale, idx, gate_up=False)
    return sum_bound(dy, y_abs, w, y_ref, x.dtype)


def assert_within(y, y_ref, tol) -> None:
    err = (y.float() - y_ref.float()).abs()
    if err.numel() == 0:
        return
    worst = (err - tol).argmax()
    assert (err <= tol).all(), (
        f"error {err.flatten()[worst]:.3e} > bound {tol.flatten()[worst]:.3e} "
        f"(max error {err.max():.3e}, |y| max {y_ref.float().abs().max():.3e})"
    )
