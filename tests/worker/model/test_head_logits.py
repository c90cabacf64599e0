"""``head_logits``: fp32 logits of a bf16 head without an fp32 copy of it on the GPU, the same
products as widening both operands (bf16 x bf16 is exact in fp32), fp32 accumulation."""

from __future__ import annotations

import pytest
import torch

from services.worker.model.layers import head_logits


def _case(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 3, 256, generator=g).to(device, dtype)
    weight = (torch.randn(1000, 256, generator=g) / 16).to(device, dtype)
    return hidden, weight


def test_on_the_cpu_both_operands_are_widened() -> None:
    hidden, weight = _case("cpu", torch.bfloat16)
    got = head_logits(hidden, weight)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 1000)
    assert torch.equal(got, hidden.float() @ weight.float().t())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_the_gpu_one_gemm_with_fp32_output(dtype: torch.dtype) -> None:
    hidden, weight = _case("cuda", dtype)
    got = head_logits(hidden, weight)
    want = hidden.double() @ weight.double().t()
    assert got.dtype == torch.float32 and got.shape == (2, 3, 1000)
    # fp32 accumulation of 256 exact products: far below a bf16 ulp of the logits
    bound = 256 * 2.0**-23 * (hidden.double().abs() @ weight.double().abs().t())
    assert ((got.double() - want).abs() <= bound).all()
