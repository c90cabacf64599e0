"""Building, initialising, saving and loading models (config.json + model.safetensors)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.worker.model.config import ModelConfig
from services.worker.model.model import DSAModel
from services.worker.model.presets import PRESETS, preset

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_weights(model: DSAModel, seed: int) -> None:
    """Seeded random init: N(0, 1/fan_in) projections and unit-variance embeddings, so that even
    untrained weights mix context strongly enough to give varied tokens (exactness tests need
    outputs that depend on which rows attention read)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        if name.endswith("compress_gate"):
            std = 0.5  # gates need spread to weigh a group's tokens unequally
        elif p.dim() == 2 and not name.startswith("embed"):
            std = 1.0 / math.sqrt(p.shape[1])
        else:
            std = 1.0
        p.data.copy_(torch.randn(p.shape, generator=g) * std)


def build_model(
    cfg: ModelConfig, seed: int = 0, device: str = "cpu", dtype: torch.dtype | None = None
) -> DSAModel:
    model = DSAModel(cfg)
    init_weights(model, seed)
    return model.to(device=device, dtype=dtype or DTYPES[cfg.dtype]).eval()


def save_pretrained(model: DSAModel, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.cfg.save(path / CONFIG_FILE)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


def load_model(
    spec: str | Path, device: str = "cpu", dtype: torch.dtype | None = None, seed: int = 0
) -> DSAModel:
    """A preset name (seeded random weights) or a directory with config.json + weights."""
    if str(spec) in PRESETS:
        return build_model(preset(str(spec)), seed=seed, device=device, dtype=dtype)
    path = Path(spec)
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(
            f"{spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a model "
            f"directory with {CONFIG_FILE}"
        )
    cfg = ModelConfig.load(path / CONFIG_FILE)
    model = DSAModel(cfg)
    state = load_file(str(path / WEIGHTS_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not match config: missing={missing} unexpected={unexpected}")
    return model.to(device=device, dtype=dtype or DTYPES[cfg.dtype]).eval()


def load_config(spec: str | Path) -> ModelConfig:
    if str(spec) in PRESETS:
        return preset(str(spec))
    return ModelConfig.load(Path(spec) / CONFIG_FILE)
