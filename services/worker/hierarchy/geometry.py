"""Where one source's rows live in the worker's shared device store, all of it in pages.

The store is one tensor of rows: ``num_pages`` pages of p rows shared by every source and every
use (hot-cache pages, tail-ring pages, optional-history pages), then a fixed prefill scratch per
source. Per slot and source, page tables say which pages hold the hot cache (B/p pages), the
tail ring (T/p pages) and the *ready* optional history (one entry per history page; -1 while a
page is absent or its copy is still in flight). Because every page comes from one pool,
optional history competes for exactly the memory the required allocations use (eq. 3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.hierarchy.plan import ChunkPlan


@dataclass
class SourceGeometry:
    page: int  # p rows per page
    hot_entries: int  # B, a multiple of p
    ring: int  # T, a multiple of p
    scratch_base: int  # first store row of this source's prefill scratch
    scratch: int  # scratch rows
    hot_pages: torch.Tensor  # [max_slots, B / p] int32
    tail_pages: torch.Tensor  # [max_slots, T / p] int32
    opt_map: torch.Tensor  # [max_slots, max history pages] int32, ready pages only
    stage_base: int = 0  # first store row of this source's staging arena
    stage_rows: int = 0  # staging rows per slot (K_max * k; 0: no staging)
    # optional history may be published in ``opt_map`` (adaptive); False: it never is, and the
    # resolver skips the map
    optional: bool = True

    @staticmethod
    def create(
        max_slots: int,
        page: int,
        hot_entries: int,
        ring: int,
        scratch_base: int,
        scratch: int,
        max_rows: int,
        device: torch.device | str,
        stage_base: int = 0,
        stage_rows: int = 0,
    ) -> SourceGeometry:
        if hot_entries % page or ring % page:
            raise ValueError(f"B={hot_entries} and T={ring} must be multiples of the page {page}")

        def table(cols: int) -> torch.Tensor:
            return torch.full((max_slots, cols), -1, dtype=torch.int32, device=device)

        return SourceGeometry(
            page, hot_entries, ring, scratch_base, scratch,
            table(hot_entries // page), table(ring // page), table(-(-max_rows // page)),
            stage_base, stage_rows,
        )  # fmt: skip

    def clear(self, slot: int) -> None:
        self.hot_pages[slot].fill_(-1)
        self.tail_pages[slot].fill_(-1)
        self.opt_map[slot].fill_(-1)

    # ---- locations (tensors of equal shape) -------------------------------------------------
    def hot_loc(self, slots: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        p = self.page
        return self.hot_pages[slots, entries // p].long() * p + entries % p

    def ring_loc(self, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        p, q = self.page, rows.clamp(min=0) % self.ring
        return self.tail_pages[slots, q // p].long() * p + q % p

    def stage_loc(self, slots: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.stage_base + slots.long() * self.stage_rows + index

    def opt_page(self, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.opt_map[slots, rows.clamp(min=0) // self.page].long()

    def direct(
        self, rows: torch.Tensor, req: torch.Tensor, slots: torch.Tensor, plan: ChunkPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(resolves directly, location) for rows of batch requests ``req`` (slots[req]): the
        chunk in scratch, the tail ring, then a ready optional page. rows, req: same shape."""
        slot = slots[req]
        valid = rows >= 0
        in_scratch = (plan.in_scratch[req] != 0) & (rows >= plan.chunk_lo[req])
        in_ring = rows >= plan.ring_lo[req]
        opt = self.opt_page(slot, rows)
        in_opt = valid & (opt >= 0)
        loc = torch.where(
            in_scratch,
            self.scratch_base + plan.scratch_off[req] + (rows - plan.chunk_lo[req]),
            torch.where(in_ring, self.ring_loc(slot, rows), opt * self.page + rows % self.page),
        )
        return valid & (in_scratch | in_ring | in_opt), loc
