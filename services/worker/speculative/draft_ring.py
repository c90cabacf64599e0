"""The draft KV ring (DESIGN §5, eq. 9/10): the drafter's per-layer context K/V for the last W
committed positions of each request slot, in a fixed number of rows per slot.

A drafter that reads at most W prior positions, in blocks of at most K_max, with pages of p
rows, needs ``R_d = ring_rows(W, K_max, p)`` rows per slot (eq. 9); position t of slot i lives
at ``φ(i, t) = i·R_d + (t mod R_d)`` (eq. 10). Two positions a reader may need, n-W .. n-1,
and the at most K_max positions a round commits after that read, differ by less than R_d, so a
write never lands on a row the window still shows. Every row also records the position it holds
(its *tag*): a reader sees a row only when the tag is exactly the position it asks for, so it
can never read a position older than n-W, nor a stale or never-written row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dhisparse.capacity import ring_rows


class RingWindow(NamedTuple):
    """Where the last W positions before each request's frontier live in the ring."""

    locs: torch.Tensor  # [R, W] int64 ring rows (0 where invalid: safe to index)
    positions: torch.Tensor  # [R, W] int64, n-W .. n-1 (negative before the sequence)
    valid: torch.Tensor  # [R, W] bool: the row holds exactly that position


class DraftRing:
    def __init__(
        self,
        num_layers: int,
        width: int,
        max_slots: int,
        window: int,
        k_max: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if window < 1:
            raise ValueError(f"a draft window needs W >= 1, got {window}")
        self.window = window
        self.k_max = k_max
        self.rows_per_slot = ring_rows(window, k_max, page_size)  # R_d, eq. 9
        self.max_slots = max_slots
        total = max_slots * self.rows_per_slot
        self.k = torch.zeros(num_layers, total, width, dtype=dtype, device=device)
        self.v = torch.zeros(num_layers, total, width, dtype=dtype, device=device)
        self.tag = torch.full((total,), -1, dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one ring row over all layers' K and V (the capacity model's drafter row)."""
        return 2 * self.k.shape[0] * self.k.shape[2] * self.k.element_size()

    def addresses(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Eq. 10 on tensors (``dhisparse.capacity.ring_address`` elementwise): same-shape
        slots and positions (>= 0) -> ring rows."""
        return slots * self.rows_per_slot + positions % self.rows_per_slot

    def write(
        self,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        per_slot: int | None = None,
    ) -> None:
        """Stores committed positions. slots, positions: [N] int64; k, v: [L, N, width].

        A write of more than R_d positions of one slot (a long prefill) keeps only that slot's
        newest R_d, so no two rows of one write share an address. ``per_slot``: the most
        positions of one slot in this write, when the caller knows it (distinct positions);
        at most R_d spares that filtering and its read-back."""
        if positions.numel() == 0:
            return
        if per_slot is None or per_slot > self.rows_per_slot:
            newest = torch.full((self.max_slots,), -1, dtype=torch.int64, device=positions.device)
            newest = newest.scatter_reduce(0, slots, positions, reduce="amax")
            keep = positions > newest[slots] - self.rows_per_slot
            slots, positions, k, v = slots[keep], positions[keep], k[:, keep], v[:, keep]
        locs = self.addresses(slots, positions)
        self.k[:, locs] = k.to(self.k.dtype)
        self.v[:, locs] = v.to(self.v.dtype)
        self.tag[locs] = positions

    def window_of(self, slots: torch.Tensor, num_committed: torch.Tensor) -> RingWindow:
        """slots, num_committed: [R] int64 -> the ring rows of positions n-W .. n-1 of each
        request (right-aligned: column W-1 is position n-1)."""
        w = self.window
        offs = torch.arange(-w, 0, device=slots.device)
        pos = num_committed.unsqueeze(1) + offs.unsqueeze(0)  # [R, W]
        locs = self.addresses(slots.unsqueeze(1).expand_as(pos), pos.clamp(min=0))
        valid = (pos >= 0) & (self.tag[locs] == pos)
        return RingWindow(locs, pos, valid)

    def read(self, layer: int, win: RingWindow) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v: [R, W, width] of ``layer`` for the window (rows where ``~valid`` are
        arbitrary; attention masks them)."""
        return self.k[layer][win.locs], self.v[layer][win.locs]

    def clear(self, slot: int) -> None:
        """Forgets a slot's positions (a new request, or a released one)."""
        lo = slot * self.rows_per_slot
        self.tag[lo : lo + self.rows_per_slot] = -1
