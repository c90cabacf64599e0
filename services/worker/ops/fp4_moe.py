"""The routed experts of DeepSeek-V4 over FP4 e2m1 weights with UE8M0 scales per 32 columns, as
its checkpoint holds them (``fp4_e2m1.py``), computed W4A16: per (token, choice) pair ``p`` with
expert ``e``, ``y_p = w_p * down[e](act)``, ``act = silu(min(gate, limit)) * clamp(up, -limit,
limit)`` of ``gate[e] x`` and ``up[e] x`` (the plain SwiGLU without ``limit``), and each token's
``top_k`` outputs summed.

Weights stacked over experts:
- ``gate_up [E, 2I, D / 2]`` uint8, two codes per byte (the lower nibble the even column); gate
  rows ``[0, I)``, up rows ``[I, 2I)``; ``gate_up_scale [E, 2I, D / 32]`` uint8, the UE8M0
  biased exponents (``fp4_e2m1.ue8m0_exponents``): one byte per 32 weights, where fp32 scales
  would add a quarter to the bytes a decode step streams, and the checkpoint's bits as they
  are, which the kernel turns into a power of two with one shift. The kernel is exact for
  exponents 2..240 (``fp4_moe_kernel.py``).
- ``down [E, D, I / 2]`` uint8 with ``down_scale [E, D, I / 32]`` uint8.

Activations are bf16 or fp32: every e2m1 value times a UE8M0 scale is exact in either (fp32's
exponent range), so the kernel multiplies exactly the weights the reference dequantizes (not so
in fp16, which is refused). As in ``fp8_moe.py``: the SwiGLU output is held in x's dtype; the
down projection, the routing weight and the sum over choices (``moe_pairs.sum_choices``) are
fp32; the result has x's dtype.

``fp4_moe_ref`` is the plain-torch reference (``dequantize_fp4`` of each used expert, fp32
matmuls); ``fp4_moe_triton`` aligns the pairs to blocks (``moe_pairs.plan``) and launches the
grouped kernel of ``fp4_moe_kernel.py`` twice, with static shapes and no host synchronisation,
then the combine of ``moe_pairs``. Both agree up to fp32 reassociation in each GEMM, carried
through the SwiGLU and the x-dtype rounding of its output; batch invariance as in ``fp8_moe.py``
(no split-K, no atomics, a fixed order over K and over choices)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.worker.ops.fp4_e2m1 import FP4_GROUP, dequantize_fp4
from services.worker.ops.fp4_moe_kernel import fp4_moe_kernel
from services.worker.ops.moe_align import MoEBlocks
from services.worker.ops.moe_pairs import (
    block_rows,
    check_limit,
    check_routing,
    combine,
    gemm_output,
    pair_gemm_ref,
    plan,
    sum_choices,
)

X_DTYPES = (torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


class FP4Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_kp: int  # packed bytes along K per step: 2 * block_kp columns
    num_warps: int
    num_stages: int


def fp4_tiles(n_pairs: int, n_experts: int, interpret: bool) -> FP4Tiles:
    """The kernel's tile for a batch shape: ``moe_pairs.block_rows`` rows (so ``plan`` serves
    it). Decoding the weights is the kernel's work per byte streamed, so a step's tile is sized
    for what a thread decodes to stay in its registers; decode batches take narrow column tiles,
    which give the few experts used more programs over N. A fixed table, not autotuned;
    ``python -m bench fp4-moe`` measures it."""
    if interpret:
        return FP4Tiles(16, 64, 32, 1, 1)
    block_m = block_rows(n_pairs, n_experts, False)
    if block_m == 16:
        return FP4Tiles(16, 64, 64, 8, 3)
    return FP4Tiles(block_m, 128, 32, 8, 3)


def dequantize_expert(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One expert's ``weight [N, K / 2]`` uint8 with ``scale [N, K / 32]`` uint8 exponents as
    fp32 ``[N, K]``."""
    return dequantize_fp4(weight, scale.view(torch.float8_e8m0fnu))


def _check_gemm(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, glu: bool) -> int:
    """The output width N; raises ValueError on a shape or dtype the kernel does not take."""
    if a.dtype not in X_DTYPES:
        raise ValueError(f"activations must be one of {X_DTYPES}, got {a.dtype}")
    if weight.dtype != torch.uint8 or weight.dim() != 3:
        raise ValueError(f"weight must be 3-D uint8, got {weight.dtype} {tuple(weight.shape)}")
    e, n, k_packed = weight.shape
    if a.dim() != 2 or a.shape[1] != 2 * k_packed or a.shape[1] % FP4_GROUP:
        raise ValueError(
            f"activations {tuple(a.shape)} and packed weight {tuple(weight.shape)}: K disagrees "
            f"(K = 2 * packed columns, a multiple of {FP4_GROUP})"
        )
    if glu and n % 2:
        raise ValueError(f"a gate_up weight has an even number of rows, got {n}")
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (e, n, a.shape[1] // FP4_GROUP):
        raise ValueError(
            f"scale {scale.dtype} {tuple(scale.shape)} is not the uint8 exponent grid "
            f"{(e, n, a.shape[1] // FP4_GROUP)} of {tuple(weight.shape)}"
        )
    return n // 2 if glu else n


def fp4_moe_gemm_ref(
    a: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    idx: torch.Tensor,
    pairs_per_row: int,
    glu: bool = False,
    pair_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    """Pair ``p`` (``idx.reshape(-1)[p]`` its expert) takes row ``p // pairs_per_row`` of
    ``a [R, K]`` -> ``[P, N]`` (``N = 2I / 2`` with ``glu``), in fp32 then ``out_dtype`` (a's by
    default): ``a_row @ W[e]^T`` with W dequantized (``dequantize_expert``); ``glu`` gives the
    SwiGLU, clamped by ``limit`` (``moe_pairs.swiglu_ref``); ``pair_weight [P]`` multiplies each
    row. Only the used experts are dequantized; not capturable (it reads the routing)."""
    n_out = _check_gemm(a, weight, scale, glu)
    check_limit(limit, glu)
    rows = a[torch.arange(idx.numel(), device=a.device) // pairs_per_row].to(torch.float32)
    return pair_gemm_ref(
        rows, idx, weight.shape[0], lambda e: dequantize_expert(weight[e], scale[e]), n_out,
        glu, limit, pair_weight, out_dtype or a.dtype,
    )  # fmt: skip


def fp4_moe_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    blocks: MoEBlocks,
    pairs_per_row: int,
    glu: bool = False,
    pair_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    """Same contract as ``fp4_moe_gemm_ref``, the pairs given by ``blocks`` (``moe_pairs.plan``)
    instead of idx. Allocates only the output; reads nothing back to the host."""
    n_out = _check_gemm(a, weight, scale, glu)
    check_limit(limit, glu)
    e, _, k_packed = weight.shape
    interpret = a.device.type == "cpu"
    t = fp4_tiles(blocks.n_pairs, e, interpret)
    out, pair_weight = gemm_output(a, blocks, n_out, out_dtype, pair_weight, t.block_m)
    n_blocks = blocks.block_expert.numel()
    if n_blocks == 0:
        return out
    grid = (n_blocks, triton.cdiv(n_out, t.block_n))
    fp4_moe_kernel[grid](
        a, a.stride(0), a.stride(1),
        weight, weight.stride(0), weight.stride(1), weight.stride(2),
        scale, scale.stride(0), scale.stride(1), scale.stride(2),
        blocks.sorted_ids, blocks.block_expert,
        pair_weight if pair_weight is not None else out,  # unused without WEIGHTED
        out, out.stride(0), out.stride(1),
        blocks.n_pairs, n_out, k_packed, pairs_per_row, n_out if glu else 0, limit or 0.0,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_KP=t.block_kp,
        EVEN_K=k_packed % t.block_kp == 0,
        GLU=glu, CLAMP=limit is not None, WEIGHTED=pair_weight is not None,
        DOT_DTYPE=tl.float32 if interpret else _TL_DTYPES[a.dtype],
        # fp32 products, never TF32: fp32 activations then match the reference closely.
        PREC="ieee",
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out


def fp4_moe_ref(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """``x [T, D]``, ``idx [T, k]`` experts (E, one past the last, for an expert held by another
    rank: it adds nothing), ``w [T, k]`` routing weights -> ``[T, D]`` in x's dtype:
    ``sum_j w[t, j] * down(act)`` with ``act`` the SwiGLU (clamped by ``limit``) rounded to x's
    dtype; every matmul in fp32 on the dequantized weights (see the module docstring)."""
    check_routing(x, idx, w)
    t, k = idx.shape
    if t == 0:
        return torch.zeros_like(x)
    act = fp4_moe_gemm_ref(x, gate_up, gate_up_scale, idx, k, True, limit=limit)  # [P, I]
    y = fp4_moe_gemm_ref(act, down, down_scale, idx, 1, False, w, torch.float32)  # [P, D]
    return sum_choices(y.view(t, k, -1)).to(x.dtype)


def fp4_moe_triton(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """Same contract as ``fp4_moe_ref``; every shape depends on (T, k, E, D, I) alone and nothing
    is read back to the host, so it can be captured in a CUDA graph."""
    check_routing(x, idx, w)
    t, k = idx.shape
    if t == 0:
        return torch.zeros_like(x)
    blocks = plan(idx, gate_up.shape[0])
    act = fp4_moe_gemm(x, gate_up, gate_up_scale, blocks, k, True, limit=limit)  # [P, I]
    y = fp4_moe_gemm(act, down, down_scale, blocks, 1, False, w.reshape(-1), torch.float32)
    return combine(y, idx, gate_up.shape[0], x.dtype)
