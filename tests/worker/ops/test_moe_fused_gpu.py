"""The MoE layer's fused kernels on the GPU at the released shapes (D = 7168, I = 2048, top-8,
E = 64 and 256; DeepSeek-V3.2's 8 groups, GLM-5's one) against their torch forms, which run
inside ``unfused_kernels()`` (all @gpu): the router (same sets; weights within the bound of
``test_moe_route.py``), the block alignment and the combine (bit for bit, so the routed
experts are bit for bit the unfused ones given the same routing), the whole MoE layer with and
without fusion, and the fused layer captured in a CUDA graph and replayed with new tokens."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn import functional as F

from dhisparse.family.hf_config import MoESpec
from dhisparse.family.scaled import SCALED
from services.worker.model.fp8_experts import FP8Experts
from services.worker.model.mla_moe import MoE, Router
from services.worker.model.weight_format import WeightFormat
from services.worker.ops.fp8_blockwise import FP8_DTYPE
from services.worker.ops.fusion import kernel_fusion, unfused_kernels
from services.worker.ops.moe_align import align_blocks
from services.worker.ops.moe_align_triton import FUSED_MAX_PAIRS, align_blocks_triton
from services.worker.ops.moe_combine_triton import combine_triton
from services.worker.ops.moe_pairs import plan, sum_choices
from services.worker.ops.silu_mul_triton import silu_mul_triton
from services.worker.parallel.shards import Shards
from tests.worker.ops.fp8_moe_cases import make_experts, make_inputs
from tests.worker.ops.test_moe_route import WEIGHT_REL


@pytest.fixture(autouse=True)
def _fused_kernels():
    """Fusion on (the engine's ``--fused-kernels``): each test's unfused side opts out."""
    with kernel_fusion():
        yield


D, INTER, TOP_K = 7168, 2048, 8
GROUPINGS = [(256, 8, 4), (256, 1, 1), (64, 8, 4), (64, 1, 1)]  # (E, n_group, topk_group)

pytestmark = pytest.mark.gpu


def _router(e: int, n_group: int, topk_group: int, dtype: torch.dtype) -> Router:
    router = Router(MoESpec(e, 1, TOP_K, n_group, topk_group, True, 2.5, INTER), D).cuda()
    g = torch.Generator(device="cuda").manual_seed(e + n_group)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, D, generator=g, device="cuda") * D**-0.5)
        router.e_score_correction_bias.copy_(torch.randn(e, generator=g, device="cuda") * 0.1)
    router.weight.data = router.weight.data.to(dtype)
    return router


def _sorted(w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = idx.sort(dim=1)
    return w.gather(1, order), ids


@pytest.mark.parametrize(("e", "n_group", "topk_group"), GROUPINGS)
def test_router_on_gpu(e, n_group, topk_group) -> None:
    """fp32 router: both forms take the same logits, so the sets are equal on every token. bf16
    router: the fused GEMM (fp32 output from bf16) sums in another order than the widened
    F.linear, which may swap two candidates a few ulps apart: at most 1% of the tokens."""
    for dtype in (torch.float32, torch.bfloat16):
        router = _router(e, n_group, topk_group, dtype)
        for n in (1, 64, 4096):
            x = torch.randn(n, D, device="cuda").to(dtype)
            with torch.no_grad():
                w, idx = _sorted(*router(x))
                with unfused_kernels():
                    w_ref, idx_ref = _sorted(*router(x))
            same = (idx == idx_ref).all(dim=1)
            if dtype == torch.float32:
                assert same.all()
                assert ((w - w_ref).abs() <= WEIGHT_REL * w_ref.abs()).all()
            else:
                assert same.float().mean() >= 0.99
            given = idx_ref.flip(1)
            with torch.no_grad():
                w_g, idx_g = router(x, given)
                with unfused_kernels():
                    w_gref, _ = router(x, given)
            assert torch.equal(idx_g, given)
            if dtype == torch.float32:
                assert ((w_g - w_gref).abs() <= WEIGHT_REL * w_gref.abs()).all()


@pytest.mark.parametrize("e", [64, 256])
def test_alignment_on_gpu(e) -> None:
    for seed, t in enumerate((1, 2, 16, 128, 256, FUSED_MAX_PAIRS // TOP_K)):
        for routing in ("random", "one_expert", "few_experts"):
            _, idx, _ = make_inputs(seed, t, TOP_K, e, 8, routing, torch.float32, "cuda")
            idx[torch.rand(idx.shape, device="cuda") < 0.25] = e  # held elsewhere
            for block_m in (16, 32, 64):
                a, b = align_blocks_triton(idx, e, block_m), align_blocks(idx, e, block_m)
                assert torch.equal(a.sorted_ids, b.sorted_ids)
                assert torch.equal(a.block_expert, b.block_expert)
            planned = plan(idx, e)  # the block the kernel's tiles ask for, by the Triton form
            ref = align_blocks(idx, e, planned.block_m)
            assert torch.equal(planned.sorted_ids, ref.sorted_ids)
            assert torch.equal(planned.block_expert, ref.block_expert)


def test_combine_on_gpu() -> None:
    for t, dtype in ((1, torch.bfloat16), (64, torch.bfloat16), (300, torch.float32)):
        y = torch.randn(t * TOP_K, D, device="cuda") * torch.exp2(
            torch.randint(-20, 20, (t * TOP_K, 1), device="cuda").float()
        )
        idx = torch.randint(0, 65, (t, TOP_K), device="cuda")
        y[idx.reshape(-1) == 64] = float("nan")
        ref = sum_choices(torch.where(idx.reshape(-1, 1) < 64, y, 0).view(t, TOP_K, -1))
        assert torch.equal(combine_triton(y, idx, 64, dtype), ref.to(dtype))


@functools.cache
def _experts(e: int) -> FP8Experts:
    return FP8Experts.from_checkpoint(*make_experts(e, e, D, INTER, "F8_E8M0", "cuda"))


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_routed_experts_fused_equal_unfused(mode) -> None:
    """The same routing: the fused alignment and combine change no bit of the output."""
    layer = _experts(64)
    layer.mode = mode
    for seed, t in enumerate((1, 16, 256, FUSED_MAX_PAIRS // TOP_K + 16)):
        for routing in ("random", "one_expert", "few_experts"):
            x, idx, w = make_inputs(seed, t, TOP_K, 64, D, routing, torch.bfloat16, "cuda")
            idx[torch.rand(idx.shape, device="cuda") < 0.25] = 64  # held elsewhere
            with torch.no_grad():
                y = layer(x, idx, w)
                with unfused_kernels():
                    assert torch.equal(y, layer(x, idx, w))
    layer.mode = "w8a16"


def _moe(name: str) -> MoE:
    """A scaled preset's MoE layer (64 experts, the family's grouping), random FP8 weights."""
    cfg, _ = SCALED[name].parse()
    moe = MoE(cfg.moe, D, WeightFormat(fp8=True), Shards.single(cfg), key=3).cuda()
    moe.experts = _experts(64)
    g = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        moe.gate.weight.data = (torch.randn(64, D, generator=g, device="cuda") * D**-0.5).bfloat16()
        moe.gate.e_score_correction_bias.copy_(torch.randn(64, generator=g, device="cuda") * 0.1)
        for proj in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj,
                     moe.shared_experts.down_proj):  # fmt: skip
            w = torch.randn(proj.weight.shape, generator=g, device="cuda") * 4
            proj.weight.copy_(w.to(FP8_DTYPE))
            proj.weight_scale_inv.fill_(proj.in_features**-0.5 / 4)
    return moe


@pytest.mark.parametrize("name", ["v32-scaled", "glm5-scaled"])
def test_moe_layer_with_and_without_fusion(name) -> None:
    """Given the unfused router's experts, both forms weigh and sum the same pairs in the same
    order: the outputs differ by the weights' few ulps, within 2**-7 of the row's largest
    value. Each routing its own: the sum over choices in another order, same bound."""
    moe = _moe(name)
    for t in (1, 32, 256):
        x = torch.randn(t, D, device="cuda").bfloat16()
        with torch.no_grad():
            with unfused_kernels():
                _, idx_ref = moe.gate(x)
                y_ref = moe(x)
                y_ref_given = moe(x, idx_ref)
            for y, want in ((moe(x, idx_ref), y_ref_given), (moe(x), y_ref)):
                tol = 2.0**-7 * want.float().abs().amax(dim=1, keepdim=True)
                assert ((y.float() - want.float()).abs() <= tol).float().mean() >= 0.99


def test_fused_moe_layer_in_a_cuda_graph() -> None:
    """The fused layer captured once, replayed with new tokens in the same input buffer: the
    replay equals the eager fused layer on them (new routing, same kernels)."""
    moe = _moe("v32-scaled")
    x = torch.randn(16, D, device="cuda").bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            moe(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = moe(x)
    for seed in range(3):
        x.copy_(torch.randn(16, D, generator=torch.Generator().manual_seed(seed)).bfloat16())
        graph.replay()
        with torch.no_grad():
            assert torch.equal(out, moe(x))


def test_silu_mul_on_gpu() -> None:
    """The shared experts' activation (I = 2048 columns): torch's or one bf16 step from it (the
    GPU's fast exp against torch's expf), nearly all equal."""
    for t in (1, 64, 4096):
        gate = (torch.randn(t, INTER, device="cuda") * 4).bfloat16()
        up = torch.randn(t, INTER, device="cuda").bfloat16()
        out = silu_mul_triton(gate, up)
        with unfused_kernels():
            ref = F.silu(gate) * up
        assert ((out.float() - ref.float()).abs() <= 2.0**-7 * ref.float().abs()).all()
        assert (out == ref).float().mean() >= 0.99
