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

    def begin(self, batch: ForwardBatch) -> None:
        """Plans where this pass's new rows go; called before the model writes any."""

    def prefetch(
        self, layers: list[tuple[int, int]], batch: ForwardBatch, selection: torch.Tensor
    ) -> None:
        """May start resolving ``(layer, source)`` pairs for ``selection`` early; ``resolve``
        for those layers then returns the result."""

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        """After the pass: the first ``num_tokens[r]`` tokens of request r are final (eq. 7);
        their complete rows join the history (eq. 8). Rows beyond are never published."""

    def admit(
        self,
        slot: int,
        request_id: str,
        max_tokens: int,
        session: dict | None = None,
        extra_pages: int = 0,
    ) -> bool:
        """Sets a new request up in ``slot`` for at most ``max_tokens`` tokens (with the
        durable ``session`` regions, and ``extra_pages`` more pages of the mode's pool left
        free for the caller: the index keys of the hierarchy modes); False if the mode's own
        capacity (device pages, host backup) is short."""

    def memory_bytes(self, admitted: int) -> tuple[int, int]:
        """(bytes held by the admitted requests, fixed bytes of the mode)."""

    def pool(self, source: int) -> torch.Tensor:
        """[S, d_kv] the device rows that ``resolve`` locations index."""

    def write_rows(
        self, source: int, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Stores computed rows (row index ``rows[i]`` of slot ``slots[i]``)."""

    def resolve(
        self, layer: int, source: int, batch: ForwardBatch, selection: torch.Tensor
    ) -> torch.Tensor:
        """selection: [N, k] row positions (``-1`` pads) per query token of ``batch`` ->
        [N, k] int64 locations in ``pool(source)`` in the same order (``-1`` kept).

        Contract (exact placement, eq. 12): ``pool(source)[loc[j, i]]`` equals row
        ``selection[j, i]`` of that token's request."""

    def can_ensure(self, slot: int, num_tokens: int) -> bool: ...

    def ensure(self, slot: int, num_tokens: int) -> bool:
        """Makes room for a slot's first ``num_tokens`` tokens; False changes nothing."""

    def tokens_room(self, slot: int) -> int:
        """The most tokens ``slot`` holds before ``ensure`` must take more of the mode's
        memory."""

    def release(self, slot: int) -> None: ...

    @property
    def nbytes(self) -> int: ...
