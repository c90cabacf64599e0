"""The seam between the model and where KV payload lives: the protocol every serving mode
implements, fully.

The model computes rows and selections; a ``PayloadBackend`` stores rows and turns selected
row positions into physical locations of its pool. Serving modes differ only here, which is why
their attention inputs can be bit-identical: attention reads ``pool(source)[locations]``. What
a mode does not need it implements as what it means for that mode (nothing to maintain, no
census, no residency), so no caller ever asks a payload what it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from services.kv_host_store.records import Region
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.pass_state import PassState

if TYPE_CHECKING:
    from services.worker.kv.reports import Census, ResidencyStats


class ResidencyControl(Protocol):
    """What a serving mode does between steps to move its optional history (adaptive
    residency, ``services.worker.residency``); a mode without optional history does nothing
    (``FixedResidency``)."""

    stats: ResidencyStats | None  # adaptive residency's counters; None in the other modes

    def maintain(self) -> None:
        """Between steps: copy completions, reclaim and repopulation."""

    def note_queue(self, pages: int) -> None:
        """The pool pages that fresh admissions of the requests still waiting after this
        step's admissions take: kept out of optional history."""

    def note_horizons(self, horizons: Callable[[], dict[int, int]]) -> None:
        """``horizons()``: decode steps each running slot may still take; only requests that
        run long enough to pay for the copy are refilled."""

    def settling(self) -> bool:
        """Whether memory is still on its way back (copies or drains in flight)."""

    def check(self) -> None:
        """Raises AssertionError when the mode's invariants are broken (tests)."""


class FixedResidency:
    """The residency of a mode whose rows stay where admission put them (resident, hisparse):
    nothing moves between steps, nothing is in flight, and the invariants hold by
    construction."""

    stats = None

    def maintain(self) -> None:
        pass

    def note_queue(self, pages: int) -> None:
        pass

    def note_horizons(self, horizons: Callable[[], dict[int, int]]) -> None:
        pass

    def settling(self) -> bool:
        return False

    def check(self) -> None:
        pass


class PayloadBackend(Protocol):
    mode: str
    pass_state: PassState  # the current pass, from ``begin`` to ``commit``
    residency: ResidencyControl  # what moves optional history between steps

    # ---- a forward pass ---------------------------------------------------------------------
    def begin(self, batch: ForwardBatch) -> None:
        """Plans where this pass's new rows go; called before the model writes any. A prefill
        chunk that continues its request's prefill (``batch.prefill``, start > 0) sees the
        rows of the request's earlier chunks as an unchunked prefill sees its own."""

    @property
    def prefill_room(self) -> int | None:
        """The most tokens one prefill pass may hold on the device beyond the rows' own
        places: its chunks, and the computed prefix of each request a chunk continues; None:
        no bound (rows are written where they live)."""

    def prefetch(
        self, layers: list[tuple[int, int]], batch: ForwardBatch, selection: torch.Tensor
    ) -> None:
        """May start resolving ``(layer, source)`` pairs for ``selection`` early; ``resolve``
        for those layers then returns the result."""

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

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        """After the pass: the first ``num_tokens[r]`` tokens of request r are final (eq. 7);
        their complete rows join the history (eq. 8). Rows beyond are never published."""

    def reserve_graph_workspace(self, stream: int, tokens: int, max_batch: int) -> None:
        """Before a first CUDA-graph capture on ``stream``: scratch the passes' kernels take,
        at its largest for passes of ``tokens`` query tokens over ``max_batch`` requests."""

    # ---- slots ------------------------------------------------------------------------------
    @property
    def required_pages(self) -> int:
        """Pages of the mode's pool any admitted request holds whatever its length (hot cache
        and tail in the hierarchy modes; none in resident serving)."""

    def admit(
        self,
        slot: int,
        request_id: str,
        max_tokens: int,
        session: dict[int, tuple[int, int]] | None = None,
        extra_pages: int = 0,
    ) -> bool:
        """Sets a new request up in ``slot`` for at most ``max_tokens`` tokens (with the
        durable ``session`` regions, and ``extra_pages`` more pages of the mode's pool left
        free for the caller: the index keys of the hierarchy modes); False if the mode's own
        capacity (device pages, host backup) is short."""

    def adopt(
        self,
        slot: int,
        request_id: str,
        regions: list[Region],
        committed: list[int],
        extra_pages: int = 0,
    ) -> bool:
        """Seats an adopted request whose first ``committed[s]`` rows of each source are in its
        host ``regions``; False when the device has no room. Raises where the mode keeps no
        host backups to adopt from."""

    def can_ensure(self, slot: int, num_tokens: int) -> bool: ...

    def ensure(self, slot: int, num_tokens: int) -> bool:
        """Makes room for a slot's first ``num_tokens`` tokens; False changes nothing."""

    def tokens_room(self, slot: int) -> int:
        """The most tokens ``slot`` holds before ``ensure`` must take more of the mode's
        memory."""

    def release(self, slot: int) -> None: ...

    @property
    def refusal(self) -> str | None:
        """Why the host store refused the last admission for capacity, if it did."""

    # ---- accounting -------------------------------------------------------------------------
    def memory(self, admitted: int) -> tuple[int, int, int]:
        """Bytes of the mode's pool by class of eq. 3: (required, including the mode's fixed
        allocations, optional, reserve), with ``admitted`` requests admitted."""

    def fixed_bytes(self) -> int:
        """Allocations of the mode that do not grow with sessions."""

    def layout(self) -> dict[str, int | None]:
        """The mode's geometry for admission sizing: ``hot_cache_rows`` and ``tail_rows`` (None
        in resident serving)."""

    @property
    def census(self) -> Census | None:
        """Selected rows resolved direct / hot / host so far (synchronises on a GPU); None in
        resident serving, which resolves by page table."""

    @property
    def nbytes(self) -> int: ...
