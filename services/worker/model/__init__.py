"""The DSA model family (DESIGN §2).

Exports are lazy so that ``config`` and ``presets`` (pure Python) can be imported — by the
capacity model and the gateway — without importing torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LayerSpec": "config",
    "ModelConfig": "config",
    "SourceSpec": "config",
    "FamilyPreset": "presets",
    "PRESETS": "presets",
    "preset": "presets",
    "preset_topology": "presets",
    "DSAModel": "model",
    "LayerTrace": "model",
    "build_model": "io",
    "load_config": "io",
    "load_model": "io",
    "save_pretrained": "io",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
