"""The radix-select top-k gives ``select_topk_ref``'s positions exactly (interpreter on the
CPU, @gpu on the device): ties across the k-th score (equal scores, +0.0 beside -0.0) by the
lower position, -inf scores, ragged visible lengths (0 among them), k above the width, rows
streamed in several blocks, in one program per query or in chunks; and on the GPU at the indexer's real shapes, inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from services.worker.ops.indexer import select_topk_ref
from services.worker.ops.select_topk_radix import RadixTiles, select_topk_radix


def case(seed: int, t: int, s: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(t, s, generator=g) * 3.0
    scores[0, 1::7] = 2.5  # a run of equal scores near the top
    scores[t - 1, : s // 3 : 2] = 0.0
    scores[t - 1, 1 : s // 3 : 2] = -0.0
    scores[t // 2, s // 2 :: 5] = float("-inf")
    if t > 2:  # a query of few distinct values: the k-th score has many equals
        scores[1] = torch.randint(-3, 3, (s,), generator=g).float()
    visible = torch.randint(0, s + 1, (t,), generator=g)
    visible[0] = s
    if t > 3:
        visible[3] = 0
    return scores.to(device), visible.to(device)


@pytest.mark.parametrize(
    ("seed", "t", "s", "k", "block"),
    [(0, 5, 300, 16, 64), (1, 4, 100, 40, 16), (2, 4, 30, 64, 16), (3, 6, 257, 100, 128)],
)
@pytest.mark.parametrize("chunks", [0, 2])
def test_radix_select_equals_torch_selection(seed, t, s, k, block, chunks) -> None:
    """One program per query, and the row's passes split into chunks of ``chunks`` blocks."""
    scores, visible = case(seed, t, s, "cpu")
    got = select_topk_radix(scores, visible, k, RadixTiles(block, 4, chunks * block))
    assert torch.equal(got, select_topk_ref(scores, visible, k))


def test_scores_that_differ_only_in_their_low_bits() -> None:
    """Every score in one top-11-bit bucket (1.0 plus up to 5000 ulps, with repeats), one
    row all equal: the lower digits and the ties decide, over candidates in several blocks."""
    g = torch.Generator().manual_seed(8)
    bits = torch.tensor(1.0).view(torch.int32) + torch.randint(0, 5000, (3, 200), generator=g)
    scores = bits.to(torch.int32).view(torch.float32).clone()
    scores[1, ::3] = scores[1, 0]
    scores[2] = -1.5
    visible = torch.tensor([200, 150, 170])
    for k in (7, 64, 199):
        for tiles in (RadixTiles(32, 4), RadixTiles(16, 4, 48)):
            got = select_topk_radix(scores, visible, k, tiles)
            assert torch.equal(got, select_topk_ref(scores, visible, k))


def test_visible_counts_outside_the_row_clamp() -> None:
    """A count past the width reads the width; every visible score a -inf is still taken."""
    scores, _ = case(7, 3, 50, "cpu")
    scores[2] = float("-inf")
    visible = torch.tensor([80, 50, 50])
    got = select_topk_radix(scores, visible, 8, RadixTiles(16, 4))
    assert torch.equal(got, select_topk_ref(scores, visible.clamp(max=50), 8))


def test_rejects_bad_input() -> None:
    scores = torch.randn(2, 10)
    with pytest.raises(ValueError, match="fp32"):
        select_topk_radix(scores.double(), torch.ones(2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="does not match"):
        select_topk_radix(scores, torch.ones(3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="at most"):
        select_topk_radix(scores, torch.ones(2, dtype=torch.int64), 10**5)
    with pytest.raises(ValueError, match="power of two"):
        RadixTiles(100)
    with pytest.raises(ValueError, match="multiple"):
        RadixTiles(64, 4, 100)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [512, 1024, 2048])
@pytest.mark.parametrize(("t", "s"), [(1, 8192), (16, 32768), (64, 131072), (5, 1500)])
def test_radix_select_on_gpu(t, s, k) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    scores, visible = case(t + s + k, t, s, "cuda")
    want = select_topk_ref(scores, visible, k)
    for tiles in (RadixTiles(), RadixTiles(2048, 4, 8192)):
        assert torch.equal(select_topk_radix(scores, visible, k, tiles), want)


@pytest.mark.gpu
def test_radix_select_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed over new scores and lengths written into the same buffers."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    scores, visible = case(1, 8, 65536, "cuda")
    for tiles in (RadixTiles(), RadixTiles(2048, 4, 8192)):
        select_topk_radix(scores, visible, 2048, tiles)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = select_topk_radix(scores, visible, 2048, tiles)
        for seed in (2, 3):
            new_scores, new_visible = case(seed, 8, 65536, "cuda")
            scores.copy_(new_scores)
            visible.copy_(new_visible)
            graph.replay()
            assert torch.equal(out, select_topk_ref(scores, visible, 2048))
