"""Loading a DeepSeek-V3.2 / GLM-5 model directory in the Hugging Face format: config.json
(parsed by ``hf_config``), safetensors weights (single or sharded, bf16 or FP8 with block
scales: ``checkpoint``), copied tensor by tensor into a model built without initialising it."""

from __future__ import annotations

from pathlib import Path

import torch

from services.worker.model.checkpoint import Checkpoint
from services.worker.model.hf_config import ConfigError, parse_config, topology
from services.worker.model.hf_dir import hf_family, is_hf_model_dir, model_name, read_config
from services.worker.model.loader import load_into
from services.worker.model.mla_decoder import MLADecoder, checkpoint_targets, ignored_patterns

__all__ = ["hf_family", "is_hf_model_dir", "load_hf_model", "read_config"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> MLADecoder:
    """The model of a directory, in ``dtype`` (default: config.json's) on ``device``. Raises
    ConfigError / CheckpointError (both ValueError) naming what is unsupported or missing."""
    raw = read_config(path)
    cfg = parse_config(raw)
    if dtype is None:
        if cfg.dtype not in _DTYPES:
            raise ConfigError(f"config.json: dtype {cfg.dtype!r} is not one of {sorted(_DTYPES)}")
        dtype = _DTYPES[cfg.dtype]
    with torch.device("meta"):
        model = MLADecoder(cfg, topology(cfg, model_name(path, raw)))
    model.to_empty(device=device)
    model.cast(dtype)
    ckpt = Checkpoint(path, raw.get("quantization_config"))
    load_into(ckpt, checkpoint_targets(model, ckpt.names()), ignore=dict(ignored_patterns(cfg)))
    return model.eval()
