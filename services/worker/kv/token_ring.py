"""The uncompressed recent token rows of a source: its local window and its incomplete group.

Per slot a ring of ``R`` rows holds positions ``t`` at ``t mod R``. A forward pass sees them
through an *extended* buffer: for every request the ``R`` positions before its chunk (from the
ring) followed by the chunk's freshly computed rows. After that the chunk's last rows are
written back, so the ring never holds rows a reader of this pass still needs.

Where a pass's rings are read and written depends on the batch and the ring's size alone, so a
pass computes it once per size (``RingIndex``) for every ring it extends: a model's layers
share their window and compression rates, and a decode pass's addressing is a handful of
kernels instead of a dozen per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.worker.kv.batch import ForwardBatch


@dataclass(frozen=True)
class RingAddress:
    """Where a pass reads and writes a ring of one size, as flat row indices into
    ``data.view(-1, width)``: ``read`` [R_req * ring] the ring rows of each request's
    positions ``start - ring .. start - 1``; ``write`` the rows its kept chunk tokens
    ``kept`` (None: every token, in order) land on."""

    read: torch.Tensor
    write: torch.Tensor
    kept: torch.Tensor | None


@dataclass
class RingIndex:
    """One pass's ring addressing, each piece computed the first time the pass asks for it
    and shared by every ring of that size the pass extends. Made by the pass for itself (a
    captured pass computes it inside its graph), never kept beyond it."""

    batch: ForwardBatch
    _memo: dict[tuple, Any] = field(default_factory=dict)  # each piece by what it is of

    def _once(self, key: tuple, compute: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def address(self, ring: int) -> RingAddress:
        """The rows a ring of ``ring`` rows per slot is read and written at."""
        return self._once(("address", ring), lambda: self._locate(ring))

    def _locate(self, r: int) -> RingAddress:
        b = self.batch
        dev = b.positions.device
        before = b.starts_t.unsqueeze(1) - r + torch.arange(r, device=dev).unsqueeze(0)
        read = (b.slots.unsqueeze(1) * r + before % r).reshape(-1)
        write = b.token_slot * r + b.positions % r
        if max(b.lens) <= r:
            # Every chunk row survives (decode and verify passes): no mask and no shape read
            # from the device, so a CUDA graph captures it.
            return RingAddress(read, write, None)
        # Only each request's last ``ring`` chunk rows survive; writing just those keeps the
        # scatter free of duplicate targets.
        ends = (b.starts_t + torch.tensor(b.lens, device=dev))[b.token_req]
        kept = torch.nonzero(b.positions >= ends - r).squeeze(1)
        return RingAddress(read, write[kept], kept)

    def window_locs(self, ring: int, window: int, lag: int) -> torch.Tensor:
        """``ExtendedRows.window_locs`` of a ring of ``ring`` rows."""

        def compute() -> torch.Tensor:
            b = self.batch
            offs = torch.arange(window - 1, -1, -1, device=b.positions.device)
            pos = b.positions.unsqueeze(1) - offs.unsqueeze(0)
            idx = extended_index(b, ring, b.token_req.unsqueeze(1).expand_as(pos), pos)
            return torch.where(pos >= lag, idx, torch.full_like(idx, -1)) if lag else idx

        return self._once(("window", ring, window, lag), compute)

    def groups(
        self, ring: int, reqs: torch.Tensor, rows: torch.Tensor, rate: int, back: int
    ) -> torch.Tensor:
        """[g, rate] ``ExtendedRows.index`` of the positions of compressed rows ``rows - back``
        [g] of batch requests ``reqs`` [g] (``rate`` positions a row). A pass completes one set
        of rows of a rate (``PassState.completed_rows``), so these are computed once per
        (ring, rate, back) and every later call of the pass must ask of the same rows."""

        def compute() -> torch.Tensor:
            pos = (rows[:, None] - back) * rate + torch.arange(rate, device=rows.device)
            return extended_index(self.batch, ring, reqs[:, None].expand(-1, rate), pos)

        return self._once(("groups", ring, rate, back), compute)


def extended_index(
    b: ForwardBatch, ring: int, token_req: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """``ExtendedRows.index`` of a pass over ``b`` through a ring of ``ring`` rows."""
    start = b.starts_t[token_req]
    in_ring = token_req * ring + (pos - (start - ring))
    in_chunk = b.num_requests * ring + b.cu_lens[token_req] + (pos - start)
    idx = torch.where(pos < start, in_ring, in_chunk)
    return torch.where(pos >= 0, idx, torch.full_like(idx, -1))


@dataclass(frozen=True)
class ExtendedRows:
    """Rows addressable by (request, position) for one pass; see ``TokenRing.extend``."""

    rows: torch.Tensor  # [R_req * ring + N, d]
    ring: int
    at: RingIndex  # the pass's addressing

    def index(self, token_req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Buffer index of position ``pos`` of batch request ``token_req``; ``-1`` for pos < 0.

        Valid for ``start - ring <= pos < start + len`` of that request.
        """
        return extended_index(self.at.batch, self.ring, token_req, pos)

    def window_locs(self, window: int, lag: int = 0) -> torch.Tensor:
        """[N, window] indices of positions ``t-window+1 .. t`` for every token (``-1`` below
        ``lag``: a lagged source's positions that hold no row, ``SourceSpec.lag``)."""
        return self.at.window_locs(self.ring, window, lag)


class TokenRing:
    def __init__(
        self,
        max_slots: int,
        ring: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.ring = ring
        self.data = torch.zeros(max_slots, ring, width, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def extend(
        self, batch: ForwardBatch, rows: torch.Tensor, at: RingIndex | None = None
    ) -> ExtendedRows:
        """Builds the pass's extended buffer from the ring and the chunk rows [N, d], then
        records the chunk's rows in the ring. ``at``: the pass's addressing of ``batch``
        (None: computed for this ring alone)."""
        at = RingIndex(batch) if at is None else at
        if at.batch is not batch:
            raise ValueError("a ring index of another pass's batch")
        where = at.address(self.ring)
        flat = self.data.view(-1, self.data.shape[-1])
        rows = rows.to(self.data.dtype)
        ext = torch.cat([flat.index_select(0, where.read), rows], 0)
        flat.index_copy_(0, where.write, rows if where.kept is None else rows[where.kept])
        return ExtendedRows(rows=ext, ring=self.ring, at=at)

    def rows_at(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N, d] the rows of positions ``positions`` [N] of ``slots`` [N], each within the
        last ``ring`` positions its slot's passes wrote."""
        return self.data[slots, positions % self.ring]

    def clear(self, slot: int) -> None:
        self.data[slot].zero_()
