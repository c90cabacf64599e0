"""Writing an FP8 copy of a bf16/fp32 Hugging Face checkpoint, laid out as the released
DeepSeek-V3.2 FP8 checkpoint is: every 2-D ``.weight`` (attention and indexer projections, dense
and expert MLPs) becomes F8_E4M3 plus ``.weight_scale_inv``; embeddings, lm_head, norms, the
router gate, ``e_score_correction_bias`` and ``indexer.weights_proj`` keep their dtype."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dhisparse.family.quantization_config import SCALE_SUFFIX
from services.worker.ops.fp8_blockwise import SCALE_DTYPES, quantize_blockwise, scale_grid
from services.worker.weights.checkpoint import (
    FLOAT_DTYPES,
    INDEX_FILE,
    INT_DTYPES,
    WEIGHTS_FILE,
    Checkpoint,
)

CONFIG_FILE = "config.json"
STORED = FLOAT_DTYPES | INT_DTYPES  # the dtypes the writer copies, by safetensors name
# 2-D weights that stay in their dtype, as in the released checkpoint (1-D tensors always do).
KEPT = re.compile(
    r"(.*\.)?("
    r"embed_tokens\.weight|lm_head\.weight|shared_head\.head\.weight"  # vocab-sized
    r"|[\w.]*norm\.\w+"  # every norm
    r"|mlp\.gate\.weight"  # the MoE router
    r"|indexer\.weights_proj\.weight"
    r")$"
)


def quantizes(name: str, shape: tuple[int, ...], dtype: str) -> bool:
    """Whether the writer stores this tensor as FP8 by default."""
    return (
        len(shape) == 2
        and dtype in FLOAT_DTYPES
        and name.endswith(".weight")
        and not KEPT.match(name)
    )


def _plan(sizes: dict[str, int], max_bytes: int | None) -> list[list[str]]:
    """Logical names per shard, greedily in order; one too large for the limit goes alone."""
    shards: list[list[str]] = [[]]
    total = 0
    for name, n in sizes.items():
        if max_bytes is not None and shards[-1] and total + n > max_bytes:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += n
    return shards


def write_fp8_checkpoint(
    src_dir: str | Path,
    dst_dir: str | Path,
    block: tuple[int, int] = (128, 128),
    scale_dtype: str = "F32",
    max_shard_bytes: int | None = None,
    skip: Callable[[str], bool] | None = None,
) -> None:
    """Writes ``dst_dir``: ``src_dir``'s files (config.json with a ``quantization_config``
    added, tokenizer and generation config as they are) and its weights with every tensor that
    ``quantizes`` and ``skip`` does not exclude stored as block-wise FP8 (``scale_dtype`` "F32"
    or "F8_E8M0"; see ``quantize_blockwise``); other tensors are copied bit for bit.

    With ``max_shard_bytes`` the weights are split into ``model-0000i-of-0000N.safetensors``
    shards listed by ``model.safetensors.index.json`` (a weight and its scale share a shard);
    otherwise one ``model.safetensors``. Earlier weight files in ``dst_dir`` are removed. The
    writer holds one shard's tensors in memory at a time."""
    src, dst = Path(src_dir), Path(dst_dir)
    if dst.resolve() == src.resolve():
        raise ValueError(f"write_fp8_checkpoint: {dst} is the source directory")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype {scale_dtype!r} is not one of {sorted(SCALE_DTYPES)}")
    config = json.loads((src / CONFIG_FILE).read_text())
    if config.get("quantization_config") is not None:
        raise ValueError(f"{src / CONFIG_FILE}: the checkpoint is quantized already")
    ckpt = Checkpoint(src)
    fp8 = {
        name
        for name in ckpt.names()
        if quantizes(name, ckpt.shape(name), ckpt.dtype(name)) and not (skip and skip(name))
    }
    scale_bytes = SCALE_DTYPES[scale_dtype].itemsize
    sizes = {}
    for name in ckpt.names():
        shape, stored = ckpt.shape(name), ckpt.dtype(name)
        if stored not in STORED:
            raise ValueError(f"{src}: {name} is stored as {stored}, which the writer cannot copy")
        numel = torch.Size(shape).numel()
        if name in fp8:
            sizes[name] = numel + torch.Size(scale_grid(shape, block)).numel() * scale_bytes
        else:
            sizes[name] = numel * STORED[stored].itemsize
    shards = _plan(sizes, max_shard_bytes)

    dst.mkdir(parents=True, exist_ok=True)
    _remove_weights(dst)
    for item in src.iterdir():
        if item.name in (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE) or item.suffix == ".safetensors":
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, dst / item.name)

    def tensors_of(name: str) -> dict[str, torch.Tensor]:
        if name in fp8:
            w_fp8, scale = quantize_blockwise(ckpt.get(name, torch.float32), block, scale_dtype)
            return {name: w_fp8, name + SCALE_SUFFIX: scale}
        return {name: ckpt.get(name, STORED[ckpt.dtype(name)])}

    _write_shards(dst, shards, tensors_of, sum(sizes.values()))
    ckpt.close()

    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        **({"scale_fmt": "ue8m0"} if scale_dtype == "F8_E8M0" else {}),
    }
    (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_shards(
    dst: Path,
    shards: list[list[str]],
    tensors_of: Callable[[str], dict[str, torch.Tensor]],
    total_size: int,
) -> None:
    """Writes ``shards`` (logical names per file) into ``dst``: one ``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` files and their index; ``tensors_of`` gives the stored
    tensors of one logical name (a weight and its scale). One shard is in memory at a time."""
    weight_map = {}
    for i, names in enumerate(shards):
        file = (
            WEIGHTS_FILE
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for name in names:
            tensors.update(tensors_of(name))
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _remove_weights(dst: Path) -> None:
    for old in [dst / WEIGHTS_FILE, dst / INDEX_FILE, *dst.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)


def reshard_checkpoint(model_dir: str | Path, max_shard_bytes: int) -> list[str]:
    """Rewrites ``model_dir``'s weights, as they are stored (FP8 with scales or not), into
    shards of at most ``max_shard_bytes`` (a weight and its scale share a shard); returns the
    weight files written. The tensors are copied bit for bit."""
    model_dir = Path(model_dir)
    files = sorted({*model_dir.glob("model*.safetensors")})
    stored: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118
                stored[key] = handle.get_tensor(key)
    logical = [k for k in stored if not k.endswith(SCALE_SUFFIX)]

    def tensors_of(name: str) -> dict[str, torch.Tensor]:
        scale = name + SCALE_SUFFIX
        return {name: stored[name], **({scale: stored[scale]} if scale in stored else {})}

    sizes = {n: sum(t.numel() * t.element_size() for t in tensors_of(n).values()) for n in logical}
    shards = _plan(sizes, max_shard_bytes)
    _remove_weights(model_dir)
    _write_shards(model_dir, shards, tensors_of, sum(sizes.values()))
    return sorted(p.name for p in model_dir.glob("model*.safetensors"))
