"""The host-read copy kernel (``copy_triton``) against a torch reference: rows at any element
offset of the arena, the queue's count read on the device, every launch shape moving the same
bytes."""

import pytest
import torch

from services.worker.hierarchy.copy_triton import CopyLaunch, copy_queued

# (dtype, row elements): MLA rows of 1,152 B (bf16) and 656 B (FP8 bytes), fp32 rows, and odd
# byte rows
CASES = [(torch.bfloat16, 576), (torch.uint8, 656), (torch.float32, 72), (torch.uint8, 37)]
LAUNCHES = [CopyLaunch(), CopyLaunch(rows=4), CopyLaunch(rows=32, num_warps=8)]


def _case(dtype: torch.dtype, d: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    regions, rows, n = 5, 40, 60
    base = 5  # region 0 starts off any word boundary
    region = rows * d + 3  # and the others at odd offsets after it
    arena_elems = base + regions * region + 7
    if dtype == torch.uint8:
        arena = torch.randint(0, 256, (arena_elems,), generator=g, dtype=torch.uint8)
        pool = torch.randint(0, 256, (300, d), generator=g, dtype=torch.uint8)
    else:
        arena = torch.randn(arena_elems, generator=g).to(dtype)
        pool = torch.randn(300, d, generator=g).to(dtype)
    which = torch.randperm(regions * rows, generator=g)[:n]
    src = base + (which // rows) * region + (which % rows) * d
    dst = torch.randperm(300, generator=g)[:n]
    return arena, pool.to(device), src.to(device), dst.to(device)


def _reference(pool, arena, src, dst, count):
    out = pool.clone()
    for s, t in zip(src[:count].tolist(), dst[:count].tolist(), strict=True):
        out[t] = arena[s : s + pool.shape[1]].to(pool.device)
    return out


def _run(arena, pool, src, dst, count, launch):
    out = pool.clone()
    n = torch.tensor([count], dtype=torch.int64, device=pool.device)
    copy_queued(out, src, dst, n, arena, src.numel(), launch)
    return out


@pytest.mark.parametrize(("dtype", "d"), CASES)
def test_copy_queued_equals_reference(dtype: torch.dtype, d: int) -> None:
    arena, pool, src, dst = _case(dtype, d, seed=d, device="cpu")
    count = 47  # entries past the count stay unread
    want = _reference(pool, arena, src, dst, count)
    for launch in LAUNCHES:
        got = _run(arena, pool, src, dst, count, launch)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), launch


def test_copy_queued_rejects_a_strided_row() -> None:
    arena, pool, src, dst = _case(torch.float32, 72, seed=1, device="cpu")
    with pytest.raises(ValueError, match="contiguous"):
        copy_queued(pool.t(), src, dst, torch.tensor([1]), arena, 1)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "d"), CASES)
def test_copy_queued_equals_reference_on_gpu(dtype: torch.dtype, d: int) -> None:
    arena, pool, src, dst = _case(dtype, d, seed=d, device="cuda")
    arena = arena.pin_memory()
    count = 47
    want = _reference(pool, arena, src, dst, count)
    for launch in LAUNCHES:
        got = _run(arena, pool, src, dst, count, launch)
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), launch
