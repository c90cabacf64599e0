"""Loading a DeepSeek-V3.2 / GLM-5 model directory in the Hugging Face format: config.json
(parsed by ``hf_config``), safetensors weights (single or sharded, bf16 or FP8 with block
scales: ``checkpoint``), copied tensor by tensor into a model built without initialising it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from dhisparse.family.hf_config import ConfigError, MLAConfig, parse_config, topology
from dhisparse.family.hf_dir import hf_family, is_hf_model_dir, model_name, read_config
from dhisparse.family.parallel_layout import SINGLE, ParallelConfig
from dhisparse.family.quantization_config import fp8_as_stored
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.weight_format import resolve
from services.worker.ops.fp8_linear import Mode
from services.worker.parallel.comm import LOCAL, Comm
from services.worker.parallel.shards import Shards
from services.worker.weights.checkpoint import Checkpoint
from services.worker.weights.loader import load_into
from services.worker.weights.mla_names import (
    checkpoint_targets,
    hold_stored_dense,
    ignored_patterns,
)

__all__ = [
    "first_layers",
    "hf_family",
    "is_hf_model_dir",
    "later_layers",
    "load_hf_model",
    "read_config",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def first_layers(cfg: MLAConfig, n: int) -> MLAConfig:
    """The model made of ``cfg``'s first ``n`` layers (no MTP layer): what ``load_hf_model``
    builds for ``layers=n``."""
    if not 1 <= n <= cfg.num_layers:
        raise ConfigError(f"{n} layers asked of a model with {cfg.num_layers}")
    return replace(
        cfg,
        num_layers=n,
        indexer_types=cfg.indexer_types[:n],
        mlp_types=cfg.mlp_types[:n],
        mtp_layers=0,
    )


def later_layers(cfg: MLAConfig, n: int) -> dict[str, str]:
    """{regex: why} of the checkpoint tensors of the layers past the first ``n`` (the main
    layers after them and the MTP layers), which a model of the first ``n`` does not read."""
    later = range(n, cfg.num_layers + cfg.mtp_layers)
    if not later:
        return {}
    return {rf"model\.layers\.({'|'.join(map(str, later))})\.": f"layers past the first {n}"}


def mtp_head_name(cfg: MLAConfig) -> str:
    """The checkpoint name of the MTP layer's head (released checkpoints store a copy of
    ``lm_head`` there; a checkpoint without it shares the target's)."""
    return f"model.layers.{cfg.num_layers}.shared_head.head.weight"


def load_hf_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    layers: int | None = None,
    mtp: bool = False,
    weight_dtype: str = "auto",
    fp8_mode: Mode = "w8a16",
    parallel: ParallelConfig = SINGLE,
    comm: Comm = LOCAL,
) -> MLADecoder:
    """The model of a directory, in ``dtype`` (default: config.json's) on ``device``, its
    projections and experts in FP8 or not as ``weight_dtype`` says (``weight_format.resolve``:
    "auto" keeps an FP8 checkpoint in FP8, ``fp8_mode`` its activation mode); with
    ``layers``, its first ``layers`` layers only (final norm and lm_head kept; the tensors of
    the other layers are not read); with ``mtp``, its MTP layer too (the MTP drafter's, served
    as a draft layer of the topology: docs/mtp.md); with ``parallel`` over ``comm`` (a group of
    ranks), this rank's part, reading only its slices of the checkpoint. Raises ConfigError /
    CheckpointError / LayoutError (all ValueError) naming what is unsupported or missing."""
    raw = read_config(path)
    cfg = parse_config(raw)
    ignore: dict[str, str] = {}
    if layers is not None and mtp:
        raise ConfigError("a model of its first layers has no MTP layer")
    if layers is not None:
        ignore = later_layers(cfg, layers)
        cfg = first_layers(cfg, layers)
    if dtype is None:
        if cfg.dtype not in _DTYPES:
            raise ConfigError(f"config.json: dtype {cfg.dtype!r} is not one of {sorted(_DTYPES)}")
        dtype = _DTYPES[cfg.dtype]
    quantization = raw.get("quantization_config")
    fmt = resolve(weight_dtype, fp8_as_stored(quantization), fp8_mode)
    if fmt.fp4_experts:
        raise ConfigError(
            f"{path}: --weight-dtype fp4 holds DeepSeek-V4's FP4 routed experts; this "
            f"{raw.get('model_type')!r} checkpoint has FP8 or dense experts"
        )
    shards = Shards.of(parallel, comm, cfg)
    with torch.device("meta"):
        model = MLADecoder(cfg, topology(cfg, model_name(path, raw), mtp=mtp), fmt, shards)
    ckpt = Checkpoint(path, quantization)
    if fmt.fp8 and weight_dtype == "auto":
        hold_stored_dense(model, ckpt.names(), ckpt.is_fp8)
    model.to_empty(device=device)
    model.cast(dtype)
    if mtp and mtp_head_name(cfg) not in ckpt.names():
        model.tie_mtp_head()
    ignore |= dict(ignored_patterns(cfg, mtp, shards.layout))
    load_into(ckpt, checkpoint_targets(model, ckpt.names()), ignore=ignore)
    model.share_lm_head()
    return model.eval()
