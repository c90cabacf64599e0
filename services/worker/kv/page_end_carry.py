"""Per slot, the carry at the last page end its passes committed: the target's final hidden
state (a model's own carry width) at position ``k * page - 1``. A lagged source's row ``t`` is
written by the pass at position ``t + 1`` from the carry at ``t`` (docs/mtp.md), so a request
sharing another's first ``k * page`` tokens on the device (``serving.device_prefix``) needs the
carry at ``k * page - 1`` in its carry ring before its first pass: the carry ring keeps only a
slot's last positions, so the position of each page end is kept here as passes commit it."""

from __future__ import annotations

import itertools

import torch

from services.worker.kv.batch import ForwardBatch
from services.worker.kv.token_ring import TokenRing


class PageEndCarry:
    def __init__(self, carry: TokenRing, page_size: int) -> None:
        """``carry``: the KV cache's carry ring, whose rows hold the hidden states of a pass
        whose every chunk fits it (decode and verify passes)."""
        self.carry = carry
        self.page = page_size
        self.data = torch.zeros_like(carry.data[:, 0])  # [max_slots, width]
        self._noted: tuple[ForwardBatch, torch.Tensor] | None = None

    def note(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """The hidden states [N, width] of a pass with a chunk longer than the carry's ring (a
        prefill), which ``commit`` reads the page ends from."""
        self._noted = (batch, hidden)

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        """Keeps, for each request of the pass, the carry at the last page end among the
        positions it committed (``batch.starts[r] <= k * page - 1 < num_tokens[r]``)."""
        noted, self._noted = self._noted, None
        cu = [0, *itertools.accumulate(batch.lens)]
        for r, slot in enumerate(batch.slot_ids):
            end = num_tokens[r] // self.page * self.page - 1
            if end < batch.starts[r]:
                continue
            if batch.lens[r] <= self.carry.ring:
                self.data[slot] = self.carry.data[slot, end % self.carry.ring]
            else:
                if noted is None or noted[0] is not batch:
                    raise RuntimeError("a prefill committed a page end whose carry was not noted")
                self.data[slot] = noted[1][cu[r] + end - batch.starts[r]].to(self.data.dtype)

    def seat(self, slot: int, position: int, carry: torch.Tensor) -> None:
        """A request entering ``slot`` at ``position`` (a page end plus one) with ``carry``
        there: its carry ring and this record of it."""
        self.carry.data[slot, (position - 1) % self.carry.ring] = carry
        self.data[slot] = carry
