"""The grouped FP8 MoE kernel under the interpreter against its torch references, the block
alignment's invariants, and FP8Experts against ``moe.Experts`` on the dequantized weights.

Bounds. One GEMM (``fp8_moe_gemm`` against ``fp8_moe_gemm_ref``): both multiply the same
numbers (for w8a8 the kernel quantizes each activation row bit for bit as ``act_quant_ref``),
so they differ only in the order of the fp32 sums and where the block scales are multiplied
in: ``(K + 16) * 2**-23 * (|a| @ |W|^T)`` as for the dense FP8 linear (``test_fp8_linear.py``),
times |routing weight|, plus one step of the output's dtype. The fused SwiGLU takes the gate
and up bounds through silu (1.1-Lipschitz) and the product, plus silu's own evaluation
(2**-16 relative) and one step of the activation dtype. End to end (``moe_bound``): that
carried through the down projection and summed over the choices; for w8a8 the down
projection's input is quantized on each side from values ``dact`` apart, so the two quantized
values are within ``dact`` plus two half e4m3 steps (2**-4 relative, or 2**-10 of the group
scale): the one bound here that is not near fp32 rounding, since a rounding can flip; the W8A8
GEMM itself is held to the tight bound by the per-GEMM test."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.hf_config import MoESpec
from services.worker.model.fp8_experts import FP8Experts
from services.worker.model.mla_moe import Experts
from services.worker.ops.fp8_blockwise import FP8_DTYPE, quantize_blockwise
from services.worker.ops.fp8_moe import (
    fp8_moe_gemm,
    fp8_moe_gemm_ref,
    fp8_moe_ref,
    fp8_moe_triton,
    plan,
    sum_choices,
)
from services.worker.ops.moe_align import align_blocks, max_blocks
from tests.worker.ops.fp8_moe_cases import (
    EPS32,
    assert_within,
    gemm_bound,
    glu_bound,
    make_experts,
    make_inputs,
    moe_bound,
    stacked,
)

# The kernel's silu is g / (1 + exp(-g)): exp overflows to inf for very negative g, giving
# silu = -0 as it should; numpy (the interpreter) warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

MODES = ("w8a16", "w8a8")
# (E, top_k, tokens, D, I, routing): ragged D and I, I % 128 != 0 (gate and up grids apart),
# 0 and 1 tokens, every pair on one expert (several blocks of it), experts without pairs.
CASES = [
    (4, 2, 5, 200, 192, "random"),
    (8, 4, 9, 128, 64, "random"),
    (3, 3, 1, 300, 128, "random"),
    (1, 1, 0, 128, 128, "random"),
    (5, 2, 11, 136, 72, "one_expert"),
    (6, 3, 7, 256, 200, "few_experts"),
]


def _case(seed: int, case, mode: str, x_dtype=torch.float32):
    e, k, t, d, i, routing = case
    weights = stacked(*make_experts(seed, e, d, i), mode)
    x, idx, w = make_inputs(seed + 1, t, k, e, d, routing, x_dtype)
    return weights, x, idx, w


@pytest.mark.parametrize("routing", ["random", "one_expert", "few_experts"])
def test_align_blocks(routing) -> None:
    """Each expert's pairs fill its blocks in ascending pair order, padding holds n_pairs,
    blocks past the used ones are -1, and the static bound is reached by some routing."""
    for seed, (t, k, e, bm) in enumerate(
        [(9, 3, 5, 16), (40, 4, 6, 16), (1, 2, 8, 4), (0, 2, 3, 16)]
    ):
        _, idx, _ = make_inputs(seed, t, k, e, 8, routing, torch.float32)
        b = align_blocks(idx, e, bm)
        p = t * k
        assert b.n_pairs == p and b.block_m == bm
        assert b.block_expert.shape == (max_blocks(p, e, bm),)
        assert b.sorted_ids.shape == (b.block_expert.numel() * bm,)
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=e)
        used = int(((counts + bm - 1) // bm).sum())
        assert (b.block_expert[used:] == -1).all()
        expected = torch.cat(
            [torch.full(((int(c) + bm - 1) // bm,), j) for j, c in enumerate(counts)]
        )
        assert torch.equal(b.block_expert[:used].long(), expected)
        rows = b.sorted_ids.view(-1, bm)
        for blk in range(used):
            real = rows[blk][rows[blk] < p].long()
            assert (flat[real] == b.block_expert[blk]).all()
        real = b.sorted_ids[b.sorted_ids < p].long()
        assert torch.equal(real, torch.argsort(flat, stable=True))  # every pair once, in order
        assert ((b.sorted_ids == p) | (b.sorted_ids < p)).all()
    # the bound is tight: min(E, P) experts with 1 pair each, then the rest on one expert
    idx = torch.tensor([[0, 1, 2], [3, 3, 3]])
    assert align_blocks(idx, 4, 4).block_expert.tolist() == [0, 1, 2, 3]
    assert max_blocks(6, 4, 4) == 4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_reference(mode, x_dtype) -> None:
    """Both GEMMs alone: the SwiGLU-fused gate_up (out in x's dtype) and the routing-weighted
    down projection (fp32 out) against fp8_moe_gemm_ref, on the same activations; bf16 takes
    half the cases (interpreted programs are slow)."""
    for seed, case in enumerate(CASES):
        if case[2] == 0 or (x_dtype == torch.bfloat16 and seed % 2):
            continue
        (gate_up, gus, down, ds), x, idx, w = _case(seed, case, mode, x_dtype)
        k, i = idx.shape[1], down.shape[2]
        blocks = plan(idx, gate_up.shape[0])
        act = fp8_moe_gemm(x, gate_up, gus, blocks, mode, k, glu=True)
        act_ref = fp8_moe_gemm_ref(x, gate_up, gus, idx, mode, k, glu=True)
        assert act.dtype == x_dtype and act.shape == (idx.numel(), i)
        rel1 = (x.shape[1] + 16) * EPS32
        assert_within(act, act_ref, glu_bound(x, gate_up, gus, idx, mode, rel1, act_ref))

        g = torch.Generator().manual_seed(seed)
        a = (torch.randn(idx.numel(), i, generator=g) * torch.rand(idx.numel(), 1, generator=g)).to(
            x_dtype
        )
        y = fp8_moe_gemm(a, down, ds, blocks, mode, 1, False, w, torch.float32)
        y_ref = fp8_moe_gemm_ref(a, down, ds, idx, mode, 1, False, w, torch.float32)
        rel2 = (i + 16) * EPS32
        assert_within(y, y_ref, gemm_bound(a, down, ds, idx, mode, 1, rel2, w, y_ref))


@pytest.mark.parametrize("mode", MODES)
def test_moe_matches_reference(mode) -> None:
    """The whole routed MoE (align, gate_up + SwiGLU, down + routing weight, sum over choices),
    fp32 x, and bf16 x for one case."""
    for seed, case in enumerate(CASES):
        for x_dtype in (torch.float32, torch.bfloat16) if seed == 0 else (torch.float32,):
            weights, x, idx, w = _case(100 + seed, case, mode, x_dtype)
            y = fp8_moe_triton(x, idx, w, *weights, mode)
            y_ref = fp8_moe_ref(x, idx, w, *weights, mode)
            assert y.dtype == x_dtype and y.shape == x.shape
            d, i = x.shape[1], weights[2].shape[2]
            rel1, rel2 = (d + 16) * EPS32, (i + 16) * EPS32
            assert_within(y, y_ref, moe_bound(x, idx, w, weights, mode, rel1, rel2, y_ref))


def test_token_output_does_not_depend_on_the_batch() -> None:
    """Token 0 keeps its routing; the other tokens, their routing and weights change: token 0's
    output is bitwise the same (same shapes, so the same tile)."""
    e, k, t, d, i = 4, 2, 5, 136, 72
    for mode in MODES:
        weights = stacked(*make_experts(7, e, d, i), mode)
        x1, idx1, w1 = make_inputs(8, t, k, e, d, "random", torch.float32)
        x2, idx2, w2 = make_inputs(9, t, k, e, d, "random", torch.float32)
        x2[0], idx2[0], w2[0] = x1[0], idx1[0], w1[0]
        y1 = fp8_moe_triton(x1, idx1, w1, *weights, mode)
        y2 = fp8_moe_triton(x2, idx2, w2, *weights, mode)
        assert torch.equal(y1[0], y2[0])


def _experts(seed: int, e: int, d: int, i: int) -> Experts:
    spec = MoESpec(e, 1, 2, 1, 1, True, 1.0, i)
    layer = Experts(spec.n_routed, d, spec.intermediate)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.gate_up_proj.copy_(torch.randn(e, 2 * i, d, generator=g) * d**-0.5)
        layer.down_proj.copy_(torch.randn(e, d, i, generator=g) * i**-0.5)
    return layer


@pytest.mark.parametrize("scale_dtype", ["F32", "F8_E8M0"])
@pytest.mark.parametrize("i", [128, 192])
def test_fp8_experts_matches_moe_experts(scale_dtype, i) -> None:
    """FP8Experts.from_experts against moe.Experts holding the dequantized weights (fp32 both:
    fp32 reassociation only, so the w8a16 bound); the CPU forward is fp8_moe_ref itself; gate
    and up keep their own grids (I = 192), equal to the stacked weight's grid when I % 128 == 0."""
    e, d, k, t = 4, 200, 2, 6
    src = _experts(3, e, d, i)
    fp8 = FP8Experts.from_experts(src, "w8a16", scale_dtype)
    assert fp8.gate_up_proj.dtype == FP8_DTYPE and fp8.gate_up_proj_scale_inv.dtype == torch.float32
    assert fp8.gate_up_proj_scale_inv.shape == (e, 2 * -(-i // 128), 2)
    assert fp8.down_proj_scale_inv.shape == (e, 2, -(-i // 128))
    if i % 128 == 0:
        w_fp8, s = quantize_blockwise(src.gate_up_proj.detach()[1], (128, 128), scale_dtype)
        assert torch.equal(fp8.gate_up_proj[1].view(torch.uint8), w_fp8.view(torch.uint8))
        assert torch.equal(fp8.gate_up_proj_scale_inv[1], s.float())
    deq = _experts(0, e, d, i)
    with torch.no_grad():
        gate_up, down = fp8.dequantized()
        deq.gate_up_proj.copy_(gate_up)
        deq.down_proj.copy_(down)
    weights = (fp8.gate_up_proj, fp8.gate_up_proj_scale_inv, fp8.down_proj, fp8.down_proj_scale_inv)
    for seed, routing in enumerate(("random", "one_expert", "few_experts")):
        x, idx, w = make_inputs(seed, t, k, e, d, routing, torch.float32)
        with torch.no_grad():
            y, y_moe = fp8(x, idx, w), deq(x, idx, w)
            assert torch.equal(y, fp8_moe_ref(x, idx, w, *weights, "w8a16"))
            rel1, rel2 = (d + 16) * EPS32, (i + 16) * EPS32
            assert_within(y, y_moe, moe_bound(x, idx, w, weights, "w8a16", rel1, rel2, y_moe))
            fp8.mode = "w8a8"
            assert torch.equal(fp8(x, idx, w), fp8_moe_ref(x, idx, w, *weights, "w8a8"))
            fp8.mode = "w8a16"
    assert fp8(x[:0], idx[:0], w[:0]).shape == (0, d)


def test_from_checkpoint_pairs() -> None:
    """Per-expert checkpoint pairs (e8m0 scales as stored) land in the stacked buffers as fp32;
    ``dequantized`` gives back each pair's dequantized weight."""
    from services.worker.ops.fp8_blockwise import dequantize_blockwise

    gates, ups, downs = make_experts(4, 3, 200, 192, "F8_E8M0")
    layer = FP8Experts.from_checkpoint(gates, ups, downs, "w8a8")
    assert layer.mode == "w8a8" and layer.down_proj_scale_inv.dtype == torch.float32
    gate_up, down = layer.dequantized()
    for e in range(3):
        torch.testing.assert_close(
            gate_up[e, :192], dequantize_blockwise(*gates[e], (128, 128)), rtol=0, atol=0
        )
        torch.testing.assert_close(
            gate_up[e, 192:], dequantize_blockwise(*ups[e], (128, 128)), rtol=0, atol=0
        )
        torch.testing.assert_close(
            down[e], dequantize_blockwise(*downs[e], (128, 128)), rtol=0, atol=0
        )


def test_sum_choices_is_pairwise() -> None:
    y = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(0))
    s = sum_choices(y)
    expected = ((y[:, 0] + y[:, 3]) + (y[:, 2] + y[:, 5])) + ((y[:, 1] + y[:, 4]) + y[:, 6])
    assert torch.equal(s, expected)
    assert torch.equal(sum_choices(y[:, :1]), y[:, 0])


def test_contract_errors() -> None:
    (gate_up, gus, down, ds), x, idx, w = _case(0, CASES[0], "w8a16")
    with pytest.raises(ValueError, match="mode"):
        fp8_moe_ref(x, idx, w, gate_up, gus, down, ds, "w4a16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grids"):
        fp8_moe_triton(x, idx, w, gate_up, gus[:, :2], down, ds)
    with pytest.raises(ValueError, match="K disagrees"):
        fp8_moe_triton(x[:, :199], idx, w, gate_up, gus, down, ds)
    with pytest.raises(ValueError, match="routing weights"):
        fp8_moe_triton(x, idx, w[:, :1], gate_up, gus, down, ds)
    with pytest.raises(ValueError, match="weight must be"):
        fp8_moe_ref(x, idx, w, gate_up.float(), gus, down, ds)
    gates, ups, downs = make_experts(0, 2, 200, 192)
    with pytest.raises(ValueError, match="grid"):
        FP8Experts.from_checkpoint(gates, ups, [(d, s[:1]) for d, s in downs])
    with pytest.raises(ValueError, match="gate"):
        FP8Experts.from_checkpoint(gates, ups[:1], downs)


@pytest.mark.parametrize("mode", MODES)
def test_pairs_of_experts_held_elsewhere_add_nothing(mode) -> None:
    """Expert parallel: a pair whose id is E (one past this rank's experts) is in no block of
    the alignment and adds nothing: the kernel and the reference give the output of the
    remaining pairs alone, which equals zeroing those pairs' routing weights."""
    weights, x, idx, w = _case(7, (4, 3, 9, 200, 192, "random"), mode)
    elsewhere = torch.rand(idx.shape, generator=torch.Generator().manual_seed(3)) < 0.4
    idx_ep = torch.where(elsewhere, 4, idx)
    blocks = plan(idx_ep, 4)
    used = blocks.sorted_ids[blocks.sorted_ids < idx.numel()]
    assert sorted(used.tolist()) == (~elsewhere).reshape(-1).nonzero().squeeze(1).tolist()
    zeroed = torch.where(elsewhere, 0, w)
    y = fp8_moe_triton(x, idx_ep, w, *weights, mode)
    y_ref = fp8_moe_ref(x, idx_ep, w, *weights, mode)
    # equal up to the fp32 matmuls' blocking over different row sets
    torch.testing.assert_close(
        y_ref, fp8_moe_ref(x, idx, zeroed, *weights, mode), rtol=1e-4, atol=1e-4
    )
    d, i = x.shape[1], weights[2].shape[2]
    rel1, rel2 = (d + 16) * EPS32, (i + 16) * EPS32
    assert_within(y, y_ref, moe_bound(x, idx, zeroed, weights, mode, rel1, rel2, y_ref))
    bf16 = Experts(4, x.shape[1], i)
    with torch.no_grad():
        bf16.gate_up_proj.copy_(torch.randn(bf16.gate_up_proj.shape) / 15)
        bf16.down_proj.copy_(torch.randn(bf16.down_proj.shape) / 15)
    torch.testing.assert_close(bf16(x, idx_ep, w), bf16(x, idx, zeroed), rtol=1e-4, atol=1e-4)
