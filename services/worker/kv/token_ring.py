"""The uncompressed recent token rows of a source: its local window and its incomplete group.

Per slot a ring of ``R`` rows holds positions ``t`` at ``t mod R``. A forward pass sees them
through an *extended* buffer: for every request the ``R`` positions before its chunk (from the
ring) followed by the chunk's freshly computed rows. After that the chunk's last rows are
written back, so the ring never holds rows a reader of this pass still needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.kv.batch import ForwardBatch


@dataclass(frozen=True)
class ExtendedRows:
    """Rows addressable by (request, position) for one pass; see ``TokenRing.extend``."""

    rows: torch.Tensor  # [R_req * ring + N, d]
    ring: int
    batch: ForwardBatch

    def index(self, token_req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Buffer index of position ``pos`` of batch request ``token_req``; ``-1`` for pos < 0.

        Valid for ``start - ring <= pos < start + len`` of that request.
        """
        b = self.batch
        start = b.starts_t[token_req]
        in_ring = token_req * self.ring + (pos - (start - self.ring))
        in_chunk = b.num_requests * self.ring + b.cu_lens[token_req] + (pos - start)
        idx = torch.where(pos < start, in_ring, in_chunk)
        return torch.where(pos >= 0, idx, torch.full_like(idx, -1))

    def window_locs(self, window: int, lag: int = 0) -> torch.Tensor:
        """[N, window] indices of positions ``t-window+1 .. t`` for every token (``-1`` below
        ``lag``: a lagged source's positions that hold no row, ``SourceSpec.lag``)."""
        b = self.batch
        offs = torch.arange(window - 1, -1, -1, device=b.positions.device)
        pos = b.positions.unsqueeze(1) - offs.unsqueeze(0)
        idx = self.index(b.token_req.unsqueeze(1).expand_as(pos), pos)
        return idx if lag == 0 else torch.where(pos >= lag, idx, torch.full_like(idx, -1))


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

    def extend(self, batch: ForwardBatch, rows: torch.Tensor) -> ExtendedRows:
        """Builds the pass's extended buffer from the ring and the chunk rows [N, d], then
        records the chunk's rows in the ring."""
        r = self.ring
        dev = rows.device
        ring_pos = batch.starts_t.unsqueeze(1) - r + torch.arange(r, device=dev).unsqueeze(0)
        ring_part = self.data[batch.slots.unsqueeze(1), ring_pos % r]  # [R_req, r, d]
        ext = torch.cat([ring_part.reshape(-1, rows.shape[-1]), rows.to(self.data.dtype)], 0)
        if max(batch.lens) <= r:
            # Every chunk row survives (decode and verify passes): a scatter without a mask,
            # with no shape read from the device, so a CUDA graph captures it.
            self.data[batch.token_slot, batch.positions % r] = rows.to(self.data.dtype)
            return ExtendedRows(rows=ext, ring=r, batch=batch)
        # Only each request's last `ring` chunk rows survive; writing just those keeps the
        # scatter free of duplicate targets.
        ends = (batch.starts_t + torch.tensor(batch.lens, device=dev))[batch.token_req]
        keep = batch.positions >= ends - r
        self.data[batch.token_slot[keep], batch.positions[keep] % r] = rows[keep].to(
            self.data.dtype
        )
        return ExtendedRows(rows=ext, ring=r, batch=batch)

    def rows_at(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N, d] the rows of positions ``positions`` [N] of ``slots`` [N], each within the
        last ``ring`` positions its slot's passes wrote."""
        return self.data[slots, positions % self.ring]

    def clear(self, slot: int) -> None:
        self.data[slot].zero_()
