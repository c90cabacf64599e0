"""Building, saving and loading drafters: drafter.json + drafter.safetensors.

The drafter's file holds its own weights only; the target's embeddings and lm_head, which it
borrows, come from the target it is loaded against (checked by name and shape)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.worker.model.decoder import SparseDecoder
from services.worker.speculative.drafters.base import Drafter
from services.worker.speculative.drafters.config import DrafterConfig
from services.worker.speculative.drafters.dflash import DFlashDrafter
from services.worker.speculative.drafters.dflash2 import DFlash2Drafter
from services.worker.speculative.drafters.dspark import DSparkDrafter

CONFIG_FILE = "drafter.json"
WEIGHTS_FILE = "drafter.safetensors"

DRAFTERS: dict[str, type[Drafter]] = {
    "dflash": DFlashDrafter,
    "dspark": DSparkDrafter,
    "dflash2": DFlash2Drafter,
}


def build_drafter(
    cfg: DrafterConfig, target: SparseDecoder, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Drafter:
    """A drafter of ``cfg.kind`` with seeded initial weights, on the target's device."""
    device = next(target.parameters()).device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DRAFTERS[cfg.kind](cfg, target)
    return drafter.to(device=device, dtype=dtype)


def save_drafter(drafter: Drafter, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    drafter.cfg.save(path / CONFIG_FILE)
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


def load_drafter(
    path: str | Path, target: SparseDecoder, dtype: torch.dtype = torch.float32
) -> Drafter:
    path = Path(path)
    cfg = DrafterConfig.load(path / CONFIG_FILE)
    if cfg.target != target.cfg.name:
        raise ValueError(f"drafter trained for {cfg.target!r}, target is {target.cfg.name!r}")
    drafter = DRAFTERS[cfg.kind](cfg, target)
    drafter.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
    return drafter.to(device=next(target.parameters()).device, dtype=dtype).eval()
