"""Where each request's rows of the current forward pass live before they join the hierarchy.

Per request and source, rows ``[chunk_lo, chunk_hi)`` are being written by this pass. They go
to the slot's *tail ring* (T rows, row s at s mod T) when the chunk fits in it, else to the
pass's *scratch* area (a long prefill). Rows resolve *directly* when they are in the chunk or
still in the ring: ``s >= ring_lo``. Everything older comes from the hot cache or the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.transfers import to_device

if TYPE_CHECKING:
    from dhisparse.family.config import ModelConfig
    from services.worker.kv.batch import ForwardBatch


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
        return ChunkPlan.of(to_device(rows, device), rows, scratch, total)

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


@dataclass(frozen=True)
class PassPlans:
    """A pass's plans on the host: the distinct plans (sources with equal bounds, every source
    of most models, share one) and what the pass leaves in each slot's ring history."""

    distinct: list[tuple[list[list[int]], list[bool], int]]  # (rows, scratch flags, rows used)
    index: tuple[int, ...]  # per source: its plan in ``distinct``
    ring_hi: dict[int, list[int]]  # slot -> per source one past its highest ring row, after


def host_plans(
    slots: tuple[int, ...],
    starts: tuple[int, ...],
    ends: list[int],
    model_cfg: ModelConfig,
    ring: int,
    scratch: list[int],
    ring_hi_of: dict[int, list[int]],
    written: tuple[int, ...] | None = None,
) -> PassPlans:
    """The plans of a pass adding tokens ``[starts[r], ends[r])`` to ``slots[r]``, given the
    slots' ring history ``ring_hi_of`` (read, not changed). ``scratch``: each source's scratch
    rows. ``written``: the sources the pass writes (None: all); the others' ring history
    stays as it was."""
    distinct: list[tuple] = []
    his: list[list[int]] = []
    index: list[int] = []
    memo: dict[tuple, int] = {}
    after = {slot: list(ring_hi_of[slot]) for slot in slots}
    for s, rows in enumerate(scratch):
        m = model_cfg.sources[s].compress
        ring_hi = tuple(ring_hi_of[slot][s] for slot in slots)
        u = memo.get((m, ring_hi))
        if u is None:
            lo = [model_cfg.rows_for_tokens(s, a) for a in starts]
            hi = [model_cfg.rows_for_tokens(s, e) for e in ends]
            u = memo[(m, ring_hi)] = len(distinct)
            distinct.append(_plan_rows(lo, hi, ring, list(ring_hi)))
            his.append(hi)
        index.append(u)
        _, in_scratch, total = distinct[u]
        if total > rows:
            raise ValueError(f"a pass of {total} rows exceeds the prefill scratch ({rows} rows)")
        if written is not None and s not in written:
            continue
        for slot, h, sc in zip(slots, his[u], in_scratch, strict=True):
            if not sc:  # the chunk goes to the ring
                after[slot][s] = max(after[slot][s], h)
    return PassPlans(distinct, tuple(index), after)


def upload_plans(
    plans: PassPlans, device: torch.device | str
) -> tuple[list[ChunkPlan], torch.Tensor]:
    """(each source's plan, the [U, 5, R] device tensor the distinct plans' rows are views
    of): one host-to-device copy that does not wait for the device."""
    packed = to_device([d[0] for d in plans.distinct], device)
    distinct = [ChunkPlan.of(packed[u], *d) for u, d in enumerate(plans.distinct)]
    return [distinct[u] for u in plans.index], packed


@dataclass(frozen=True)
class Planner:
    """Plans the passes of one payload: its model's sources, tail ring of ``ring`` rows, each
    source's ``scratch`` rows and device."""

    model_cfg: ModelConfig
    ring: int
    scratch: list[int]
    device: torch.device

    def _host(
        self,
        slots: tuple[int, ...],
        starts: tuple[int, ...],
        ends: list[int],
        ring_hi_of: dict,
        written: tuple[int, ...] | None = None,
    ) -> PassPlans:
        return host_plans(
            slots, starts, ends, self.model_cfg, self.ring, self.scratch, ring_hi_of, written
        )

    def plan(
        self, batch: ForwardBatch, ring_hi_of: dict[int, list[int]]
    ) -> tuple[list[ChunkPlan], torch.Tensor, tuple[int, ...]]:
        """The plan of each source for ``batch`` (``host_plans``), uploaded: (each source's
        plan, the [U, 5, R] device rows of the U distinct plans, which of the U each source
        uses). A captured decode graph reads its own copy of the rows, refilled from these.
        Advances ``ring_hi_of`` for chunks that go to the ring."""
        hp = self._host(batch.slot_ids, batch.starts, batch.ends(), ring_hi_of, batch.sources)
        ring_hi_of.update(hp.ring_hi)
        plans, packed = upload_plans(hp, self.device)
        return plans, packed, hp.index

    def ahead(
        self, batch: ForwardBatch, ring_hi_of: dict[int, list[int]], epoch: int
    ) -> PlannedAhead:
        """The plans of a decode pass over ``batch``'s slots one token after it, uploaded (the
        copy queues behind the current pass), given the ring history once ``batch``'s pass is
        planned (``ring_hi_of``, not changed)."""
        starts = tuple(batch.ends())
        hp = self._host(batch.slot_ids, starts, [e + 1 for e in starts], ring_hi_of)
        plans, packed = upload_plans(hp, self.device)
        return PlannedAhead(batch.slot_ids, starts, epoch, hp, plans, packed)


@dataclass(frozen=True)
class PlannedAhead:
    """Plans built ahead for a decode pass over ``slots`` at ``starts``; valid while no slot
    was seated or released since (``epoch``, the payload's count of those)."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    epoch: int
    host: PassPlans
    plans: list[ChunkPlan]
    packed: torch.Tensor

    def matches(self, batch: ForwardBatch, epoch: int) -> bool:
        return (
            epoch == self.epoch
            and batch.slot_ids == self.slots
            and batch.starts == self.starts
            and batch.is_decode
            and batch.sources is None
        )
