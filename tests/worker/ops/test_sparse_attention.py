"""The sparse attention kernels equal their torch reference (interpreter on the CPU; @gpu on
the device), with padding, windows, shared rows and per-head sinks: the shapes
``attention_tiles`` chooses (the one-pass kernel) and the tiled kernel's (``AttentionTiles``)."""

from __future__ import annotations

import pytest
import torch

from services.worker.ops.sparse_attention import sparse_attention_ref


def case(seed: int, n: int, h: int, d: int, dv: int, k: int, w: int, device: str, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, d, generator=g).to(device, dtype)
    pool = torch.randn(500, d, generator=g).to(device, dtype)
    locs = torch.randint(0, 500, (n, k), generator=g)
    locs[torch.rand(n, k, generator=g) < 0.2] = -1  # padding anywhere
    locs[:, 0] = torch.randint(0, 500, (n,), generator=g)  # at least one valid row
    win_pool = win_locs = None
    if w:
        win_pool = torch.randn(64, d, generator=g).to(device, dtype)
        win_locs = torch.randint(0, 64, (n, w), generator=g)
        win_locs[:, : w // 3] = -1  # the window's start lies before position 0
        win_locs = win_locs.to(device)
    return q, pool, locs.to(device), dv, d**-0.5, win_pool, win_locs


def random_sinks(seed: int, h: int, device: str = "cpu") -> torch.Tensor:
    """Sink logits N(0, 3^2) per head, the first head's (12) outweighing its rows."""
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 3
    sinks[0] = 12.0
    return sinks.to(device)


def test_sinks_take_weight_and_give_no_value() -> None:
    """A head's sink is one more logit of its softmax: the reference with sinks equals the
    rows' softmax-weighted values scaled by the rows' share beside the sink, per head."""
    q, pool, locs, dv, scale, win_pool, win_locs = case(7, 3, 4, 80, 80, 24, 8, "cpu",
                                                        torch.float32)  # fmt: skip
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(8)) * 3
    plain = sparse_attention_ref(q, pool, locs, dv, scale, win_pool, win_locs)
    sunk = sparse_attention_ref(q, pool, locs, dv, scale, win_pool, win_locs, sinks)
    rows = torch.cat([pool[locs.clamp(min=0)], win_pool[win_locs.clamp(min=0)]], dim=1)
    valid = torch.cat([locs >= 0, win_locs >= 0], dim=1)
    scores = torch.einsum("nhd,nkd->nhk", q, rows) * scale
    lse = scores.masked_fill(~valid.unsqueeze(1), float("-inf")).logsumexp(-1)  # [N, H]
    share = torch.sigmoid(lse - sinks)  # e^lse / (e^lse + e^sink)
    torch.testing.assert_close(sunk, plain * share.unsqueeze(-1), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(sunk, plain)


@pytest.mark.parametrize(
    ("seed", "n", "h", "d", "dv", "k", "w"),
    # the last is V4's shape class: keys are the values (d_kv = d_v)
    [(0, 3, 4, 80, 64, 32, 0), (1, 2, 4, 80, 64, 16, 8), (2, 5, 20, 48, 32, 40, 0),
     (7, 3, 4, 64, 64, 40, 8)],
)  # fmt: skip
@pytest.mark.parametrize("sunk", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("tiled", [False, True], ids=["chosen", "tiled"])
def test_triton_sparse_attention_matches_reference(seed, n, h, d, dv, k, w, tiled, sunk) -> None:
    from services.worker.ops.sparse_attention_triton import AttentionTiles, sparse_attention_triton

    args = case(seed, n, h, d, dv, k, w, "cpu", torch.float32)
    sinks = random_sinks(seed, h) if sunk else None
    tiles = AttentionTiles(16, 64) if tiled else None
    torch.testing.assert_close(
        sparse_attention_triton(*args, tiles=tiles, sinks=sinks),
        sparse_attention_ref(*args, sinks=sinks), rtol=1e-4, atol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("values", [64, 16])
@pytest.mark.parametrize("combine", [True, False])
@pytest.mark.parametrize(("seed", "w", "splits"), [(3, 0, 3), (4, 8, 4), (5, 8, 2), (6, 8, 1)])
@pytest.mark.parametrize(("d", "sunk"), [(80, False), (80, True), (64, True)],
                         ids=["plain", "sinks", "v4-sinks"])  # fmt: skip
def test_split_rows_combine_to_the_reference(seed, w, splits, combine, values, d, sunk) -> None:
    """Flash-decoding splits (the decode path on a GPU) under the interpreter: k = 100 rows in
    splits of whole 32-row chunks (the last one short), the window in the first split, and one
    query whose last split holds padding only; the splits combined by the kernel's last program
    (``combine``, which leaves every arrival counter at 0) or by ``combine_splits``; the values
    in one block or in blocks of 16 columns; without sinks, with them (added once, in the
    combine), and with them at V4's shape class (d_kv = d_v = 64)."""
    from services.worker.ops.arrivals import arrival_counters
    from services.worker.ops.sparse_attention_triton import (
        AttentionTiles,
        row_splits,
        sparse_attention_triton,
    )

    assert row_splits(8, 2048, interpret=False) == (32, 64)
    assert row_splits(300, 2048, interpret=False) == (1, 2048)
    assert row_splits(8, 100, interpret=False, want=3) == (2, 64)
    q, pool, locs, dv, scale, win_pool, win_locs = case(seed, 3, 4, d, 64, 100, w, "cpu",
                                                        torch.float32)  # fmt: skip
    locs[1, 64:] = -1
    args = (q, pool, locs, dv, scale, win_pool, win_locs)
    sinks = random_sinks(seed, 4) if sunk else None
    tiles = AttentionTiles(16, values)
    torch.testing.assert_close(
        sparse_attention_triton(*args, splits=splits, combine=combine, tiles=tiles, sinks=sinks),
        sparse_attention_ref(*args, sinks=sinks), rtol=1e-4, atol=1e-5,
    )  # fmt: skip
    assert not arrival_counters(q.device, 1).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiled", [False, True], ids=["chosen", "tiled"])
def test_triton_sparse_attention_on_gpu(dtype, tiled) -> None:
    from services.worker.ops.sparse_attention_triton import AttentionTiles, sparse_attention_triton

    for seed, (n, h, d, dv, k, w) in enumerate(
        # a prefill chunk, a V3.2 decode step (128 heads: split rows), a windowed one
        [(64, 16, 576, 512, 2048, 0), (1, 128, 576, 512, 2048, 0), (7, 4, 80, 64, 32, 8)]
    ):
        args = case(seed, n, h, d, dv, k, w, "cuda", dtype)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        tiles = AttentionTiles(64, 256, 64, 8) if tiled else None
        torch.testing.assert_close(
            sparse_attention_triton(*args, tiles=tiles).float(), sparse_attention_ref(*args).float(),
            rtol=tol, atol=tol,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiled", [False, True], ids=["chosen", "tiled"])
def test_sinks_at_v4_shape_on_gpu(dtype, tiled) -> None:
    """V4's attention with its sinks: 64 heads whose keys are their values (d_kv = d_v = 512),
    512 selected rows and a 128-row window; decode steps (split rows, combined by the kernel,
    which leaves every arrival counter at 0, and by ``combine_splits``) and a chunk in one
    split."""
    from services.worker.ops.arrivals import arrival_counters
    from services.worker.ops.sparse_attention_triton import AttentionTiles, sparse_attention_triton

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    tiles = AttentionTiles(64, 256, 64, 8) if tiled else None
    for seed, (n, splits) in enumerate([(1, None), (4, None), (64, 1)]):
        args = case(seed, n, 64, 512, 512, 512, 128, "cuda", dtype)
        sinks = random_sinks(seed, 64, "cuda")
        want = sparse_attention_ref(*args, sinks=sinks).float()
        for combine in (True, False):
            got = sparse_attention_triton(*args, splits=splits, combine=combine, tiles=tiles,
                                          sinks=sinks)  # fmt: skip
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        assert not arrival_counters(want.device, 1).any()


@pytest.mark.gpu
def test_kernel_combine_matches_torch_combine_on_gpu_and_replays() -> None:
    """Decode shapes (split rows) on the GPU: the kernel's own combine against
    ``combine_splits``, repeated launches and CUDA-graph replays give the same output, and
    every arrival counter is 0 after each."""
    from services.worker.ops.arrivals import arrival_counters
    from services.worker.ops.sparse_attention_triton import sparse_attention_triton

    args = case(11, 4, 64, 576, 512, 2048, 0, "cuda", torch.bfloat16)
    torch_combined = sparse_attention_triton(*args, combine=False)
    first = sparse_attention_triton(*args, combine=True)
    torch.testing.assert_close(first.float(), torch_combined.float(), rtol=1e-2, atol=1e-2)
    for _ in range(3):
        assert torch.equal(sparse_attention_triton(*args, combine=True), first)
    assert not arrival_counters(first.device, 1).any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_attention_triton(*args, combine=True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    assert not arrival_counters(first.device, 1).any()
