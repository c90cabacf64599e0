"""The grouped FP4 (W4A16) MoE kernel under the interpreter against its torch references, on
fresh random e2m1 codes with power-of-two scales spread over seven binades; FP4Experts against
the dense experts of the dequantized weights; the contract's errors. Bounds in
``fp4_moe_cases.py``."""

from __future__ import annotations

import pytest
import torch

from services.worker.model.fp4_experts import FP4Experts
from services.worker.model.grouped_experts import routed_experts, swiglu
from services.worker.model.v4_moe import clamped_swiglu
from services.worker.ops.fp4_e2m1 import dequantize_fp4
from services.worker.ops.fp4_moe import (
    fp4_moe_gemm,
    fp4_moe_gemm_ref,
    fp4_moe_ref,
    fp4_moe_triton,
)
from services.worker.ops.moe_pairs import plan
from tests.worker.ops.fp4_moe_cases import (
    gemm_bound,
    glu_bound,
    make_fp4_experts,
    moe_bound,
    stacked,
)
from tests.worker.ops.fp8_moe_cases import EPS32, assert_within, make_inputs

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# (E, top_k, tokens, D, I, routing, limit, share held elsewhere): K not a multiple of the K tile
# (D = 96, 160), N not one of the N tile (I = 96), an expert with several blocks of pairs, experts
# without pairs, 0 and 1 tokens, limits that clamp.
CASES = [
    (4, 2, 5, 96, 64, "random", None, 0.0),
    (3, 3, 4, 160, 96, "random", 1.0, 0.0),
    (5, 2, 11, 64, 32, "one_expert", None, 0.0),
    (6, 4, 6, 128, 64, "few_experts", 2.0, 0.0),
    (8, 6, 3, 64, 64, "random", 1.0, 0.3),
    (4, 2, 1, 64, 32, "random", None, 0.5),
    (2, 1, 0, 64, 32, "random", None, 0.0),
]


def _case(seed: int, case, x_dtype=torch.float32):
    e, k, t, d, i, routing, _, elsewhere = case
    layer = FP4Experts.from_checkpoint(*make_fp4_experts(seed, e, d, i))
    x, idx, w = make_inputs(seed + 1, t, k, e, d, routing, x_dtype)
    g = torch.Generator().manual_seed(seed + 2)
    idx = torch.where(torch.rand(idx.shape, generator=g) < elsewhere, e, idx)
    return stacked(layer), x, idx, w


def _rels(d: int, i: int) -> tuple[float, float]:
    return (d + 16) * EPS32, (i + 16) * EPS32


def test_decoding_is_exact_for_every_code_and_scale() -> None:
    """One-hot activation rows read the weight back column by column: the kernel's values equal
    ``dequantize_fp4``'s bit for bit, for all 16 codes and exponents 2..240 (the kernel's)."""
    n, k = 48, 64
    codes = torch.arange(n * k // 2, dtype=torch.int64) % 256
    weight = codes.to(torch.uint8).view(1, n, k // 2)
    exps = torch.linspace(2, 240, n * k // 32).round().to(torch.uint8).view(1, n, k // 32)
    a = torch.eye(k)
    idx = torch.zeros(k, 1, dtype=torch.int64)
    out = fp4_moe_gemm(a, weight, exps, plan(idx, 1), 1)
    expected = dequantize_fp4(weight[0], exps[0].view(torch.float8_e8m0fnu)).T
    assert torch.equal(out, expected)
    assert expected.abs().max() == 6 * 2.0**113 and expected[expected != 0].abs().min() == 2.0**-126


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_gemms_match_reference(x_dtype) -> None:
    """Both GEMMs alone: the SwiGLU-fused gate_up (clamped or not; out in x's dtype) and the
    routing-weighted down projection (fp32 out), on the same activations."""
    for seed, case in enumerate(CASES[:5]):
        if x_dtype == torch.bfloat16 and seed % 2:
            continue
        (gate_up, gus, down, ds), x, idx, w = _case(seed, case, x_dtype)
        k, d, i, limit = idx.shape[1], case[3], case[4], case[6]
        rel1, rel2 = _rels(d, i)
        blocks = plan(idx, gate_up.shape[0])
        act = fp4_moe_gemm(x, gate_up, gus, blocks, k, True, limit=limit)
        act_ref = fp4_moe_gemm_ref(x, gate_up, gus, idx, k, True, limit=limit)
        assert act.dtype == x_dtype and act.shape == (idx.numel(), i)
        held = (idx.reshape(-1) < gate_up.shape[0]).unsqueeze(1)
        bound = glu_bound(x, gate_up, gus, idx, rel1, act_ref, limit)
        assert_within(torch.where(held, act, 0), act_ref, bound)
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(idx.numel(), i, generator=g).to(x_dtype)
        y = fp4_moe_gemm(a, down, ds, blocks, 1, False, w, torch.float32)
        y_ref = fp4_moe_gemm_ref(a, down, ds, idx, 1, False, w, torch.float32)
        assert_within(
            torch.where(held, y, 0), y_ref, gemm_bound(a, down, ds, idx, 1, rel2, w, y_ref)
        )


def test_moe_matches_reference() -> None:
    """The whole routed MoE (align, gate_up + SwiGLU, down + routing weight, combine), fp32 x,
    and bf16 x for two cases; the clamped cases do clamp."""
    for seed, case in enumerate(CASES):
        for x_dtype in (torch.float32, torch.bfloat16) if seed in (0, 1) else (torch.float32,):
            weights, x, idx, w = _case(100 + seed, case, x_dtype)
            limit = case[6]
            y = fp4_moe_triton(x, idx, w, *weights, limit)
            y_ref = fp4_moe_ref(x, idx, w, *weights, limit)
            assert y.dtype == x_dtype and y.shape == x.shape
            if limit is not None and x.shape[0]:
                h = fp4_moe_gemm_ref(x.float(), weights[0], weights[1], idx, idx.shape[1])
                assert (h[:, : case[4]] > limit).any()  # some gate values are clamped
                assert not torch.equal(y_ref, fp4_moe_ref(x, idx, w, *weights))
            bound = moe_bound(x, idx, w, weights, *_rels(case[3], case[4]), y_ref, limit)
            assert_within(y, y_ref, bound)


def test_pairs_of_experts_held_elsewhere_add_nothing() -> None:
    """A pair whose id is E adds nothing: the same as its routing weight zeroed."""
    weights, x, idx, w = _case(7, (4, 3, 9, 64, 32, "random", 1.0, 0.0))
    elsewhere = torch.rand(idx.shape, generator=torch.Generator().manual_seed(3)) < 0.4
    assert elsewhere.any() and not elsewhere.all()
    idx_ep, zeroed = torch.where(elsewhere, 4, idx), torch.where(elsewhere, 0, w)
    y_ref = fp4_moe_ref(x, idx_ep, w, *weights, 1.0)
    torch.testing.assert_close(
        y_ref, fp4_moe_ref(x, idx, zeroed, *weights, 1.0), rtol=1e-5, atol=1e-5
    )
    bound = moe_bound(x, idx, zeroed, weights, *_rels(64, 32), y_ref, 1.0)
    assert_within(fp4_moe_triton(x, idx_ep, w, *weights, 1.0), y_ref, bound)


def test_token_output_does_not_depend_on_the_batch() -> None:
    weights, x1, idx1, w1 = _case(8, (4, 2, 5, 64, 64, "random", 1.0, 0.0))
    x2, idx2, w2 = make_inputs(9, 5, 2, 4, 64, "random", torch.float32)
    x2[0], idx2[0], w2[0] = x1[0], idx1[0], w1[0]
    y1 = fp4_moe_triton(x1, idx1, w1, *weights, 1.0)
    assert torch.equal(y1[0], fp4_moe_triton(x2, idx2, w2, *weights, 1.0)[0])


@pytest.mark.parametrize("limit", [None, 1.0])
def test_fp4_experts_match_dense_experts(limit) -> None:
    """FP4Experts against ``routed_experts`` over the dequantized weights (fp32: reassociation
    only); its CPU forward is fp4_moe_ref itself; ``dequantized`` is ``dequantize_fp4`` of each
    checkpoint pair, whose float32 scales land as the same exponents as e8m0 ones."""
    e, d, i, k, t = 4, 96, 64, 2, 6
    gates, ups, downs = make_fp4_experts(5, e, d, i)
    layer = FP4Experts.from_checkpoint(gates, ups, downs, limit)
    as_float = [[(p, s.float()) for p, s in pairs] for pairs in (gates, ups, downs)]
    assert torch.equal(
        FP4Experts.from_checkpoint(*as_float).gate_up_proj_scale, layer.gate_up_proj_scale
    )
    gate_up, down = layer.dequantized()
    for j in range(e):
        assert torch.equal(gate_up[j, :i], dequantize_fp4(*gates[j]))
        assert torch.equal(gate_up[j, i:], dequantize_fp4(*ups[j]))
        assert torch.equal(down[j], dequantize_fp4(*downs[j]))
    act = swiglu if limit is None else clamped_swiglu(limit)
    for seed, routing in enumerate(("random", "one_expert", "few_experts")):
        x, idx, w = make_inputs(seed, t, k, e, d, routing, torch.float32)
        with torch.no_grad():
            y = layer(x, idx, w)
        assert torch.equal(y, fp4_moe_ref(x, idx, w, *stacked(layer), limit))
        dense = routed_experts(x, idx, w, gate_up, down, act)
        assert_within(y, dense, moe_bound(x, idx, w, stacked(layer), *_rels(d, i), dense, limit))
    assert layer(x[:0], idx[:0], w[:0]).shape == (0, d)
    assert f"limit={limit}" in repr(layer)


def test_contract_errors() -> None:
    (gate_up, gus, down, ds), x, idx, w = _case(0, CASES[0])
    gates, ups, downs = make_fp4_experts(0, 2, 64, 32)
    with pytest.raises(ValueError, match="exponent grid"):
        fp4_moe_triton(x, idx, w, gate_up, gus[:, :, :2], down, ds)
    with pytest.raises(ValueError, match="exponent grid"):
        fp4_moe_ref(x, idx, w, gate_up, gus.float(), down, ds)
    with pytest.raises(ValueError, match="K disagrees"):
        fp4_moe_triton(x[:, :64], idx, w, gate_up, gus, down, ds)
    with pytest.raises(ValueError, match="activations must be"):
        fp4_moe_triton(x.half(), idx, w, gate_up, gus, down, ds)
    with pytest.raises(ValueError, match="uint8"):
        fp4_moe_ref(x, idx, w, gate_up.view(torch.int8), gus, down, ds)
    with pytest.raises(ValueError, match="routing weights"):
        fp4_moe_triton(x, idx, w[:, :1], gate_up, gus, down, ds)
    with pytest.raises(ValueError, match="glu"):
        fp4_moe_gemm_ref(x, gate_up, gus, idx, 2, False, limit=1.0)
    with pytest.raises(ValueError, match="per-32 grid"):
        FP4Experts.from_checkpoint(gates, ups, [(p, s[:1]) for p, s in downs])
    with pytest.raises(ValueError, match="packed int8 or uint8"):
        FP4Experts.from_checkpoint(gates, [(p[:, :16], s) for p, s in ups], downs)
    with pytest.raises(ValueError, match="packed int8 or uint8"):
        FP4Experts.from_checkpoint([(p.float(), s) for p, s in gates], ups, downs)
    with pytest.raises(ValueError, match="gate"):
        FP4Experts.from_checkpoint(gates, ups[:1], downs)
    with pytest.raises(ValueError, match="powers of two"):
        FP4Experts.from_checkpoint([(p, s.float() * 3) for p, s in gates], ups, downs)
    with pytest.raises(ValueError, match="multiples of 32"):
        FP4Experts(2, 80, 64)
    with pytest.raises(ValueError, match="positive"):
        FP4Experts(2, 64, 32, limit=0.0)
