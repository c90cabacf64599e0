"""The grouped FP4 (W4A16) MoE kernel on the GPU at DeepSeek-V4-Flash's routed-expert shapes
(D = 4096, I = 2048, top_k = 6, E = 32 and 256, the SwiGLU clamped at 10), against the torch
reference, and captured in a CUDA graph that is replayed with new routing (all @gpu).

Bounds as on the CPU (``fp4_moe_cases.py``): the bf16 dots multiply exactly the dequantized
weights and accumulate in fp32, ``(K + 16) * 2**-23`` per GEMM."""

from __future__ import annotations

import functools

import pytest
import torch

from services.worker.model.fp4_experts import FP4Experts
from services.worker.ops.fp4_moe import fp4_moe_ref, fp4_moe_triton
from tests.worker.ops.fp4_moe_cases import make_fp4_experts, moe_bound, stacked
from tests.worker.ops.fp8_moe_cases import EPS32, assert_within, make_inputs

D, INTER, TOP_K, LIMIT = 4096, 2048, 6, 10.0
REL = ((D + 16) * EPS32, (INTER + 16) * EPS32)

pytestmark = pytest.mark.gpu


@functools.cache
def _layer(e: int) -> FP4Experts:
    """E experts of real size on the GPU (E = 256: 3.2 GB of e2m1), made once per E."""
    return FP4Experts.from_checkpoint(*make_fp4_experts(e, e, D, INTER, "cuda"), LIMIT)


@pytest.mark.parametrize("e", [32, 256])
def test_moe_at_v4_shapes(e) -> None:
    weights = stacked(_layer(e))
    for seed, t in enumerate((1, 16, 64)):
        x, idx, w = make_inputs(seed, t, TOP_K, e, D, "random", torch.bfloat16, "cuda")
        for limit in (LIMIT, 1.0, None):
            y = fp4_moe_triton(x, idx, w, *weights, limit)
            y_ref = fp4_moe_ref(x, idx, w, *weights, limit)
            assert y.dtype == torch.bfloat16 and y.shape == (t, D)
            assert_within(y, y_ref, moe_bound(x, idx, w, weights, *REL, y_ref, limit))


def test_skewed_routing_held_elsewhere_and_fp32_on_gpu() -> None:
    """Every pair on one expert (several blocks of it), two experts only, a third of the pairs
    on experts held elsewhere (id E), and fp32 activations."""
    weights = stacked(_layer(32))
    for seed, (routing, x_dtype, elsewhere) in enumerate(
        [
            ("one_expert", torch.bfloat16, 0.0),
            ("few_experts", torch.bfloat16, 0.0),
            ("random", torch.bfloat16, 0.33),
            ("random", torch.float32, 0.0),
        ]
    ):
        x, idx, w = make_inputs(seed, 64, TOP_K, 32, D, routing, x_dtype, "cuda")
        g = torch.Generator(device="cuda").manual_seed(seed)
        idx = torch.where(torch.rand(idx.shape, generator=g, device="cuda") < elsewhere, 32, idx)
        y = fp4_moe_triton(x, idx, w, *weights, LIMIT)
        y_ref = fp4_moe_ref(x, idx, w, *weights, LIMIT)
        assert_within(y, y_ref, moe_bound(x, idx, w, weights, *REL, y_ref, LIMIT))


def test_module_on_cuda_is_the_kernel_and_batch_invariant() -> None:
    layer = _layer(32)
    x1, idx1, w1 = make_inputs(1, 16, TOP_K, 32, D, "random", torch.bfloat16, "cuda")
    x2, idx2, w2 = make_inputs(2, 16, TOP_K, 32, D, "random", torch.bfloat16, "cuda")
    x2[3], idx2[3], w2[3] = x1[3], idx1[3], w1[3]
    with torch.no_grad():
        y1 = layer(x1, idx1, w1)
        assert torch.equal(y1, fp4_moe_triton(x1, idx1, w1, *stacked(layer), LIMIT))
        assert torch.equal(y1[3], layer(x2, idx2, w2)[3])  # the same token, other company


@pytest.mark.parametrize("t", [1, 16])
def test_cuda_graph_replays_new_routing(t) -> None:
    """FP4Experts.forward captured once with static x / idx / w buffers; new tokens and a new
    routing (other experts) written into the same buffers; the replay equals eager on them."""
    layer = _layer(256)
    x, idx, w = make_inputs(3, t, TOP_K, 256, D, "random", torch.bfloat16, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            layer(x, idx, w)  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = layer(x, idx, w)
    graph.replay()
    with torch.no_grad():
        first = layer(x, idx, w)
    assert torch.equal(out, first)
    for seed, routing in ((4, "random"), (5, "one_expert"), (6, "few_experts")):
        x2, idx2, w2 = make_inputs(seed, t, TOP_K, 256, D, routing, torch.bfloat16, "cuda")
        assert not torch.equal(idx2, idx)
        x.copy_(x2)
        idx.copy_(idx2)
        w.copy_(w2)
        graph.replay()
        with torch.no_grad():
            eager = layer(x2, idx2, w2)
        assert torch.equal(out, eager)
        assert not torch.equal(out, first)
