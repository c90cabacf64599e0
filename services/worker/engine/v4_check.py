"""What the engine serves DeepSeek-V4 with: any serving mode, on the CPU or a GPU (the Triton
resolver and sparse attention, or their torch references; decode and verify passes in CUDA
graphs), rows in the serving dtype (float32 or bfloat16), without a drafter
or with its own MTP layer (``--drafter mtp``; ``model.v4_serving``); anything else it is
configured with stops start-up, named."""

from __future__ import annotations

from torch import nn

from dhisparse.family.hf_dir import is_hf_model_dir, read_config
from dhisparse.family.presets import PRESETS
from dhisparse.paths import resolve_path
from services.worker.engine.config import EngineConfig
from services.worker.model.v4_serving import V4Model
from services.worker.speculative.drafters.mtp import MTPDrafter


def serves_v4(cfg: EngineConfig, model: nn.Module | None) -> bool:
    """Whether the engine serves a V4 model: ``model``, else the directory ``cfg.model``
    names (read from its config.json, before any weight is)."""
    if model is not None:
        return isinstance(model, V4Model)
    if cfg.model in PRESETS or not is_hf_model_dir(resolve_path(cfg.model)):
        return False
    return read_config(resolve_path(cfg.model)).get("model_type") == "deepseek_v4"


def v4_refusals(cfg: EngineConfig) -> list[str]:
    """Every setting of ``cfg`` a V4 model is not served with, named as its flag (empty: all
    are served)."""
    return [
        what
        for what, asked in (
            (f"--kv-cache-dtype {cfg.kv_cache_dtype}", cfg.kv_cache_dtype not in ("auto",)),
            (
                f"--drafter {cfg.speculation.drafter} (speculative decoding other than the "
                "model's MTP layer)",
                cfg.speculation.drafter not in (None, "", MTPDrafter.kind),
            ),
        )
        if asked
    ]


def check_v4_serving(cfg: EngineConfig, model: nn.Module | None) -> None:
    """For a V4 model (``serves_v4``): raises ValueError naming every setting of ``cfg`` it is
    not served with (``v4_refusals``)."""
    if not serves_v4(cfg, model):
        return
    unsupported = v4_refusals(cfg)
    if unsupported:
        raise ValueError(
            "DeepSeek-V4 is served with rows in the serving dtype, without a drafter or with "
            "its MTP layer (--drafter mtp); "
            f"not with {', '.join(unsupported)}"
        )
