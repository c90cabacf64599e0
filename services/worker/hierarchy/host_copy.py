"""Host backup of a pass's committed rows in one launch.

After a decode or verify pass every request has written one or a few rows per source; each
committed one must be copied to its host region. One copy per request and source is thousands
of small launches per step at high concurrency, so the rows of all requests and sources go in
one scatter: row i of the device store at ``locs[i]`` lands at element ``dst[i]`` of the host
arena when ``keep[i]`` (rejected speculative rows are written but not committed: skipped).

On a GPU a Triton kernel writes the pinned (registered) arena directly under UVA, ordered on the
stream like the host reads that may later fetch the rows back; elsewhere it is torch indexing."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch path needs no triton
    triton = None


def backup_rows_ref(
    store: torch.Tensor,
    locs: torch.Tensor,
    dst: torch.Tensor,
    keep: torch.Tensor,
    arena: torch.Tensor,
) -> None:
    """store: [P, E] device rows; locs, dst: [n] int64; keep: [n] bool; arena: flat host
    elements of the store's dtype."""
    e = store.shape[1]
    sel = keep.nonzero().squeeze(1)
    if not len(sel):
        return
    idx = dst[sel].unsqueeze(1) + torch.arange(e, device=dst.device)
    arena[idx.cpu()] = store[locs[sel]].to("cpu")


if triton is not None:

    @triton.jit(do_not_specialize=["n"])
    def _backup_rows_kernel(
        store_ptr,
        stride_store,
        locs_ptr,
        dst_ptr,
        keep_ptr,
        host_ptr,
        n,
        E,
        ROWS: tl.constexpr,
        EP: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_r = pid * ROWS + tl.arange(0, ROWS)
        offs_e = tl.arange(0, EP)
        m = offs_r < n
        keep = tl.load(keep_ptr + offs_r, mask=m, other=0) != 0
        m = m & keep
        src = tl.load(locs_ptr + offs_r, mask=m, other=0)
        dst = tl.load(dst_ptr + offs_r, mask=m, other=0)
        mm = m[:, None] & (offs_e < E)[None, :]
        vals = tl.load(store_ptr + src[:, None] * stride_store + offs_e[None, :], mask=mm)
        tl.store(host_ptr + dst[:, None] + offs_e[None, :], vals, mask=mm)


_ROWS = 4


def backup_rows_triton(
    store: torch.Tensor,
    locs: torch.Tensor,
    dst: torch.Tensor,
    keep: torch.Tensor,
    arena: torch.Tensor,
) -> None:
    """Same contract as ``backup_rows_ref``; on a GPU ``arena`` must be pinned (registered)."""
    from services.worker.hierarchy.host_backup import HostPointer

    n = locs.numel()
    if n == 0:
        return
    e = store.shape[1]
    host_arg = HostPointer(arena) if store.is_cuda else arena
    _backup_rows_kernel[(triton.cdiv(n, _ROWS),)](
        store, store.stride(0), locs, dst, keep.to(torch.int8), host_arg, n, e,
        ROWS=_ROWS, EP=triton.next_power_of_2(e),
    )  # fmt: skip


def restore_rows_ref(
    store: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, arena: torch.Tensor
) -> None:
    """The other direction: row i of the host arena starting at element ``src[i]`` into store
    row ``dst_rows[i]`` (both [n] int64 on the store's device)."""
    if not len(src):
        return
    idx = src.unsqueeze(1) + torch.arange(store.shape[1], device=src.device)
    store[dst_rows] = arena[idx.cpu()].to(store.device)


def restore_rows_triton(
    store: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, arena: torch.Tensor
) -> None:
    """Same contract as ``restore_rows_ref``, with the resolver's host-read copy kernel (on a
    GPU ``arena`` must be pinned: the kernel reads it under UVA)."""
    from services.worker.hierarchy.copy_triton import copy_rows

    copy_rows(store, src, dst_rows, arena)
