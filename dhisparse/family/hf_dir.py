"""A DeepSeek-V3.2 / GLM-5 model directory in the Hugging Face format, as far as its
``config.json`` says: whether a directory is one, its name, and its math and topology (parsed
by ``hf_config``). Pure Python: sizing a model (``dhisparse plan``) imports no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dhisparse.family.config import ModelConfig
from dhisparse.family.hf_config import MLAConfig, parse_config, topology

CONFIG_FILE = "config.json"


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / CONFIG_FILE).read_text())


def is_hf_model_dir(path: str | Path) -> bool:
    """A directory whose config.json names a ``model_type`` (the home-made format has none)."""
    p = Path(path) / CONFIG_FILE
    return p.exists() and "model_type" in json.loads(p.read_text())


def model_name(path: str | Path, raw: dict[str, Any]) -> str:
    return str(raw.get("_name_or_path") or Path(path).resolve().name)


def hf_family(path: str | Path, mtp: bool = False) -> tuple[MLAConfig, ModelConfig]:
    """(the model's math, the engine's topology) of a model directory; ``mtp``: the topology
    served with its MTP layer (``--drafter mtp``)."""
    raw = read_config(path)
    cfg = parse_config(raw)
    return cfg, topology(cfg, model_name(path, raw), mtp=mtp)
