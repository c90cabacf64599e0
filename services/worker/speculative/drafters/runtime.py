"""What the engine's speculator needs of a drafter, whatever keeps its context: a draft ring
(DFlash, DSpark, DFlash2) or the KV cache itself (the MTP layer)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from services.worker.speculative.proposal import Proposal


class RuntimeDrafter(Protocol):
    kind: str

    @property
    def block_size(self) -> int:
        """K_max: target queries per round, anchor included."""

    @property
    def target_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs ``append_context`` needs (none: it needs none)."""

    @property
    def context_window(self) -> int:
        """The committed positions before a proposal's anchor that it keeps itself, from the
        target's features at them (0: its context is the KV cache's, as the MTP layer's)."""

    def init_ring(self, max_slots: int, page_size: int = 16) -> object:
        """Allocates what it keeps per request slot."""

    def begin(self, slot: int) -> None:
        """A new (or resumed) request in ``slot``: nothing of the previous one stays visible."""

    def release(self, slot: int) -> None: ...

    def append_context(
        self,
        slots: torch.Tensor | Sequence[int],
        positions: torch.Tensor,
        features: Mapping[int, torch.Tensor],
        per_slot: int | None = None,
    ) -> None:
        """Records committed positions with the target's features at them."""

    def propose(
        self,
        slots: Sequence[int],
        anchors: torch.Tensor | Sequence[int],
        num_committed: Sequence[int],
        widths: Sequence[int] | None = None,
        temperatures: float | Sequence[float] = 0.0,
        generators: Sequence[torch.Generator | None] | None = None,
        run: object = None,
    ) -> Proposal:
        """One block of proposals per request (``Drafter.propose``)."""
