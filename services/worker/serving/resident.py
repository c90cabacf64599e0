"""Resident serving: every stored KV row of every request stays in device page pools (the
baseline the hierarchy modes are compared against)."""

from __future__ import annotations

import torch

from dhisparse.family.config import ModelConfig
from services.kv_host_store.records import Region
from services.worker.kv.backend import FixedResidency
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.paged import PagedGroup
from services.worker.kv.pass_rows import source_rates
from services.worker.kv.pass_state import PassState
from services.worker.kv.row_codec import RowCodec


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
        codec: RowCodec | None = None,
    ) -> None:
        """``codec``: how rows are stored (default: as computed, in ``dtype``)."""
        self.codec = RowCodec(cfg.d_kv, dtype) if codec is None else codec
        compress = {s: cfg.sources[s].compress for s in cfg.stored_sources}
        super().__init__(
            compress, self.codec.stored_width, tokens_capacity, page_size, max_slots,
            max_model_len, self.codec.storage, device,
        )  # fmt: skip
        self.pass_state = PassState(sources=source_rates(cfg))  # rows written where they live
        self.residency = FixedResidency()  # every row stays where it was written

    # ---- a forward pass ---------------------------------------------------------------------
    def begin(self, batch: ForwardBatch) -> None:
        self.pass_state.begin(batch, [], None, ())

    @property
    def prefill_room(self) -> None:
        return None  # every row is written to its page: a chunk reads its prefix there

    def prefetch(
        self, layers: list[tuple[int, int]], batch: ForwardBatch, selection: torch.Tensor
    ) -> None:
        pass  # resolution is a page-table lookup

    def pool(self, source: int) -> torch.Tensor:
        return self.pools[source].data

    def write_rows(
        self, source: int, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        pool = self.pools[source]
        if self.codec.fp8 is None:
            pool.write(slots, rows, values)
        else:
            self.codec.store(pool.data, pool.locations(slots, rows), values)

    def resolve(
        self, layer: int, source: int, batch: ForwardBatch, selection: torch.Tensor
    ) -> torch.Tensor:
        return self.pools[source].locations(batch.token_slot, selection)

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        pass  # nothing to back up

    def reserve_graph_workspace(self, stream: int, tokens: int, max_batch: int) -> None:
        pass  # page-table lookups take no workspace

    # ---- slots ------------------------------------------------------------------------------
    @property
    def required_pages(self) -> int:
        return 0  # pages grow with ensure()

    def admit(
        self,
        slot: int,
        request_id: str,
        max_tokens: int,
        session: dict[int, tuple[int, int]] | None = None,
        extra_pages: int = 0,
    ) -> bool:
        return True  # pages grow with ensure()

    def adopt(
        self,
        slot: int,
        request_id: str,
        regions: list[Region],
        committed: list[int],
        extra_pages: int = 0,
    ) -> bool:
        raise RuntimeError("resident serving keeps no host backups to adopt a session from")

    @property
    def refusal(self) -> str | None:
        return None  # no host store to refuse

    # ---- accounting -------------------------------------------------------------------------
    def memory(self, admitted: int) -> tuple[int, int, int]:
        return self.used_bytes, self.cached_bytes, 0  # cached prefixes: reclaimable

    def fixed_bytes(self) -> int:
        return 0

    def layout(self) -> dict[str, int | None]:
        return {"hot_cache_rows": None, "tail_rows": None}

    @property
    def census(self) -> None:
        return None
