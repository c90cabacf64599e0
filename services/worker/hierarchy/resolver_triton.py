"""The fused resolver as Triton kernels: one launch resolves the whole batch for one source,
a second launch copies the misses from pinned host memory with a grid sized to the link
(``copy_triton.py``). This module holds the launches and their workspace; the fused kernel is
``resolver_kernel.py``.

``resolve_kernel`` runs one program per request: (1) tail/chunk rows resolve directly; (2) the
hot cache is looked up through the dense reverse map, hits are stamped (protected); (3) per query
in order, misses take the least recently used unprotected entries (a prefix of the LRU list,
found with one cumulative sum) and are
queued for copy; a row missed by an earlier query of the request is a hit for later ones, so
each distinct row is copied once. The copy kernel then reads the queued rows straight from the
host arena (a registered /dev/shm mapping under UVA on a GPU) into the hot cache.
Semantics are exactly ``resolver_ref.resolve_ref``'s."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton

from services.worker.hierarchy.copy_triton import DEFAULT_LAUNCH, CopyLaunch, copy_queued
from services.worker.hierarchy.geometry import SourceGeometry
from services.worker.hierarchy.hot_cache import HotCache
from services.worker.hierarchy.plan import ChunkPlan
from services.worker.hierarchy.read_order import sort_queued
from services.worker.hierarchy.resolver_kernel import resolve_kernel
from services.worker.hierarchy.staging import StagingOverflow
from services.worker.kv.config import HostReadOrder


class Workspace:
    """Buffers one resolver call needs, allocated once and reused (no allocation, zeroing
    only the counters, no host-device copies per call: safe to capture in a CUDA graph)."""

    def __init__(self, max_tokens: int, k: int, max_reqs: int, entries: int, device) -> None:
        self.bp = triton.next_power_of_2(entries)
        self.victims = torch.empty(max_reqs, self.bp, dtype=torch.int32, device=device)
        cap = max(1, max_tokens * k)
        self.plan_src = torch.empty(cap, dtype=torch.int64, device=device)
        self.plan_dst = torch.empty(cap, dtype=torch.int64, device=device)
        # direct, hot, host, copies queued, overflow
        self.counters = torch.zeros(5, dtype=torch.int64, device=device)

    def fits(self, tokens: int, k: int, reqs: int, entries: int) -> bool:
        return (
            tokens * k <= self.plan_src.numel()
            and reqs <= self.victims.shape[0]
            and triton.next_power_of_2(entries) == self.bp
        )


@dataclass(frozen=True)
class ResolveLaunch:
    """The resolve kernel's launch shape, a policy (every shape resolves alike): ``num_warps``
    per request's program, or by the hot cache's size: 16 from 2,048 entries (at k = 2,048 and
    B = 4,096 the fastest of 2-16 at every batch size, ``bench resolver --variants``), else 4."""

    num_warps: int | None = None

    def warps(self, entries_p2: int) -> int:
        if self.num_warps is not None:
            return self.num_warps
        return 16 if entries_p2 >= 2048 else 4


DEFAULT_RESOLVE = ResolveLaunch()

_WORKSPACES: dict[tuple, Workspace] = {}


def workspace_for(sel: torch.Tensor, nreq: int, entries: int) -> Workspace:
    """A cached workspace big enough for this call (grown, never shrunk), one per stream: the
    followers' resolutions run on a side stream while the producer's runs on the main one."""
    stream = torch.cuda.current_stream(sel.device).cuda_stream if sel.is_cuda else 0
    key = (sel.device, entries, stream)
    ws = _WORKSPACES.get(key)
    if ws is None or not ws.fits(sel.shape[0], sel.shape[1], nreq, entries):
        n = max(sel.shape[0], ws.plan_src.numel() // sel.shape[1] if ws else 0)
        ws = Workspace(n, sel.shape[1], max(nreq, ws.victims.shape[0] if ws else 0), entries,
                       sel.device)  # fmt: skip
        _WORKSPACES[key] = ws
    return ws


def reserve_workspace(
    device: torch.device, stream: int, max_tokens: int, k: int, max_reqs: int, entries: int
) -> None:
    """Allocates the workspace a stream's resolver calls will use, at its largest, before a
    CUDA graph is captured on that stream: a graph keeps the buffers' addresses, so the cached
    workspace must never be replaced (grown) afterwards."""
    key = (device, entries, stream)
    ws = _WORKSPACES.get(key)
    if ws is None or not ws.fits(max_tokens, k, max_reqs, entries):
        _WORKSPACES[key] = Workspace(max_tokens, k, max_reqs, entries, device)


def resolve_launcher(
    sel: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
    plan: ChunkPlan,
    geo: SourceGeometry,
    hot: HotCache,
    clock: int | torch.Tensor,
    host_base: torch.Tensor,
    row_elems: int,
    ws: Workspace,
) -> Callable[..., torch.Tensor]:
    """The resolve kernel's launch for one call, by ``PHASE`` (``resolver_kernel``: 0 the
    whole call; 1 steps 1-3, the copy queue; 2 steps 4-6): each launch returns the call's
    locations [N, k] (complete after phase 0 or 2); misses are queued in ``ws``, whose counters
    are zeroed here, once. ``launch(phase, shape)``: ``shape`` is the kernel's launch shape."""
    k = sel.shape[1]
    nreq = cu.numel() - 1
    sel = sel.contiguous()
    locs = torch.empty_like(sel)
    if not isinstance(clock, torch.Tensor):
        clock = torch.tensor(clock, dtype=torch.int64, device=sel.device)
    ws.counters.zero_()

    def launch(phase: int, shape: ResolveLaunch = DEFAULT_RESOLVE) -> torch.Tensor:
        resolve_kernel[(nreq,)](
            sel, sel.stride(0), cu, slots, plan.ring_lo, plan.chunk_lo, plan.in_scratch,
            plan.scratch_off, hot.map, hot.map.stride(0), hot.rows, hot.lru, hot.stamp,
            host_base, host_base.stride(0), geo.hot_pages, geo.hot_pages.stride(0),
            geo.tail_pages, geo.tail_pages.stride(0), geo.opt_map, geo.opt_map.stride(0),
            ws.victims, locs, ws.plan_src, ws.plan_dst, ws.counters,
            clock, k, hot.entries, geo.page, geo.ring, geo.scratch_base, geo.stage_base,
            geo.stage_rows, row_elems,
            KP=triton.next_power_of_2(k), BP=ws.bp, HAS_OPT=geo.optional, PHASE=phase,
            num_warps=shape.warps(ws.bp),
        )  # fmt: skip
        return locs

    return launch


def launch_resolve(
    sel: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
    plan: ChunkPlan,
    geo: SourceGeometry,
    hot: HotCache,
    clock: int | torch.Tensor,
    host_base: torch.Tensor,
    row_elems: int,
    ws: Workspace,
) -> torch.Tensor:
    """The resolve kernel alone, in one launch: returns locations [N, k]; queues misses in
    ``ws``."""
    return resolve_launcher(sel, cu, slots, plan, geo, hot, clock, host_base, row_elems, ws)(0)


def launch_copy(
    ws: Workspace,
    pool: torch.Tensor,
    host: torch.Tensor,
    order: HostReadOrder = HostReadOrder(),
    queued: int | None = None,
    launch: CopyLaunch = DEFAULT_LAUNCH,
) -> None:
    """The copy kernel alone: the workspace's queued rows from the host arena into the pool,
    in the ``order`` the policy asks for, with the kernel's ``launch`` shape. ``queued`` bounds
    what the resolve launch queued (its selected entries; default: the workspace's capacity)."""
    cap = ws.plan_src.numel()
    if order.by_address:
        sort_queued(ws.plan_src, ws.plan_dst, ws.counters[3], cap if queued is None else queued)
    copy_queued(pool, ws.plan_src, ws.plan_dst, ws.counters[3:], host, cap, launch)


@dataclass(frozen=True)
class TritonResolver:
    """The resolver as Triton kernels, issuing the host reads in ``order`` (a policy: any
    order gives the same bytes)."""

    order: HostReadOrder = field(default_factory=HostReadOrder)

    def __call__(
        self,
        sel: torch.Tensor,
        cu: torch.Tensor,
        slots: torch.Tensor,
        plan: ChunkPlan,
        geo: SourceGeometry,
        hot: HotCache,
        clock: int | torch.Tensor,
        pool: torch.Tensor,
        host: torch.Tensor,
        host_base: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as ``resolve_ref``. On a GPU ``host`` must be the pinned (registered)
        arena view; the copy kernel reads it directly."""
        ws = workspace_for(sel, cu.numel() - 1, hot.entries)
        locs = launch_resolve(sel, cu, slots, plan, geo, hot, clock, host_base, pool.shape[1], ws)
        launch_copy(ws, pool, host, self.order, sel.numel())
        if not pool.is_cuda or os.environ.get("DHISPARSE_CHECK_INVARIANTS"):
            overflow = int(ws.counters[4])  # synchronises: only on the CPU or when checking
            if overflow:
                raise StagingOverflow(f"{overflow} misses found no unprotected hot-cache entry")
        return locs, ws.counters[:4].clone()


resolve_triton = TritonResolver()  # the default policy (``HostReadOrder``)
