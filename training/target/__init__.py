"""Training a sparse-attention target model from scratch (``python -m training.target``).

- ``forward``: the differentiable forward over whole sequences, dense or sparse attention,
  using the inference model's own modules, and the indexer's distillation loss, for every
  topology of the home-made family (compressed sources, local windows, shared and reused
  indices); ``mla_forward`` (with ``mla_indexer``, ``mla_moe``): the same for DeepSeek-V3.2 /
  GLM-5, with the MTP layer and the MoE's expert balancing;
- ``family``: what the loop needs of a family (build, losses, after-step, export);
- ``corpus`` / ``data``: the packed stdlib byte corpus or a BPE token directory
  (``training.corpus``), the held-out split, crops and windows;
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
    "MLATrainOutput": "mla_forward",
    "mla_train_forward": "mla_forward",
    "family_of": "family",
    "lm_loss": "forward",
    "train_forward": "forward",
    "train": "loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
