"""The W8A8 block-scaled matmul through torch's own FP8 GEMM (cuBLAS), where this torch has one
that takes DeepSeek's scales: activations per 1x128 group, weights per 128x128 block.

torch >= 2.10 has ``torch.nn.functional.scaled_mm`` with explicit recipes
(``ScalingType.BlockWise1x128`` for x, ``BlockWise128x128`` for W); torch 2.9 infers the same
recipes from the scale shapes in ``torch._scaled_mm``. Both want x row-major, W^T column-major
(``weight.t()`` of the checkpoint's [N, K]), the x scales outer-dim-major (stride (1, M)) and the
W scales as ``[ceil(K/128), ceil(N/128)]`` with the K-blocks padded to a multiple of 4 in memory.
Measured only on the CPU's torch (2.13) for its signature: whether cuBLAS accepts a given shape
(ragged N such as 576, M = 1) is decided on the GPU, so ``scaled_mm_unsupported`` runs it."""

from __future__ import annotations

import torch

from services.worker.ops.fp8_linear import act_quant_ref


def _scales(x_scale: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_scale [M, nK] outer-dim-major; w_scale [nN, nK] as [nK, nN] column-major, nK padded."""
    m, n_kx = x_scale.shape
    sa = torch.empty_strided((m, n_kx), (1, m), dtype=x_scale.dtype, device=x_scale.device)
    sa.copy_(x_scale)  # strides exactly (1, M), (1, 1) at M = 1 as cuBLAS's check wants
    n_n, n_k = w_scale.shape
    padded = w_scale.new_zeros(n_n, -(-n_k // 4) * 4)
    padded[:, :n_k] = w_scale
    return sa, padded.t()[:n_k]


def scaled_mm_blockwise(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``x_fp8 [M, K]`` e4m3 with ``x_scale [M, ceil(K/128)]`` fp32 (``act_quant_ref``), ``weight
    [N, K]`` e4m3 with ``w_scale [ceil(N/128), ceil(K/128)]`` fp32 -> ``[M, N]`` out_dtype, on
    CUDA. Raises whatever torch raises where it has no such kernel."""
    sa, sb = _scales(x_scale.float(), w_scale.float())
    a, b = x_fp8.contiguous(), weight.t()
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    if fn is not None:
        from torch.nn.functional import ScalingType, SwizzleType

        return fn(
            a, b, sa, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
            swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE,
            output_dtype=out_dtype,
        )  # fmt: skip
    return torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype)  # noqa: SLF001 (torch 2.9)


def scaled_mm_w8a8(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``fp8_linear_ref(x, weight, w_scale, mode="w8a8")``'s contract for 2-D x, through torch:
    x quantized by ``act_quant_ref``, then ``scaled_mm_blockwise``; returns x's dtype."""
    x_fp8, x_scale = act_quant_ref(x)
    return scaled_mm_blockwise(x_fp8, x_scale, weight, w_scale, x.dtype)


def scaled_mm_unsupported(m: int, n: int, k: int) -> str | None:
    """None when this torch runs the block-scaled FP8 GEMM at [M, K] x [N, K]^T on the current
    CUDA device; otherwise why not (the exception, shortened)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not hasattr(torch.nn.functional, "scaled_mm") and not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has neither F.scaled_mm nor torch._scaled_mm"
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(n, k, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.ones(-(-n // 128), -(-k // 128), device="cuda")
    try:
        scaled_mm_w8a8(x, w, s)
        torch.cuda.synchronize()
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return None
