"""What a model's modules need of the parallel layout: this rank's shares (``RankLayout``) and
the groups that complete them — the attention group, whose ranks hold the other heads, dense
MLP columns and vocabulary rows (the world under TP, this rank alone under DP attention), and
the experts' group (the world whenever there are several ranks); under data-parallel attention,
the exchange every MoE layer's tokens go through (``exchange``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dhisparse.family.hf_config import MLAConfig
from dhisparse.family.parallel_layout import SINGLE, ParallelConfig, RankLayout
from services.worker.parallel.comm import LOCAL, Comm
from services.worker.parallel.exchange import ExpertExchange


@dataclass(frozen=True, eq=False)
class Shards:
    layout: RankLayout
    comm: Comm = LOCAL  # the world of the worker's ranks
    # data-parallel attention: the MoE layers' token exchange (None: every rank has the tokens)
    exchange: ExpertExchange | None = field(default=None)

    @classmethod
    def single(cls, family: MLAConfig) -> Shards:
        return cls(RankLayout(SINGLE, 0, family))

    @classmethod
    def of(cls, cfg: ParallelConfig, comm: Comm, family: MLAConfig) -> Shards:
        if comm.size != cfg.world_size:
            raise ValueError(f"a group of {comm.size} ranks for a layout of {cfg.world_size}")
        layout = RankLayout(cfg, comm.rank, family)
        exchange = ExpertExchange(comm, layout) if cfg.data_parallel_attention else None
        return cls(layout, comm, exchange)

    @property
    def attention(self) -> Comm:
        return self.comm if self.layout.attention_tp > 1 else LOCAL

    @property
    def experts(self) -> Comm:
        return self.comm if self.layout.n > 1 else LOCAL
