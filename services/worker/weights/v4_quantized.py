"""DeepSeek-V4's quantized weights (``WeightFormat.fp8``), one dense matrix at a time.

A quantized module holds matrices a checkpoint names one by one: an ``FP8Linear`` or an FP8
``GroupedLinear`` its ``X.weight``, an ``FP8Experts`` / ``FP4Experts`` stack each expert's
``experts.E.w1`` / ``w3`` / ``w2``. ``slots`` maps each such dense name to a ``Slot``, views of
the module's bytes and scale rows for that matrix, and ``fill`` writes a slot from what a
checkpoint stores or an initialiser draws:

| stored | FP8 slot (128x128 blocks, fp32 scales) | FP4 slot (e2m1, per-32 power-of-two scales) |
|---|---|---|
| FP8, 128x128 blocks | as stored | dequantized, then ``quantize_fp4`` |
| FP8, other blocks | dequantized, then ``quantize_blockwise`` | dequantized, then ``quantize_fp4`` |
| FP4 | ``fp4_to_fp8_blocks`` (exact where a block's scales span <= 14 binades) | as stored |
| dense | ``quantize_blockwise`` | ``quantize_fp4`` |"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from services.worker.model.fp4_experts import FP4Experts
from services.worker.model.fp8_experts import FP8Experts
from services.worker.model.fp8_linear_layer import FP8Linear
from services.worker.model.grouped_linear import GroupedLinear
from services.worker.ops.fp4_e2m1 import dequantize_fp4, fp4_scale_grid, ue8m0_exponents
from services.worker.ops.fp4_quantize import quantize_fp4
from services.worker.ops.fp4_to_fp8 import fp4_to_fp8_blocks
from services.worker.ops.fp8_blockwise import (
    FP8_DTYPE,
    dequantize_blockwise,
    quantize_blockwise,
    scale_grid,
    scale_to_float,
)
from services.worker.ops.fp8_linear import BLOCK


class Slot(NamedTuple):
    """One dense matrix ``[R, C]`` of a quantized module: ``weight`` its bytes (e4m3 ``[R, C]``,
    or packed e2m1 ``[R, C / 2]`` when ``fp4``) and ``scale`` its scale rows (the 128x128 grid
    in fp32, or ``[R, C / 32]`` UE8M0 exponents in uint8), views into the module's buffers."""

    shape: tuple[int, int]
    weight: torch.Tensor
    scale: torch.Tensor
    fp4: bool


class Stored(NamedTuple):
    """A matrix as a checkpoint stores it: ``kind`` "dense" (``weight`` in any float dtype,
    ``scale`` None), "fp8" (e4m3 with its ``block`` grid of scales) or "fp4" (packed e2m1 with
    per-32 scales)."""

    kind: str
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None


def _expert_slots(prefix: str, m: FP8Experts | FP4Experts) -> dict[str, Slot]:
    fp4 = isinstance(m, FP4Experts)
    gate_up, down = m.gate_up_proj, m.down_proj
    if fp4:
        gu_scale, down_scale = m.gate_up_proj_scale, m.down_proj_scale
    else:
        gu_scale, down_scale = m.gate_up_proj_scale_inv, m.down_proj_scale_inv
    i, d = m.intermediate, m.d_model
    split = i if fp4 else -(-i // BLOCK)  # the up half's first scale row
    out = {}
    for e in range(m.n):
        at = f"{prefix}.{e}"
        out[f"{at}.w1.weight"] = Slot((i, d), gate_up[e, :i], gu_scale[e, :split], fp4)
        out[f"{at}.w3.weight"] = Slot((i, d), gate_up[e, i:], gu_scale[e, split:], fp4)
        out[f"{at}.w2.weight"] = Slot((d, i), down[e], down_scale[e], fp4)
    return out


def slots(net: nn.Module) -> tuple[dict[str, Slot], tuple[str, ...]]:
    """(dense name -> slot for every matrix a quantized module of ``net`` holds, the name
    prefixes of those modules' own tensors)."""
    out: dict[str, Slot] = {}
    owners: list[str] = []
    for prefix, m in net.named_modules():
        if isinstance(m, FP8Linear) or (isinstance(m, GroupedLinear) and m.fp8):
            shape = (m.weight.shape[0], m.weight.shape[1])
            out[f"{prefix}.weight"] = Slot(shape, m.weight, m.weight_scale_inv, False)
        elif isinstance(m, FP8Experts | FP4Experts):
            out |= _expert_slots(prefix, m)
        else:
            continue
        owners.append(prefix + ".")
    return out, tuple(owners)


def dense(stored: Stored) -> torch.Tensor:
    """``stored`` as float32 ``[R, C]`` (a quantized matrix dequantized)."""
    if stored.kind == "dense":
        return stored.weight.float()
    assert stored.scale is not None
    if stored.kind == "fp4":
        return dequantize_fp4(stored.weight, stored.scale)
    assert stored.block is not None
    return dequantize_blockwise(stored.weight, stored.scale, stored.block)


def _check_grid(scale: torch.Tensor, grid: tuple[int, int]) -> None:
    if tuple(scale.shape) != grid:
        raise ValueError(f"scale grid {tuple(scale.shape)}, the weight's is {grid}")


def fill(slot: Slot, stored: Stored) -> int:
    """Writes ``slot`` from ``stored`` (the module docstring's table) -> how many values an FP4
    matrix held in FP8 could not keep exactly (``fp4_to_fp8_blocks``; 0 otherwise); ValueError
    when the stored matrix is not the slot's shape or its scales do not fit."""
    w = stored.weight
    logical = (w.shape[0], 2 * w.shape[1]) if stored.kind == "fp4" else tuple(w.shape)
    if logical != slot.shape:
        raise ValueError(f"a stored {stored.kind} matrix of {logical}, the model's is {slot.shape}")
    dev = slot.weight.device
    inexact = 0
    with torch.no_grad():
        if slot.fp4:
            if stored.kind == "fp4":
                assert stored.scale is not None
                packed, scale = w, stored.scale
                _check_grid(scale, fp4_scale_grid((w.shape[0], w.shape[1])))
            else:
                packed, scale = quantize_fp4(dense(stored).to(dev))
            slot.weight.copy_(packed.view(torch.uint8))
            slot.scale.copy_(ue8m0_exponents(scale))
            return 0
        if stored.kind == "fp8" and stored.block == (BLOCK, BLOCK):
            assert stored.scale is not None
            w8, scale = w, stored.scale
            _check_grid(scale, scale_grid(slot.shape, (BLOCK, BLOCK)))
        elif stored.kind == "fp4":
            assert stored.scale is not None
            blocks = fp4_to_fp8_blocks(w.to(dev), stored.scale.to(dev))
            w8, scale, inexact = blocks.weight, blocks.scale, blocks.inexact
        else:
            w8, scale = quantize_blockwise(dense(stored).to(dev), (BLOCK, BLOCK))
        assert w8.dtype == FP8_DTYPE
        slot.weight.copy_(w8)
        slot.scale.copy_(scale_to_float(scale))
    return inexact
