"""The grouped FP8 MoE kernel on the GPU at DeepSeek-V3.2's routed-expert shapes (D = 7168,
I = 2048, top_k = 8, E = 64 and 256), against the torch reference, and captured in a CUDA
graph that is replayed with new routing (all @gpu).

Bounds as on the CPU (``test_fp8_moe.py``): W8A16 with fp32 accumulation, ``(K + 16) * 2**-23``
per GEMM; W8A8 with the FP8 MMA's narrower accumulation over one K block of 128,
``128 * 2**-14`` per GEMM, as in ``test_fp8_linear_gpu.py``."""

from __future__ import annotations

import functools

import pytest
import torch

from services.worker.model.fp8_experts import FP8Experts
from services.worker.ops.fp8_moe import fp8_moe_ref, fp8_moe_triton
from tests.worker.ops.fp8_moe_cases import (
    EPS32,
    assert_within,
    make_experts,
    make_inputs,
    moe_bound,
)

D, INTER, TOP_K = 7168, 2048, 8
FP8_MMA_REL = 128 * 2.0**-14
REL = {"w8a16": ((D + 16) * EPS32, (INTER + 16) * EPS32), "w8a8": (FP8_MMA_REL, FP8_MMA_REL)}

pytestmark = pytest.mark.gpu


@functools.cache
def _layer(e: int) -> FP8Experts:
    """E experts of real size on the GPU (E = 256: 11 GB of e4m3), made once per E."""
    return FP8Experts.from_checkpoint(*make_experts(e, e, D, INTER, "F8_E8M0", "cuda"))


def _weights(layer: FP8Experts):
    return (
        layer.gate_up_proj, layer.gate_up_proj_scale_inv,
        layer.down_proj, layer.down_proj_scale_inv,
    )  # fmt: skip


@pytest.mark.parametrize("e", [64, 256])
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_moe_at_real_shapes(e, mode) -> None:
    weights = _weights(_layer(e))
    for seed, t in enumerate((1, 16, 128, 512)):
        x, idx, w = make_inputs(seed, t, TOP_K, e, D, "random", torch.bfloat16, "cuda")
        y = fp8_moe_triton(x, idx, w, *weights, mode)
        y_ref = fp8_moe_ref(x, idx, w, *weights, mode)
        assert y.dtype == torch.bfloat16 and y.shape == (t, D)
        assert_within(y, y_ref, moe_bound(x, idx, w, weights, mode, *REL[mode], y_ref))


def test_skewed_routing_and_fp32_on_gpu() -> None:
    """Every pair on one expert (32 blocks of it), two experts only, and fp32 activations."""
    weights = _weights(_layer(64))
    for seed, (routing, x_dtype) in enumerate(
        [("one_expert", torch.bfloat16), ("few_experts", torch.bfloat16), ("random", torch.float32)]
    ):
        x, idx, w = make_inputs(seed, 64, TOP_K, 64, D, routing, x_dtype, "cuda")
        for mode in ("w8a16", "w8a8"):
            y = fp8_moe_triton(x, idx, w, *weights, mode)
            y_ref = fp8_moe_ref(x, idx, w, *weights, mode)
            assert_within(y, y_ref, moe_bound(x, idx, w, weights, mode, *REL[mode], y_ref))


def test_module_on_cuda_is_the_kernel_and_batch_invariant() -> None:
    layer = _layer(64)
    x1, idx1, w1 = make_inputs(1, 16, TOP_K, 64, D, "random", torch.bfloat16, "cuda")
    x2, idx2, w2 = make_inputs(2, 16, TOP_K, 64, D, "random", torch.bfloat16, "cuda")
    x2[3], idx2[3], w2[3] = x1[3], idx1[3], w1[3]
    for mode in ("w8a16", "w8a8"):
        layer.mode = mode
        with torch.no_grad():
            y1 = layer(x1, idx1, w1)
            assert torch.equal(y1, fp8_moe_triton(x1, idx1, w1, *_weights(layer), mode))
            assert torch.equal(y1[3], layer(x2, idx2, w2)[3])  # the same token, other company
    layer.mode = "w8a16"


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_cuda_graph_replays_new_routing(mode) -> None:
    """FP8Experts.forward captured once with static x / idx / w buffers; new tokens and a new
    routing (other experts) written into the same buffers; the replay equals eager on them."""
    layer = _layer(64)
    layer.mode = mode
    x, idx, w = make_inputs(3, 16, TOP_K, 64, D, "random", torch.bfloat16, "cuda")
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
        x2, idx2, w2 = make_inputs(seed, 16, TOP_K, 64, D, routing, torch.bfloat16, "cuda")
        assert not torch.equal(idx2, idx)
        x.copy_(x2)
        idx.copy_(idx2)
        w.copy_(w2)
        graph.replay()
        with torch.no_grad():
            eager = layer(x2, idx2, w2)
        assert torch.equal(out, eager)
        assert not torch.equal(out, first)
    layer.mode = "w8a16"
