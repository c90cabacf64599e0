"""Drafters: DFlash, DSpark and DFlash2 over a common interface (``Drafter``)."""

from __future__ import annotations

from services.worker.speculative.drafters.base import Drafter
from services.worker.speculative.drafters.config import KINDS, DrafterConfig, spread_layers
from services.worker.speculative.drafters.dflash import DFlashDrafter
from services.worker.speculative.drafters.dflash2 import DFlash2Drafter
from services.worker.speculative.drafters.dspark import DSparkDrafter
from services.worker.speculative.drafters.io import (
    DRAFTERS,
    build_drafter,
    load_drafter,
    save_drafter,
)

__all__ = [
    "DRAFTERS",
    "KINDS",
    "DFlash2Drafter",
    "DFlashDrafter",
    "DSparkDrafter",
    "Drafter",
    "DrafterConfig",
    "build_drafter",
    "load_drafter",
    "save_drafter",
    "spread_layers",
]
