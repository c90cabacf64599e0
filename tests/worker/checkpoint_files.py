"""Small safetensors checkpoints written by hand, one file or shards with an index."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dhisparse.family.released_fp8 import RELEASED_FP8
from services.worker.ops.fp8_blockwise import FP8_MAX, quantize_blockwise

FP8_QUANT = RELEASED_FP8


def fp8_bound(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per element, the most that e4m3 rounding moves ``w [R, C]``: half an ulp, which is at
    most 2**-4 of the value in e4m3's normal range and 2**-10 of the block's scale below it
    (subnormals are spaced 2**-9), with slack for the float32 divide and multiply."""
    (rows, cols), (bm, bn) = w.shape, block
    s = scale.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    assert (w.abs() <= FP8_MAX * s * (1 + 1e-6)).all()
    return torch.maximum(w.abs() * 2**-4, s * 2**-10) * (1 + 1e-5)


def quantized(
    tensors: dict[str, torch.Tensor], block=(128, 128), scale_dtype="F32", fp8=None
) -> dict[str, torch.Tensor]:
    """``tensors`` with the 2-D ones (or those named in ``fp8``) as FP8 plus scales."""
    out = {}
    for name, t in tensors.items():
        if (t.dim() == 2) if fp8 is None else name in fp8:
            out[name], out[name + "_scale_inv"] = quantize_blockwise(t, block, scale_dtype)
        else:
            out[name] = t
    return out


def write(
    path: Path,
    tensors: dict[str, torch.Tensor],
    shards: int = 1,
    config: dict | None = None,
) -> Path:
    """Writes ``tensors`` into ``path`` as one model.safetensors or ``shards`` shards (dealt out
    round-robin, a weight with its scale) with an index, and config.json when given."""
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    logical = [n for n in tensors if not n.endswith("_scale_inv")]
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for name in logical[i::shards]:
            part[name] = tensors[name]
            if name + "_scale_inv" in tensors:
                part[name + "_scale_inv"] = tensors[name + "_scale_inv"]
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return path
