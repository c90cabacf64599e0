"""Loading a DeepSeek-V3.2 / GLM-5 model directory in the Hugging Face format: config.json
(parsed by ``hf_config``), safetensors weights (single or sharded, bf16 or FP8 with block
scales: ``checkpoint``), copied tensor by tensor into a model built without initialising it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from services.worker.model.checkpoint import Checkpoint
from services.worker.model.config import ModelConfig
from services.worker.model.hf_config import ConfigError, MLAConfig, parse_config, topology
from services.worker.model.loader import load_into
from services.worker.model.mla_decoder import MLADecoder, checkpoint_targets, ignored_patterns

CONFIG_FILE = "config.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / CONFIG_FILE).read_text())


def is_hf_model_dir(path: str | Path) -> bool:
    """A directory whose config.json names a ``model_type`` (the home-made format has none)."""
    p = Path(path) / CONFIG_FILE
    return p.exists() and "model_type" in json.loads(p.read_text())


def model_name(path: str | Path, raw: dict[str, Any]) -> str:
    return str(raw.get("_name_or_path") or Path(path).resolve().name)


def hf_family(path: str | Path) -> tuple[MLAConfig, ModelConfig]:
    """(the model's math, the engine's topology) of a model directory."""
    raw = read_config(path)
    cfg = parse_config(raw)
    return cfg, topology(cfg, model_name(path, raw))


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
