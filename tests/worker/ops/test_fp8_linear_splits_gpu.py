"""Split-K summed inside the kernel, on the GPU (all @gpu), where the programs of a launch run
concurrently and arrive at their tile's counter in any order: at both families' decode shapes
the fused sum equals ``sum_splits_ref`` (the split order, one add at a time) bit for bit, and
the torch path (``out.sum(dim=0)``) bit for bit up to 4 splits, where torch adds in the same
order (``test_fp8_linear_splits.py``), within fp32 reassociation beyond; the counters are zero
after every launch, after repeated launches and after CUDA graph replays, which give the
eager output bit for bit."""

from __future__ import annotations

import pytest
import torch

from services.worker.model.fp8_linear_layer import FP8Linear
from services.worker.ops.arrivals import CAPACITY, arrival_counters
from services.worker.ops.fp8_blockwise import quantize_blockwise
from services.worker.ops.fp8_linear import fp8_linear_partials, fp8_linear_triton
from services.worker.ops.fp8_linear_splits import sum_splits_ref
from services.worker.ops.fp8_linear_tiles import Tiles
from services.worker.ops.fusion import kernel_fusion, unfused_kernels
from tests.worker.ops.fp8_linear_cases import BF16_ULP, EPS32, assert_within


@pytest.fixture(autouse=True)
def _fused_kernels():
    """Fusion on (the engine's ``--fused-kernels``): each test's unfused side opts out."""
    with kernel_fusion():
        yield


pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
# Weights [N, K] of DeepSeek-V3.2 and GLM-5.2 with few output tiles at decode, so many splits.
SHAPES = {
    "v32.kv_a_proj_with_mqa": (576, 7168),
    "v32.indexer.wk": (128, 7168),
    "v32.q_a_proj": (1536, 7168),
    "v32.shared_down": (7168, 2048),
    "glm5.kv_a_proj_with_mqa": (576, 6144),
    "glm5.q_a_proj": (2048, 6144),
    "glm5.indexer.wq_b": (4096, 2048),
}
WIDE = Tiles(16, 128, 4, 3, split_programs=528, k_step=2)
# (M, x dtype, mode, tiles, with bias) per call of a shape.
CALLS = [
    (1, torch.bfloat16, "w8a16", None, False),
    (4, torch.bfloat16, "w8a8", WIDE, True),
    (16, torch.float16, "w8a16", WIDE, False),
    (3, torch.float32, "w8a16", None, True),
    (16, torch.bfloat16, "w8a8", None, True),
]
TORCH_IN_ORDER = 4  # torch's sum(dim=0) adds up to this many terms in order


def weights(seed: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w_fp8 [N, K], fp32 scale grid, bias [N])`` made on the GPU."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=CUDA) * 0.02
    w_fp8, scale = quantize_blockwise(w, (128, 128), "F32")
    return w_fp8, scale, torch.randn(n, generator=g, device=CUDA)


def activations(seed: int, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    scale = torch.exp(torch.randn(m, 1, generator=g, device=CUDA))
    return (torch.randn(m, k, generator=g, device=CUDA) * scale).to(dtype)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_fused_split_sum_on_gpu(name: str) -> None:
    n, k = SHAPES[name]
    w_fp8, scale, bias = weights(1, n, k)
    counters = torch.zeros(CAPACITY, dtype=torch.int32, device=CUDA)
    for i, (m, dtype, mode, tiles, with_bias) in enumerate(CALLS):
        x = activations(10 + i, m, k, dtype)
        b = bias if with_bias else None
        part = fp8_linear_partials(x, w_fp8, scale, mode, tiles=tiles)
        fused = fp8_linear_triton(x, w_fp8, scale, b, mode, tiles=tiles, sum_splits=True,
                                  counters=counters)  # fmt: skip
        torch_sum = fp8_linear_triton(x, w_fp8, scale, b, mode, tiles=tiles, sum_splits=False)
        what = f"{name} M={m} {dtype} {mode} splits={part.shape[0]}"
        assert part.shape[0] > 1, what
        assert not counters.any(), what
        assert torch.equal(fused, sum_splits_ref(part, b, dtype)), what
        if part.shape[0] <= TORCH_IN_ORDER:
            assert torch.equal(fused, torch_sum), what
        else:
            # Two orders of the same fp32 terms: each sum is off by at most (splits - 1) * u *
            # sum |part|; a 16-bit output may round the two onto neighbouring values.
            tol = 2 * part.shape[0] * EPS32 * part.abs().sum(dim=0)
            if dtype != torch.float32:
                tol = tol + BF16_ULP * torch_sum.float().abs()
            assert_within(fused, torch_sum, tol, what)


def test_repeated_launches_and_graph_replays_leave_counters_zero() -> None:
    n, k = SHAPES["v32.kv_a_proj_with_mqa"]
    w_fp8, scale, bias = weights(2, n, k)
    counters = torch.zeros(CAPACITY, dtype=torch.int32, device=CUDA)
    for tiles in (None, WIDE):
        x = activations(3, 4, k, torch.bfloat16)
        kw = {"tiles": tiles, "sum_splits": True, "counters": counters}
        eager = fp8_linear_triton(x, w_fp8, scale, bias, **kw)
        for _ in range(20):
            again = fp8_linear_triton(x, w_fp8, scale, bias, **kw)
            assert torch.equal(again, eager)
        assert not counters.any()

        static_x = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fp8_linear_triton(static_x, w_fp8, scale, bias, **kw)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [fp8_linear_triton(static_x, w_fp8, scale, bias, **kw) for _ in range(3)]
        for seed in range(5):
            new_x = activations(20 + seed, 4, k, torch.bfloat16)
            static_x.copy_(new_x)
            graph.replay()
            torch.cuda.synchronize()
            want = fp8_linear_triton(new_x, w_fp8, scale, bias, **kw)
            assert all(torch.equal(out, want) for out in outs), f"replay {seed}"
            assert not counters.any()


def test_fp8_linear_module_sums_in_the_kernel() -> None:
    """The module's CUDA forward (no gradient recorded) sums its splits in the kernel with the
    device's arrival counters, and inside ``unfused_kernels()`` with torch; both equal the
    op's two forms, and the device's counters are zero after."""
    n, k = SHAPES["glm5.kv_a_proj_with_mqa"]
    w_fp8, scale, bias = weights(4, n, k)
    x = activations(5, 2, k, torch.bfloat16)
    layer = FP8Linear.from_checkpoint(w_fp8, scale, bias)
    with torch.no_grad():
        y = layer(x)
        assert not arrival_counters(CUDA, 1).any()
        assert y.equal(fp8_linear_triton(x, w_fp8, scale, bias, sum_splits=True))
        with unfused_kernels():
            torch_sum = layer(x)
        assert torch_sum.equal(fp8_linear_triton(x, w_fp8, scale, bias, sum_splits=False))
