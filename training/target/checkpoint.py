"""The resumable training state in one file, ``DIR/ckpt.pt``: model, optimizer, schedule,
step, RNG states, history and elapsed time. Written to a temporary file and renamed, so an
interrupted write leaves the previous checkpoint intact."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CKPT_FILE = "ckpt.pt"
HISTORY_FILE = "history.jsonl"  # beside it: one JSON record per logged step and evaluation
MODEL_DIR = "model"  # beside it: the exported weights of a finished run


def rng_state(data_gen: torch.Generator) -> dict[str, Any]:
    state: dict[str, Any] = {"data": data_gen.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], data_gen: torch.Generator) -> None:
    data_gen.set_state(state["data"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """On the CPU: RNG states must stay there; model and optimizer state are copied to their
    parameters' device when loaded."""
    return torch.load(Path(path), map_location="cpu", weights_only=False)
