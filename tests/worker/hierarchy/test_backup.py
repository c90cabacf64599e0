"""The one-launch host backup scatter: the Triton kernel (CPU interpreter here, the GPU under
@gpu) writes exactly the kept rows where the torch reference does, and nothing else."""

from __future__ import annotations

import pytest
import torch

from services.worker.hierarchy.host_copy import backup_rows_ref, backup_rows_triton


def _case(seed: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    e, n = 72, 37
    store = torch.randn(300, e, generator=g).to(device=device, dtype=dtype)
    locs = torch.randperm(300, generator=g)[:n].to(device)
    # distinct destinations at row granularity, at odd element offsets (regions need not be
    # aligned to a whole row)
    dst = (torch.randperm(200, generator=g)[:n] * e + 5).to(device)
    keep = (torch.rand(n, generator=g) < 0.7).to(device)
    arena = torch.randn(200 * e + 5 + e, generator=g).to(dtype)
    return store, locs, dst, keep, arena


def test_reference_writes_kept_rows_only() -> None:
    store, locs, dst, keep, arena = _case(0, "cpu", torch.float32)
    before = arena.clone()
    backup_rows_ref(store, locs, dst, keep, arena)
    e = store.shape[1]
    touched = torch.zeros_like(arena, dtype=torch.bool)
    for i in range(len(locs)):
        span = slice(int(dst[i]), int(dst[i]) + e)
        if keep[i]:
            assert torch.equal(arena[span], store[locs[i]])
            touched[span] = True
    assert torch.equal(arena[~touched], before[~touched])
    assert touched.any() and not touched.all()


@pytest.mark.parametrize("seed", [1, 2])
def test_triton_equals_reference(seed: int) -> None:
    store, locs, dst, keep, arena = _case(seed, "cpu", torch.float32)
    ref = arena.clone()
    backup_rows_ref(store, locs, dst, keep, ref)
    backup_rows_triton(store, locs, dst, keep, arena)
    assert torch.equal(arena, ref)


@pytest.mark.gpu
def test_triton_equals_reference_gpu() -> None:
    store, locs, dst, keep, arena = _case(3, "cuda", torch.bfloat16)
    ref = arena.clone()
    backup_rows_ref(store, locs, dst, keep, ref)
    pinned = arena.pin_memory()
    backup_rows_triton(store, locs, dst, keep, pinned)
    torch.cuda.synchronize()
    assert torch.equal(pinned, ref)


@pytest.mark.parametrize("seed", [4, 5])
def test_restore_triton_equals_reference(seed: int) -> None:
    """Host -> device: the copy kernel fills exactly the rows the torch reference fills."""
    from services.worker.hierarchy.host_copy import restore_rows_ref, restore_rows_triton

    g = torch.Generator().manual_seed(seed)
    e, n = 72, 29
    arena = torch.randn(200 * e + 5 + e, generator=g)
    src = torch.randperm(200, generator=g)[:n] * e + 5
    dst = torch.randperm(300, generator=g)[:n]
    ref = torch.randn(300, e, generator=g)
    out = ref.clone()
    restore_rows_ref(ref, dst, src, arena)
    restore_rows_triton(out, dst, src, arena)
    assert torch.equal(out, ref)
    assert torch.equal(ref[dst[0]], arena[int(src[0]) : int(src[0]) + e])


def test_backup_then_restore_round_trips() -> None:
    store, locs, dst, keep, arena = _case(6, "cpu", torch.float32)
    keep = torch.ones_like(keep)
    backup_rows_ref(store, locs, dst, keep, arena)
    back = torch.zeros_like(store)
    from services.worker.hierarchy.host_copy import restore_rows_ref

    restore_rows_ref(back, locs, dst, arena)
    assert torch.equal(back[locs], store[locs])


@pytest.mark.gpu
def test_restore_triton_equals_reference_gpu() -> None:
    from services.worker.hierarchy.host_copy import restore_rows_ref, restore_rows_triton

    g = torch.Generator().manual_seed(7)
    e, n = 576, 300
    arena = torch.randn(400 * e + 8 + e, generator=g).to(torch.bfloat16)
    src = (torch.randperm(400, generator=g)[:n] * e + 8).cuda()
    dst = torch.randperm(1000, generator=g)[:n].cuda()
    ref = torch.randn(1000, e, generator=g).to("cuda", torch.bfloat16)
    out = ref.clone()
    restore_rows_ref(ref, dst, src, arena)
    restore_rows_triton(out, dst, src, arena.pin_memory())
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
