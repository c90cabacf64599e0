"""The FP8 store and gather kernels equal their torch references bit for bit (interpreter on the
CPU; @gpu on the device): packed bytes after a store, dequantized values after a gather, over
both formats, tiny and released dims, ragged counts, padding and seeds."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.fp8_kv_format import Fp8RowFormat, index_key_format, mla_row_format
from services.worker.ops.fp8_kv import fp8_gather_ref, fp8_store_ref
from services.worker.ops.fp8_kv_codec import pack
from tests.fp8_cases import random_rows

FORMATS = {
    "mla-released": mla_row_format(512, 64),
    "mla-tiny": mla_row_format(64, 16),
    "mla-odd-rope": mla_row_format(256, 24),
    "key-released": index_key_format(128),
    "key-tiny": index_key_format(32),
}


def case(fmt: Fp8RowFormat, seed: int, n: int, slots: int, dtype: torch.dtype, device: str):
    """n rows bound for distinct random pool rows, about a fifth of them padded (-1); the pool
    already holds other packed rows (so a gather reads only what a store could have written)."""
    g = torch.Generator().manual_seed(seed)
    rows = random_rows(fmt, n, seed, dtype)
    dst = torch.randperm(slots, generator=g)[:n]
    dst[torch.rand(n, generator=g) < 0.2] = -1
    pool = pack(fmt, random_rows(fmt, slots, seed + 7, torch.float32))
    return rows.to(device), dst.to(device), pool.to(device)


def check(fmt: Fp8RowFormat, seed: int, n: int, slots: int, dtype: torch.dtype, device: str):
    from services.worker.ops.fp8_gather_triton import fp8_gather_triton
    from services.worker.ops.fp8_store_triton import fp8_store_triton

    rows, dst, pool = case(fmt, seed, n, slots, dtype, device)
    expect = pool.clone()
    fp8_store_ref(fmt, expect, rows, dst)
    fp8_store_triton(fmt, pool, rows, dst)
    assert pool.equal(expect), mismatches(fmt, pool, expect, rows, dst)
    g = torch.Generator().manual_seed(seed + 1)
    src = torch.randint(0, slots, (n + 3,), generator=g)
    src[torch.rand(n + 3, generator=g) < 0.25] = -1
    src = src.to(device)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = fp8_gather_triton(fmt, pool, src, out_dtype)
        ref = fp8_gather_ref(fmt, pool, src, out_dtype)
        assert got.dtype == out_dtype
        bits = torch.int32 if out_dtype == torch.float32 else torch.int16
        assert got.view(bits).equal(ref.view(bits)), [
            (i, j, got[i, j].item(), ref[i, j].item(), pool[src[i]].tolist()[j : j + 1])
            for i, j in (got.view(bits) != ref.view(bits)).nonzero()[:6].tolist()
        ]
        assert (got[src.cpu() < 0] == 0).all()


def mismatches(
    fmt: Fp8RowFormat,
    pool: torch.Tensor,
    expect: torch.Tensor,
    rows: torch.Tensor,
    dst: torch.Tensor,
) -> list[tuple]:
    """(pool row, byte, got, expected, the source row's value there) at the first mismatches."""
    out = []
    for r, b in (pool != expect).nonzero()[:6].tolist():
        i = (dst == r).nonzero().flatten().tolist()
        col = b if b < fmt.n_values else None
        val = rows[i[0], col].item() if i and col is not None else None
        out.append((r, b, pool[r, b].item(), expect[r, b].item(), val))
    return out


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize(("seed", "n", "dtype"), [(0, 7, torch.float32), (1, 13, torch.bfloat16)])
def test_fp8_kernels_match_reference(name: str, seed: int, n: int, dtype: torch.dtype) -> None:
    check(FORMATS[name], seed, n, slots=40, dtype=dtype, device="cpu")


def test_fp8_kernels_empty_and_all_padding() -> None:
    fmt = FORMATS["key-tiny"]
    check(fmt, seed=5, n=1, slots=3, dtype=torch.float32, device="cpu")
    from services.worker.ops.fp8_gather_triton import fp8_gather_triton
    from services.worker.ops.fp8_store_triton import fp8_store_triton

    pool = torch.zeros(4, fmt.row_bytes, dtype=torch.uint8)
    fp8_store_triton(fmt, pool, torch.empty(0, fmt.width), torch.empty(0, dtype=torch.long))
    assert fp8_gather_triton(fmt, pool, torch.empty(0, dtype=torch.long), torch.float32).shape == (
        0,
        fmt.width,
    )
    out = fp8_gather_triton(fmt, pool, torch.full((3,), -1), torch.bfloat16)
    assert out.eq(0).all()


def test_fp8_encoder_over_every_e4m3_value_and_tie() -> None:
    """Every finite e4m3 value and each midpoint between neighbours (ties to even), subnormals
    included, at scale 1 (a 448 leads each row). Saturation is not reachable through a store:
    the scale rule keeps |x / scale| <= 448 (``test_scale_boundaries``)."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, torch.tensor([1e-9, -1e-9, 2.0**-10, -(2.0**-10)])])
    fmt = Fp8RowFormat(32, 0, 32, 0)
    pad = (-len(vals)) % 31
    vals = torch.cat([vals, torch.full((pad,), 0.3)]).reshape(-1, 31)
    rows = torch.cat([torch.full((len(vals), 1), 448.0), vals], dim=1)
    check_rows(fmt, rows)


def check_rows(fmt: Fp8RowFormat, rows: torch.Tensor) -> None:
    from services.worker.ops.fp8_store_triton import fp8_store_triton

    dst = torch.arange(len(rows))
    pool = torch.zeros(len(rows), fmt.row_bytes, dtype=torch.uint8)
    expect = pool.clone()
    fp8_store_ref(fmt, expect, rows, dst)
    fp8_store_triton(fmt, pool, rows, dst)
    assert pool.equal(expect), mismatches(fmt, pool, expect, rows, dst)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kernels_on_gpu(name: str, dtype: torch.dtype) -> None:
    for seed, n in enumerate([1, 7, 300, 4097]):
        check(FORMATS[name], seed, n, slots=5000, dtype=dtype, device="cuda")


@pytest.mark.parametrize("seed", range(4))
def test_fp8_kernels_random_shapes(seed: int) -> None:
    """Random tile, value and tail sizes (tail 0 = a key), row counts and pool sizes."""
    g = torch.Generator().manual_seed(100 + seed)
    tile = 2 ** int(torch.randint(3, 8, (1,), generator=g))
    n_tiles = int(torch.randint(1, 4, (1,), generator=g))
    tail = int(torch.randint(0, 3, (1,), generator=g)) * int(
        torch.randint(1, 40, (1,), generator=g)
    )
    fmt = Fp8RowFormat(tile * n_tiles, tail, tile, -13 if tail else -22)
    n = int(torch.randint(1, 30, (1,), generator=g))
    dtype = (torch.float32, torch.bfloat16)[seed % 2]
    check(fmt, seed, n, slots=n + int(torch.randint(0, 20, (1,), generator=g)), dtype=dtype,
          device="cpu")  # fmt: skip
