"""Index keys: one key per stored row per index producer, always resident on the device so
selection runs over the full logical history in every serving mode. Resident serving gives them
their own pools; the hierarchy modes lend them pages of the payload's page pool (``shared``)."""

from __future__ import annotations

import torch

from services.worker.kv.paged import PagedGroup, SharedPages
from services.worker.model.config import ModelConfig


class IndexKeys(PagedGroup):
    def __init__(
        self,
        cfg: ModelConfig,
        tokens_capacity: int,
        page_size: int,
        max_slots: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shared: SharedPages | None = None,
    ) -> None:
        compress = {i: cfg.sources[cfg.layers[i].source].compress for i in cfg.index_producers}
        super().__init__(
            compress, cfg.d_index, tokens_capacity, page_size, max_slots, max_model_len, dtype,
            device, shared,
        )  # fmt: skip

    def write(
        self, layer: int, slots: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor
    ) -> None:
        self.pools[layer].write(slots, rows, keys)

    def gather(
        self, layer: int, slots: torch.Tensor, num_rows: torch.Tensor, max_rows: int | None = None
    ) -> torch.Tensor:
        """[R, max(num_rows), d_index], zero beyond each slot's rows. ``max_rows``: the caller's
        host-side max(num_rows), which spares a read-back from the device."""
        return self.pools[layer].gather_padded(slots, num_rows, max_rows)
