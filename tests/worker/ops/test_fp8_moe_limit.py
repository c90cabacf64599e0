"""The FP8 MoE with DeepSeek-V4's clamped SwiGLU (``limit``): the reference equals the
dequantized weights put through ``v4_moe.clamped_swiglu``; the kernel under the interpreter
matches the reference where clamps happen (bounds of ``test_fp8_moe.py``, clamping being
1-Lipschitz); a limit that clamps nothing gives the unclamped kernel's bits; FP8Experts passes
its limit on."""

from __future__ import annotations

import pytest
import torch

from services.worker.model.fp8_experts import FP8Experts
from services.worker.model.mla_moe import Experts
from services.worker.model.v4_moe import clamped_swiglu
from services.worker.ops.fp8_blockwise import dequantize_blockwise
from services.worker.ops.fp8_moe import (
    dequantize_gate_up,
    fp8_moe_gemm,
    fp8_moe_gemm_ref,
    fp8_moe_ref,
    fp8_moe_triton,
)
from services.worker.ops.moe_pairs import plan
from tests.worker.ops.fp8_moe_cases import (
    EPS32,
    assert_within,
    glu_bound,
    make_experts,
    make_inputs,
    moe_bound,
    pair_matmul,
    stacked,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

LIMIT = 0.5  # below many of the test inputs' gate and up values: clamps happen


def _case(seed: int, e: int, k: int, t: int, d: int, i: int, mode: str, x_dtype=torch.float32):
    weights = stacked(*make_experts(seed, e, d, i), mode)
    x, idx, w = make_inputs(seed + 1, t, k, e, d, "random", x_dtype)
    return weights, x, idx, w


def _assert_clamps_happen(x, idx, gate_up, scale) -> None:
    """Some gate values exceed the limit and some do not; some up values leave [-limit, limit]."""
    rows = x[torch.arange(idx.numel()) // idx.shape[1]].float()
    h = pair_matmul(rows, gate_up, scale, idx, gate_up=True)
    i = h.shape[1] // 2
    gate, up = h[:, :i], h[:, i:]
    assert (gate > LIMIT).any() and (gate < LIMIT).any()
    assert (up.abs() > LIMIT).any() and (up.abs() < LIMIT).any()


def test_reference_is_the_clamped_swiglu_of_the_dequantized_weights() -> None:
    """Token by token: ``sum_j w * down_j(clamped_swiglu(gate_j x, up_j x))`` in fp32 on the
    dequantized weights, the activation rounded to x's dtype as the reference does."""
    (gate_up, gus, down, ds), x, idx, w = _case(0, 4, 2, 5, 200, 192, "w8a16", torch.bfloat16)
    _assert_clamps_happen(x, idx, gate_up, gus)
    y = fp8_moe_ref(x, idx, w, gate_up, gus, down, ds, "w8a16", LIMIT)
    act_fn, i = clamped_swiglu(LIMIT), down.shape[2]
    expected = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = x[t].float() @ dequantize_gate_up(gate_up[e], gus[e]).T
            act = act_fn(h[:i], h[i:]).to(x.dtype).float()
            expected[t] += w[t, j] * (act @ dequantize_blockwise(down[e], ds[e], (128, 128)).T)
    torch.testing.assert_close(y.float(), expected.to(x.dtype).float(), rtol=2**-7, atol=1e-5)
    assert not torch.equal(y, fp8_moe_ref(x, idx, w, gate_up, gus, down, ds, "w8a16"))


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_kernel_matches_reference_with_clamps(mode) -> None:
    """The gate_up GEMM alone and the whole MoE, fp32 and bf16 activations."""
    for seed, (e, k, t, d, i, x_dtype) in enumerate(
        [(4, 2, 5, 200, 192, torch.float32), (6, 3, 7, 136, 72, torch.bfloat16)]
    ):
        weights, x, idx, w = _case(10 + seed, e, k, t, d, i, mode, x_dtype)
        gate_up, gus = weights[0], weights[1]
        _assert_clamps_happen(x, idx, gate_up, gus)
        rel1, rel2 = (d + 16) * EPS32, (i + 16) * EPS32
        act = fp8_moe_gemm(x, gate_up, gus, plan(idx, e), mode, k, True, limit=LIMIT)
        act_ref = fp8_moe_gemm_ref(x, gate_up, gus, idx, mode, k, True, limit=LIMIT)
        assert act_ref.abs().max() <= LIMIT * LIMIT  # silu(g) <= g for g > 0, |up| <= limit
        assert_within(act, act_ref, glu_bound(x, gate_up, gus, idx, mode, rel1, act_ref, LIMIT))
        y = fp8_moe_triton(x, idx, w, *weights, mode, LIMIT)
        y_ref = fp8_moe_ref(x, idx, w, *weights, mode, LIMIT)
        assert_within(y, y_ref, moe_bound(x, idx, w, weights, mode, rel1, rel2, y_ref, LIMIT))


def test_a_limit_that_clamps_nothing_gives_the_unclamped_bits() -> None:
    weights, x, idx, w = _case(20, 4, 2, 5, 200, 192, "w8a16")
    y = fp8_moe_triton(x, idx, w, *weights)
    assert torch.equal(fp8_moe_triton(x, idx, w, *weights, "w8a16", 1e30), y)
    assert torch.equal(
        fp8_moe_ref(x, idx, w, *weights, "w8a16", 1e30), fp8_moe_ref(x, idx, w, *weights)
    )


def test_fp8_experts_pass_their_limit_on() -> None:
    e, d, i, k = 4, 200, 128, 2
    src, g = Experts(e, d, i), torch.Generator().manual_seed(3)
    with torch.no_grad():
        src.gate_up_proj.copy_(torch.randn(e, 2 * i, d, generator=g) * d**-0.5)
        src.down_proj.copy_(torch.randn(e, d, i, generator=g) * i**-0.5)
    layer = FP8Experts.from_experts(src, "w8a16", "F8_E8M0", limit=LIMIT)
    assert layer.limit == LIMIT and "limit=0.5" in repr(layer)
    weights = (
        layer.gate_up_proj, layer.gate_up_proj_scale_inv,
        layer.down_proj, layer.down_proj_scale_inv,
    )  # fmt: skip
    x, idx, w = make_inputs(4, 6, k, e, d, "random", torch.float32)
    with torch.no_grad():
        y = layer(x, idx, w)
    assert torch.equal(y, fp8_moe_ref(x, idx, w, *weights, "w8a16", LIMIT))
    assert FP8Experts.from_checkpoint(*make_experts(0, 2, 128, 64), limit=10.0).limit == 10.0
    assert FP8Experts(2, 128, 64).limit is None


def test_limit_errors() -> None:
    weights, x, idx, w = _case(0, 4, 2, 5, 200, 192, "w8a16")
    with pytest.raises(ValueError, match="glu"):
        fp8_moe_gemm_ref(x, weights[0][:, :192], weights[1][:, :2], idx, "w8a16", 2, limit=1.0)
    with pytest.raises(ValueError, match="positive"):
        fp8_moe_triton(x, idx, w, *weights, "w8a16", 0.0)
    with pytest.raises(ValueError, match="positive"):
        FP8Experts(2, 128, 64, limit=-1.0)
