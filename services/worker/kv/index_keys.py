"""Index keys: one key per stored row per index producer, always resident on the device so
selection runs over the full logical history in every serving mode."""

from __future__ import annotations

import torch

from services.worker.kv.paged import PagedRows
from services.worker.model.config import ModelConfig


class IndexKeys:
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
        self.pools: dict[int, PagedRows] = {}
        for layer in cfg.index_producers:
            m = cfg.sources[cfg.layers[layer].source].compress
            max_rows = max_model_len // m
            pages = -(-tokens_capacity // m // page_size) + max_slots
            self.pools[layer] = PagedRows(
                pages, page_size, cfg.d_index, max_slots, max_rows, dtype, device
            )

    def rows_for(self, layer: int, num_tokens: int) -> int:
        return self.cfg.rows_for_tokens(self.cfg.layers[layer].source, num_tokens)

    def can_ensure(self, slot: int, num_tokens: int) -> bool:
        return all(
            p.pages_needed(slot, self.rows_for(layer, num_tokens)) <= p.num_free_pages
            for layer, p in self.pools.items()
        )

    def ensure(self, slot: int, num_tokens: int) -> bool:
        if not self.can_ensure(slot, num_tokens):
            return False
        for layer, p in self.pools.items():
            ok = p.ensure(slot, self.rows_for(layer, num_tokens))
            assert ok
        return True

    def release(self, slot: int) -> None:
        for p in self.pools.values():
            p.release(slot)

    def write(
        self, layer: int, slots: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor
    ) -> None:
        self.pools[layer].write(slots, rows, keys)

    def gather(self, layer: int, slots: torch.Tensor, num_rows: torch.Tensor) -> torch.Tensor:
        """[R, max(num_rows), d_index], zero beyond each slot's rows."""
        return self.pools[layer].gather_padded(slots, num_rows)

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() * p.data.element_size() for p in self.pools.values())
