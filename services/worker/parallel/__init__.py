"""Workers that span GPUs: tensor, expert and data-parallel attention layouts over
torch.distributed (``layout``), the collectives (``comm``) and each module's shares
(``shards``).

Exports are lazy so that ``layout`` (pure Python: the layouts and their one table of cuts) can
be imported — by the capacity model, which sizes every layout — without importing torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LOCAL": "comm",
    "Comm": "comm",
    "LocalComm": "comm",
    "TorchComm": "comm",
    "SINGLE": "layout",
    "Cut": "layout",
    "LayoutError": "layout",
    "ParallelConfig": "layout",
    "RankLayout": "layout",
    "Span": "layout",
    "Shards": "shards",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
