"""Resident serving: every KV row of every request stays in device page pools (the baseline
the hierarchy modes are compared against)."""

from __future__ import annotations

import torch

from services.worker.kv.batch import ForwardBatch
from services.worker.kv.paged import PagedGroup
from services.worker.model.config import ModelConfig


class ResidentPayload(PagedGroup):
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
        compress = {s: src.compress for s, src in enumerate(cfg.sources)}
        super().__init__(
            compress, cfg.d_kv, tokens_capacity, page_size, max_slots, max_model_len, dtype,
            device,
        )  # fmt: skip

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

    def admit(
        self,
        slot: int,
        request_id: str,
        max_tokens: int,
        session: dict | None = None,
        extra_pages: int = 0,
    ) -> bool:
        return True  # pages grow with ensure()

    def memory_bytes(self, admitted: int) -> tuple[int, int]:
        return self.used_bytes, 0

    def write_rows(
        self, source: int, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        self.pools[source].write(slots, rows, values)

    def resolve(
        self, layer: int, source: int, batch: ForwardBatch, selection: torch.Tensor
    ) -> torch.Tensor:
        slots = batch.token_slot.unsqueeze(1).expand_as(selection)
        return self.pools[source].locations(slots, selection)
