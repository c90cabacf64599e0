"""The one-pass sparse attention kernel equals its torch reference (interpreter on the CPU;
@gpu on the device): padding, windows, head counts that do not fill a head block, row splits
combined by the kernel or in torch, per-head sinks, and packed FP8 rows dequantized in the
kernel against attention over the reference dequantizer's rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dhisparse.family.fp8_kv_format import Fp8RowFormat, mla_row_format
from services.worker.ops.arrivals import arrival_counters
from services.worker.ops.fp8_kv import fp8_gather_ref
from services.worker.ops.fp8_kv_codec import pack
from services.worker.ops.sparse_attention import sparse_attention_ref
from services.worker.ops.sparse_attention_onepass import (
    OnePassTiles,
    PackedRows,
    onepass_splits,
    sparse_attention_onepass,
)
from services.worker.ops.sparse_attention_triton import (
    AttentionTiles,
    attention_tiles,
    sparse_attention_triton,
)
from tests.worker.ops.test_sparse_attention import case, random_sinks

SMALL = OnePassTiles(heads=16, block_k=16, warps=4)


@pytest.mark.parametrize(
    ("seed", "n", "h", "d", "dv", "k", "w"),
    # the last is V4's shape class: keys are the values (d_kv = d_v, no tail)
    [(0, 3, 4, 80, 64, 32, 0), (1, 2, 20, 80, 64, 40, 8), (2, 3, 16, 48, 32, 24, 0),
     (3, 2, 20, 64, 64, 40, 8)],
)  # fmt: skip
@pytest.mark.parametrize("sunk", [False, True], ids=["plain", "sinks"])
def test_one_pass_matches_reference(seed, n, h, d, dv, k, w, sunk) -> None:
    args = case(seed, n, h, d, dv, k, w, "cpu", torch.float32)
    sinks = random_sinks(seed, h) if sunk else None
    want = sparse_attention_ref(*args, sinks=sinks)
    torch.testing.assert_close(sparse_attention_onepass(*args, tiles=SMALL, sinks=sinks), want,
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    # the same kernel through the attention entry point, chosen by its tiles
    got = sparse_attention_triton(*args, tiles=SMALL, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("combine", [True, False])
@pytest.mark.parametrize(("seed", "w", "splits"), [(3, 0, 3), (4, 8, 4)])
@pytest.mark.parametrize(("d", "sunk"), [(80, False), (80, True), (64, True)],
                         ids=["plain", "sinks", "v4-sinks"])  # fmt: skip
def test_one_pass_splits_combine_to_the_reference(seed, w, splits, combine, d, sunk) -> None:
    """k = 100 rows in splits of 16-row chunks, the window in the first split, one query whose
    last splits hold padding only; the kernel's combine leaves every arrival counter at 0; with
    sinks (added once, in the combine), also at V4's shape class (d_kv = d_v = 64)."""
    q, pool, locs, dv, scale, win_pool, win_locs = case(seed, 3, 4, d, 64, 100, w, "cpu",
                                                        torch.float32)  # fmt: skip
    locs[1, 48:] = -1
    args = (q, pool, locs, dv, scale, win_pool, win_locs)
    sinks = random_sinks(seed, 4) if sunk else None
    got = sparse_attention_onepass(*args, splits=splits, combine=combine, tiles=SMALL, sinks=sinks)
    torch.testing.assert_close(got, sparse_attention_ref(*args, sinks=sinks), rtol=1e-4,
                               atol=1e-5)  # fmt: skip
    assert not arrival_counters(q.device, 1).any()


def fp8_case(seed: int, n: int, h: int, fmt: Fp8RowFormat, k: int, device: str, dtype):
    """Packed rows of a pool whose tiles span scales 2^-6 .. 2^3, and the dequantized pool."""
    g = torch.Generator().manual_seed(seed)
    d = fmt.width
    rows = torch.randn(300, d, generator=g)
    rows[:, : fmt.n_values] *= torch.exp2(torch.randint(-6, 4, (300, 1), generator=g).float())
    packed = pack(fmt, rows).to(device)
    everything = torch.arange(300, device=device)
    plain = fp8_gather_ref(fmt, packed, everything, dtype)
    q = (torch.randn(n, h, d, generator=g) * 0.3).to(device, dtype)
    locs = torch.randint(0, 300, (n, k), generator=g)
    locs[torch.rand(n, k, generator=g) < 0.2] = -1
    locs[:, 0] = torch.randint(0, 300, (n,), generator=g)
    return q, packed, plain, locs.to(device)


@pytest.mark.parametrize("sunk", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("cast", [False, True])
@pytest.mark.parametrize(("seed", "splits"), [(5, 1), (6, 3)])
def test_fp8_rows_dequantized_in_the_kernel(seed, splits, cast, sunk) -> None:
    fmt = Fp8RowFormat(n_values=64, n_tail=16, tile=32, min_scale_exp=-13)
    q, packed, plain, locs = fp8_case(seed, 3, 20, fmt, 40, "cpu", torch.float32)
    sinks = random_sinks(seed, 20) if sunk else None
    want = sparse_attention_ref(q, plain, locs, 64, 0.1, sinks=sinks)
    tiles = dataclasses.replace(SMALL, cast_fp8=cast)
    got = sparse_attention_onepass(q, PackedRows(packed, fmt), locs, 64, 0.1, splits=splits,
                                   tiles=tiles, sinks=sinks)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_split_cap_bounds_the_splits() -> None:
    """``max_splits`` caps the splits an explicit request or ``row_splits`` would take."""
    capped = OnePassTiles(16, 16, 4, max_splits=2)
    assert onepass_splits(SMALL, 8, 100, interpret=False, want=5) == (4, 32)
    assert onepass_splits(capped, 8, 100, interpret=False, want=5) == (2, 64)
    assert onepass_splits(OnePassTiles(32, 32, 8, max_splits=8), 4, 2048, False) == (8, 256)
    assert onepass_splits(OnePassTiles(32, 32, 8), 4, 2048, False) == (64, 32)
    args = case(9, 2, 4, 80, 64, 100, 8, "cpu", torch.float32)
    capped = dataclasses.replace(SMALL, max_splits=2)
    got = sparse_attention_onepass(*args, splits=5, combine=False, tiles=capped)
    torch.testing.assert_close(got, sparse_attention_ref(*args), rtol=1e-4, atol=1e-5)


def test_rejects_a_pool_that_does_not_match() -> None:
    fmt = Fp8RowFormat(n_values=64, n_tail=16, tile=32, min_scale_exp=-13)
    q, packed, plain, locs = fp8_case(7, 1, 4, fmt, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="packed rows"):
        sparse_attention_onepass(q, PackedRows(plain, fmt), locs, 64, 0.1)
    with pytest.raises(ValueError, match="does not hold"):
        sparse_attention_onepass(q, PackedRows(packed, fmt), locs, 48, 0.1)
    with pytest.raises(ValueError, match="is not rows"):
        sparse_attention_onepass(q, plain.double(), locs, 64, 0.1)
    with pytest.raises(ValueError, match="one-pass kernel"):
        sparse_attention_triton(q, PackedRows(packed, fmt), locs, 64, 0.1,
                                tiles=AttentionTiles(16, 64))  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        OnePassTiles(heads=24)


def test_decode_batches_take_the_measured_one_pass_shapes() -> None:
    assert attention_tiles(128, 1) == attention_tiles(64, 4) == OnePassTiles(16, 32, 4)
    assert attention_tiles(128, 16) == OnePassTiles(64, 32, 8)
    assert attention_tiles(64, 64) == OnePassTiles(32, 64, 8)
    assert attention_tiles(16, 64) == attention_tiles(4, 5) == OnePassTiles(16, 64, 8)


REAL = [(1, 128), (4, 64), (16, 128), (64, 64)]  # (decode tokens, heads): V3.2 and GLM-5


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "h"), REAL)
def test_one_pass_at_real_shapes_on_gpu(n, h) -> None:
    args = case(n + h, n, h, 576, 512, 2048, 0, "cuda", torch.bfloat16)
    want = sparse_attention_ref(*args).float()
    for tiles in (OnePassTiles(), OnePassTiles(max_splits=8)):
        got = sparse_attention_onepass(*args, tiles=tiles).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "h"), REAL)
def test_fp8_one_pass_at_real_shapes_on_gpu(n, h) -> None:
    fmt = mla_row_format(512, 64)
    q, packed, plain, locs = fp8_case(n * h, n, h, fmt, 2048, "cuda", torch.bfloat16)
    want = sparse_attention_ref(q, plain, locs, 512, 576**-0.5).float()
    for tiles in (OnePassTiles(), OnePassTiles(cast_fp8=True)):
        got = sparse_attention_onepass(q, PackedRows(packed, fmt), locs, 512, 576**-0.5,
                                       tiles=tiles).float()  # fmt: skip
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4, 64])
def test_one_pass_with_sinks_at_v4_shape_on_gpu(n, dtype) -> None:
    """V4's shape with its sinks (64 heads, d_kv = d_v = 512: no tail; 512 selected rows and a
    128-row window) in the tiles ``attention_tiles`` chooses, with and without a split cap,
    the splits combined by the kernel and by ``combine_splits``."""
    args = case(n, n, 64, 512, 512, 512, 128, "cuda", dtype)
    sinks = random_sinks(n, 64, "cuda")
    want = sparse_attention_ref(*args, sinks=sinks).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    chosen = attention_tiles(64, n)
    for tiles in (chosen, dataclasses.replace(chosen, max_splits=2)):
        for combine in (True, False):
            got = sparse_attention_onepass(*args, combine=combine, tiles=tiles, sinks=sinks)
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert not arrival_counters(want.device, 1).any()


@pytest.mark.gpu
def test_one_pass_replays_in_a_cuda_graph() -> None:
    """Split rows combined by the kernel: repeated launches and replays give the same output
    and leave every arrival counter at 0."""
    args = case(11, 4, 64, 576, 512, 2048, 0, "cuda", torch.bfloat16)
    first = sparse_attention_onepass(*args, combine=True)
    torch_combined = sparse_attention_onepass(*args, combine=False)
    torch.testing.assert_close(first.float(), torch_combined.float(), rtol=1e-2, atol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_attention_onepass(*args, combine=True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    assert not arrival_counters(first.device, 1).any()
