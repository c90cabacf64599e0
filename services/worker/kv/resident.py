"""Resident serving: every KV row of every request stays in device page pools (the baseline
the hierarchy modes are compared against)."""

from __future__ import annotations

import torch

from services.worker.kv.batch import ForwardBatch
from services.worker.kv.paged import PagedRows
from services.worker.model.config import ModelConfig


class ResidentPayload:
    mode = "resident"

    def __init__(
        self,
        cfg: ModelConfig,
        tokens_capacity: int,
        page_size: int,
        max_slots: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.cfg = cfg
        self.pools: list[PagedRows] = []
        for src in cfg.sources:
            pages = -(-tokens_capacity // src.compress // page_size) + max_slots
            self.pools.append(
                PagedRows(
                    pages,
                    page_size,
                    cfg.d_kv,
                    max_slots,
                    max_model_len // src.compress,
                    dtype,
                    device,
                )
            )

    def pool(self, source: int) -> torch.Tensor:
        return self.pools[source].data

    def prefetch(
        self, layers: list[tuple[int, int]], batch: ForwardBatch, selection: torch.Tensor
    ) -> None:
        pass  # resolution is a page-table lookup

    def begin(self, batch: ForwardBatch) -> None:
        pass  # rows are written where they live

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        pass  # nothing to back up

    def admit(self, slot: int, request_id: str, max_tokens: int) -> bool:
        return True  # pages grow with ensure()

    def memory_bytes(self, admitted: int) -> tuple[int, int]:
        return sum(p.used_bytes for p in self.pools), 0

    def write_rows(
        self, source: int, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        self.pools[source].write(slots, rows, values)

    def resolve(
        self, layer: int, source: int, batch: ForwardBatch, selection: torch.Tensor
    ) -> torch.Tensor:
        slots = batch.token_slot.unsqueeze(1).expand_as(selection)
        return self.pools[source].locations(slots, selection)

    def _rows(self, source: int, num_tokens: int) -> int:
        return self.cfg.rows_for_tokens(source, num_tokens)

    def can_ensure(self, slot: int, num_tokens: int) -> bool:
        return all(
            p.pages_needed(slot, self._rows(s, num_tokens)) <= p.num_free_pages
            for s, p in enumerate(self.pools)
        )

    def ensure(self, slot: int, num_tokens: int) -> bool:
        if not self.can_ensure(slot, num_tokens):
            return False
        for s, p in enumerate(self.pools):
            ok = p.ensure(slot, self._rows(s, num_tokens))
            assert ok
        return True

    def release(self, slot: int) -> None:
        for p in self.pools:
            p.release(slot)

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() * p.data.element_size() for p in self.pools)
