"""Training a sparse-attention target model from scratch (``python -m training.target``).

- ``forward``: the differentiable forward over whole sequences, dense or sparse attention,
  using the inference model's own modules, and the indexer's distillation loss, for every
  topology of the family (compressed sources, local windows, shared and reused indices);
- ``corpus`` / ``data``: the packed stdlib corpus, its held-out split, crops and windows;
- ``schedule``: learning rate, attention phase and budget planning as functions of the step;
- ``trainer`` / ``loop``: the optimizer step, checkpoints, resume, evaluation and export.

Exports are lazy so that ``python -m training.target.corpus`` (or ``.plot``) runs its
module once, not also as an import of the package.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrainConfig": "config",
    "TrainOutput": "forward",
    "lm_loss": "forward",
    "train_forward": "forward",
    "train": "loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
