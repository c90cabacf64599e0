"""Index keys: one key per stored row per index producer that writes keys of its own
(``ModelConfig.key_producers``: a producer may score another's), always resident on the device so
selection runs over the full logical history in every serving mode. Resident serving gives them
their own pools; the hierarchy modes lend them pages of the payload's page pool (``shared``)."""

from __future__ import annotations

import torch

from dhisparse.family.config import ModelConfig
from services.worker.kv.paged import PagedGroup, SharedPages
from services.worker.kv.row_codec import RowCodec
from services.worker.ops.fusion import fused
from services.worker.ops.index_scores_paged import index_scores_paged
from services.worker.ops.indexer import index_scores


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
        codec: RowCodec | None = None,
    ) -> None:
        self.codec = RowCodec(cfg.d_index, dtype) if codec is None else codec
        compress = {i: cfg.sources[cfg.layers[i].source].compress for i in cfg.key_producers}
        width = self.codec.stored_width
        if shared is not None and self.codec.fp8 is not None:
            if shared.memory.dtype != self.codec.storage:
                raise ValueError("fp8 index keys borrow pages of fp8 rows only")
            width = shared.fit(width)  # 132 B keys in pages of 656 B rows: padded to 164
        super().__init__(
            compress, width, tokens_capacity, page_size, max_slots, max_model_len,
            self.codec.storage, device, shared,
        )  # fmt: skip

    def stored(self, layer: int) -> torch.Tensor:
        """[S, stored_width] the stored keys of producer ``layer`` (without a row's padding)."""
        return self.pools[layer].data[:, : self.codec.stored_width]

    def write(
        self, layer: int, slots: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor
    ) -> None:
        """keys [N, d_index] in the serving dtype, stored (quantized in fp8) at row ``rows[i]``
        of slot ``slots[i]``."""
        pool = self.pools[layer]
        if self.codec.fp8 is None:
            pool.write(slots, rows, keys)
        else:
            self.codec.store(self.stored(layer), pool.locations(slots, rows), keys)

    def gather(
        self, layer: int, slots: torch.Tensor, num_rows: torch.Tensor, max_rows: int | None = None
    ) -> torch.Tensor:
        """[R, max(num_rows), d_index], zero beyond each slot's rows. ``max_rows``: the caller's
        host-side max(num_rows), which spares a read-back from the device. In the serving
        dtype (fp8 keys dequantized, as DeepSeek's reference scores from FP8 keys)."""
        pool = self.pools[layer]
        if self.codec.fp8 is None:
            return pool.gather_padded(slots, num_rows, max_rows)
        locs = pool.padded_locations(slots, num_rows, max_rows)
        return self.codec.gather(self.stored(layer), locs)

    def decode_scores(
        self,
        layer: int,
        q: torch.Tensor,
        w: torch.Tensor,
        slots: torch.Tensor,
        num_rows: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        """Producer ``layer``'s index scores of one query token per slot over the slot's rows
        ``0 .. num_rows[i] - 1``: q [R, H, d_index], w [R, H] fp32 -> [R, width] fp32, 0 beyond
        (``index_scores`` of ``gather(layer, slots, num_rows, width)``). Fused, one kernel
        reads the keys where they are stored."""
        if not fused(q, "index_scores"):
            return index_scores(q, w, self.gather(layer, slots, num_rows, width))
        pool = self.pools[layer]
        return index_scores_paged(
            q, w, self.stored(layer), pool.page_table, pool.page_size, slots, num_rows, width,
            self.codec.fp8,
        )  # fmt: skip
