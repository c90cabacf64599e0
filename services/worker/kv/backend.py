"""The seam between the model and where KV payload lives.

The model computes rows and selections; a ``PayloadBackend`` stores rows and turns selected
row positions into physical locations of its pool. Serving modes differ only here, which is why
their attention inputs can be bit-identical: attention reads ``pool(source)[locations]``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.worker.kv.batch import ForwardBatch


class PayloadBackend(Protocol):
    mode: str

    def pool(self, source: int) -> torch.Tensor:
        """[S, d_kv] the device rows that ``resolve`` locations index."""
        ...

    def write_rows(
        self, source: int, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Stores computed rows (row index ``rows[i]`` of slot ``slots[i]``)."""
        ...

    def resolve(
        self, layer: int, source: int, batch: ForwardBatch, selection: torch.Tensor
    ) -> torch.Tensor:
        """selection: [N, k] row positions (``-1`` pads) per query token of ``batch`` ->
        [N, k] int64 locations in ``pool(source)`` in the same order (``-1`` kept).

        Contract (exact placement, eq. 12): ``pool(source)[loc[j, i]]`` equals row
        ``selection[j, i]`` of that token's request."""
        ...

    def can_ensure(self, slot: int, num_tokens: int) -> bool: ...

    def ensure(self, slot: int, num_tokens: int) -> bool:
        """Makes room for a slot's first ``num_tokens`` tokens; False changes nothing."""
        ...

    def release(self, slot: int) -> None: ...

    @property
    def nbytes(self) -> int: ...
