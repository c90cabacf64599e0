"""One forward pass as the payload holds it between ``begin`` and ``commit``.

Everything a serving mode decides for a pass lives here, in one place: the batch, where each
source's new rows go (the hierarchy's plans, and the device rows those plans are views of) and
which rows the pass wrote. The CUDA-graph runner keys a pass by ``graph_key``, copies a live
pass's ``plan_rows`` into its graph's own before a replay, and hands back the rows the replay
wrote (``written``) for the commit; it touches nothing else of a payload."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from services.worker.kv.pass_rows import CompletedRows, key_rows, plan_completions, visible_width

if TYPE_CHECKING:
    from services.worker.kv.batch import ForwardBatch


class PassPlan(Protocol):
    """What a pass state reads of a mode's plan of where a source's new rows go (the
    hierarchy's ``ChunkPlan``)."""

    @property
    def all_direct(self) -> bool:
        """Every selected row resolves directly: no hot-cache scan, no host reads."""
        ...


# per source: (slots [n], rows [n], store locations [n]) a pass wrote
Written = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class PassState:
    """The current pass: ``batch``; per source its ``plans`` (empty in resident serving, whose
    rows are written where they live); ``plan_rows`` [U, 5, R], the device rows of the U
    distinct plans; ``plan_index``, which of the U each source uses; ``written``, the rows
    this pass wrote, backed up at commit; ``completed``, per compression rate, the rows the
    pass's chunks complete (``pass_rows``), views of ``completion_rows``, which a CUDA graph's
    copy is refilled from like ``plan_rows``. ``sources``: the model's sources as
    (compression rate, lag), which the completions and the graph key's widths follow."""

    batch: ForwardBatch | None = None
    plans: list[PassPlan] = field(default_factory=list)
    plan_rows: torch.Tensor | None = None
    plan_index: tuple[int, ...] = ()
    written: Written = field(default_factory=dict)
    # [max_slots] each slot's index in ``batch``, filled when first read in a pass (a decode
    # pass never reads it); None: the mode never asks
    slot_index: torch.Tensor | None = None
    slot_index_fresh: bool = False
    sources: tuple[tuple[int, int], ...] = ()
    completed: dict[int, CompletedRows] = field(default_factory=dict)
    completion_rows: torch.Tensor | None = None

    def begin(
        self,
        batch: ForwardBatch,
        plans: list[PassPlan],
        plan_rows: torch.Tensor | None,
        plan_index: tuple[int, ...],
    ) -> None:
        """A new pass over ``batch`` with the given plans; nothing written yet."""
        self.batch, self.plans, self.plan_rows, self.plan_index = (
            batch,
            plans,
            plan_rows,
            plan_index,
        )
        self.written.clear()
        self.slot_index_fresh = False
        writes = range(len(self.sources)) if batch.sources is None else batch.sources
        rates = sorted({self.sources[s][0] for s in writes if self.sources[s][0] > 1})
        self.completed, self.completion_rows = plan_completions(
            batch.starts, batch.lens, tuple(rates), batch.positions.device, pad=not batch.prefill
        )

    def req_of_slot(self) -> torch.Tensor:
        """[max_slots] each slot's index in the current batch (other slots: stale)."""
        assert self.batch is not None and self.slot_index is not None, "begin() the pass first"
        if not self.slot_index_fresh:
            b = self.batch
            self.slot_index[b.slots] = torch.arange(b.num_requests, device=self.slot_index.device)
            self.slot_index_fresh = True
        return self.slot_index

    def completed_rows(self, rate: int) -> CompletedRows | None:
        """The rows of ``rate`` the pass's chunks complete (None: none)."""
        return self.completed.get(rate)

    def graph_key(self) -> tuple:
        """What of the pass a captured graph bakes in: which sources share a plan, which plans
        resolve every row directly (no hot-cache scan, no host reads), how many completed rows
        of each rate it writes, and the widths its sources' rows are gathered at."""
        assert self.batch is not None, "begin() the pass first"
        end = max(self.batch.ends())
        widths = {
            (key_rows(max(0, end - lag) // m), visible_width(end // m) if m > 1 else 0)
            for m, lag in self.sources
        }
        return (
            self.plan_index, tuple(p.all_direct for p in self.plans),
            tuple((m, len(c.rows)) for m, c in self.completed.items()), tuple(sorted(widths)),
        )  # fmt: skip
