"""Where each request's rows of the current forward pass live before they join the hierarchy.

Per request and source, rows ``[chunk_lo, chunk_hi)`` are being written by this pass. They go
to the slot's *tail ring* (T rows, row s at s mod T) when the chunk fits in it, else to the
pass's *scratch* area (a long prefill). Rows resolve *directly* when they are in the chunk or
still in the ring: ``s >= ring_lo``. Everything older comes from the hot cache or the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.worker.kv.batch import ForwardBatch
    from services.worker.model.config import ModelConfig


@dataclass(frozen=True)
class ChunkPlan:
    """Per batch request (tensors [R] int64 on the device, lists on the host). The five device
    rows are views of one [5, R] tensor, ``packed``, filled by one host-to-device copy."""

    chunk_lo: torch.Tensor
    chunk_hi: torch.Tensor
    ring_lo: torch.Tensor  # rows >= ring_lo resolve directly (ring or scratch)
    in_scratch: torch.Tensor  # 0/1, kernels read it directly
    scratch_off: torch.Tensor  # first scratch row of the request's chunk
    lo: list[int]
    hi: list[int]
    scratch: list[bool]
    scratch_rows: int  # scratch rows this pass uses
    all_direct: bool  # every request's whole history is in its chunk or ring
    packed: torch.Tensor | None = None  # [5, R]: the rows above, in their order

    @staticmethod
    def build(
        chunk_lo: list[int],
        chunk_hi: list[int],
        ring: int,
        device: torch.device | str,
        ring_hi: list[int] | None = None,
    ) -> ChunkPlan:
        """``ring_hi[r]``: one past the highest row ever written to the request's ring. A ring
        slot holds row s only while nothing later went to slot s mod T, so after a verify
        round wrote rows beyond what it committed, the valid window ends below them."""
        rows, scratch, total = _plan_rows(chunk_lo, chunk_hi, ring, ring_hi)
        packed = torch.tensor(rows, dtype=torch.int64).to(device)
        return ChunkPlan.of(packed, rows, scratch, total)

    @staticmethod
    def of(
        packed: torch.Tensor, rows: list[list[int]], scratch: list[bool], total: int
    ) -> ChunkPlan:
        """The plan whose device rows are ``packed`` [5, R], a copy of the host's ``rows``
        (``_plan_rows``)."""
        return ChunkPlan(
            *packed.unbind(0), lo=rows[0], hi=rows[1], scratch=scratch, scratch_rows=total,
            all_direct=max(rows[2]) == 0, packed=packed,
        )  # fmt: skip


def _plan_rows(
    chunk_lo: list[int], chunk_hi: list[int], ring: int, ring_hi: list[int] | None
) -> tuple[list[list[int]], list[bool], int]:
    """([chunk_lo, chunk_hi, ring_lo, in_scratch, scratch_off], scratch flags, scratch rows)."""
    ring_hi = ring_hi or [0] * len(chunk_lo)
    scratch = [hi - lo > ring for lo, hi in zip(chunk_lo, chunk_hi, strict=True)]
    offs, total = [], 0
    for lo, hi, sc in zip(chunk_lo, chunk_hi, scratch, strict=True):
        offs.append(total)
        total += hi - lo if sc else 0
    # A chunk in scratch leaves the ring as it was before the pass.
    ring_lo = [
        max(0, max(lo if sc else hi, rh) - ring)
        for lo, hi, sc, rh in zip(chunk_lo, chunk_hi, scratch, ring_hi, strict=True)
    ]
    rows = [list(chunk_lo), list(chunk_hi), ring_lo, [int(x) for x in scratch], offs]
    return rows, scratch, total


def plan_pass(
    batch: ForwardBatch,
    model_cfg: ModelConfig,
    ring: int,
    scratch: list[int],
    ring_hi_of: dict[int, list[int]],
    device: torch.device | str,
) -> tuple[list[ChunkPlan], torch.Tensor]:
    """The plan of each source for ``batch``, and the [S, 5, R] device tensor every plan's
    rows are views of (one host-to-device copy for the pass; a captured decode graph reads
    its own copy, refilled from it). Advances ``ring_hi_of[slot][source]`` (one past the
    highest row ever written to the slot's ring) for chunks that go to the ring.
    ``scratch``: each source's scratch rows."""
    ends = batch.ends()
    slots = batch.slot_ids
    host = []
    memo: dict[tuple, tuple] = {}  # sources with equal bounds share one host plan
    for s, rows in enumerate(scratch):
        m = model_cfg.sources[s].compress
        ring_hi = tuple(ring_hi_of[slot][s] for slot in slots)
        got = memo.get((m, ring_hi))
        if got is None:
            lo = [model_cfg.rows_for_tokens(s, a) for a in batch.starts]
            hi = [model_cfg.rows_for_tokens(s, e) for e in ends]
            got = memo[(m, ring_hi)] = (hi, _plan_rows(lo, hi, ring, list(ring_hi)))
        hi, (plan_rows, in_scratch, total) = got
        for slot, h, sc in zip(slots, hi, in_scratch, strict=True):
            if not sc:
                ring_hi_of[slot][s] = max(ring_hi_of[slot][s], h)
        if total > rows:
            raise ValueError(f"a pass of {total} rows exceeds the prefill scratch ({rows} rows)")
        host.append((plan_rows, in_scratch, total))
    packed = torch.tensor([h[0] for h in host], dtype=torch.int64).to(device)
    return [ChunkPlan.of(packed[s], *h) for s, h in enumerate(host)], packed


@dataclass(frozen=True)
class PoolLayout:
    """Location space of a source's device pool: ``[hot | ring | scratch]``."""

    max_slots: int
    hot_entries: int  # B
    ring: int  # T
    scratch: int

    @property
    def ring_base(self) -> int:
        return self.max_slots * self.hot_entries

    @property
    def scratch_base(self) -> int:
        return self.ring_base + self.max_slots * self.ring

    @property
    def rows(self) -> int:
        return self.scratch_base + self.scratch

    def direct_locations(
        self, rows: torch.Tensor, req: torch.Tensor, slots: torch.Tensor, plan: ChunkPlan
    ) -> torch.Tensor:
        """Locations of rows that resolve directly (undefined elsewhere). rows, req: same shape;
        req indexes the batch, slots[req] the slot."""
        in_chunk_scratch = (plan.in_scratch[req] != 0) & (rows >= plan.chunk_lo[req])
        scratch_loc = self.scratch_base + plan.scratch_off[req] + (rows - plan.chunk_lo[req])
        ring_loc = self.ring_base + slots[req] * self.ring + rows.clamp(min=0) % self.ring
        return torch.where(in_chunk_scratch, scratch_loc, ring_loc)
