"""Workers that span GPUs: tensor, expert and data-parallel attention layouts over
torch.distributed (``layout``), the collectives (``comm``) and each module's shares
(``shards``)."""

from services.worker.parallel.comm import LOCAL, Comm, LocalComm, TorchComm
from services.worker.parallel.layout import (
    SINGLE,
    Cut,
    LayoutError,
    ParallelConfig,
    RankLayout,
    Span,
)
from services.worker.parallel.shards import Shards

__all__ = [
    "LOCAL",
    "SINGLE",
    "Comm",
    "Cut",
    "LayoutError",
    "LocalComm",
    "ParallelConfig",
    "RankLayout",
    "Shards",
    "Span",
    "TorchComm",
]
