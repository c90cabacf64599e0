"""Copying a checkpoint's weights into preallocated parameters, tensor by tensor.

The caller owns the mapping from checkpoint names to target tensors (a family's one table of
names) and says which checkpoint tensors it does not want and why; this module only checks the
mapping against the checkpoint and copies."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from dhisparse.family.parallel_layout import Cut
from dhisparse.family.quantization_config import FP8_BLOCK
from services.worker.ops.fp8_blockwise import quantize_blockwise
from services.worker.weights.checkpoint import Checkpoint, CheckpointError

log = logging.getLogger(__name__)

LISTED = 20  # names an error message lists before it only counts the rest


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more


class Fp8Target(NamedTuple):
    """Where one weight held in FP8 goes: ``weight`` e4m3 and its 128x128 block scales
    ``scale`` (fp32), both views of the model's buffers."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


class Sliced(NamedTuple):
    """A target that takes only ``cut`` of its checkpoint tensor (a rank's shard)."""

    target: torch.Tensor | Fp8Target
    cut: Cut

    @property
    def shape(self) -> torch.Size:
        return self.target.shape


Target = torch.Tensor | Fp8Target | Sliced


def _expected_shape(checkpoint: Checkpoint, name: str, target: Target) -> tuple[int, ...]:
    stored = checkpoint.shape(name)
    return target.cut.shape(stored) if isinstance(target, Sliced) else stored


def _copy(checkpoint: Checkpoint, name: str, target: Target) -> None:
    """One checkpoint tensor (or its cut) into its target. An FP8 target takes an FP8 weight of
    128x128 blocks as stored (bytes and scales), and any other weight quantized here per
    block."""
    cut = None
    if isinstance(target, Sliced):
        target, cut = target
    if not isinstance(target, Fp8Target):
        target.copy_(checkpoint.get(name, target.dtype, target.device, cut))
        return
    device = target.weight.device
    if checkpoint.is_fp8(name) and checkpoint.block == FP8_BLOCK:
        w, s = checkpoint.get_fp8(name, cut)
        w, s = w.to(device), s.to(device)
    else:
        dense = checkpoint.get(name, torch.float32, device, cut)
        w, s = quantize_blockwise(dense, FP8_BLOCK)
    target.weight.copy_(w)
    target.scale.copy_(s)


def load_into(
    checkpoint: Checkpoint,
    targets: Mapping[str, Target],
    ignore: Mapping[str, str] | Iterable[str] = (),
) -> None:
    """Copies every checkpoint tensor named in ``targets`` into its target (``copy_``, in the
    target's dtype and on its device, or as FP8 into an ``Fp8Target``; a ``Sliced`` target
    reads only its cut; the read tensor is dropped before the next is read).

    ``ignore`` holds regular expressions (``re.match``, so anchored at the name's start), or
    maps each to the reason it is ignored (e.g. ``{r"model\\.layers\\.61\\.": "MTP layer; no
    drafter asked for"}``). Before anything is copied, CheckpointError is raised for targets
    the checkpoint lacks, for checkpoint tensors neither targeted nor ignored, and for shapes
    that differ. Ignored tensors are reported in one warning: how many, per pattern and why."""
    reasons = dict(ignore) if isinstance(ignore, Mapping) else dict.fromkeys(ignore, "")
    patterns = {p: re.compile(p) for p in reasons}
    stored = checkpoint.names()
    missing = set(targets) - set(stored)
    if missing:
        raise CheckpointError(
            f"{checkpoint.model_dir}: {len(missing)} weights missing: {_listing(missing)}"
        )
    ignored: dict[str, int] = dict.fromkeys(reasons, 0)
    unexpected = []
    for name in stored:
        if name in targets:
            continue
        hit = next((p for p, rx in patterns.items() if rx.match(name)), None)
        if hit is None:
            unexpected.append(name)
        else:
            ignored[hit] += 1
    if unexpected:
        raise CheckpointError(
            f"{checkpoint.model_dir}: {len(unexpected)} unexpected weights (neither loaded nor "
            f"ignored): {_listing(unexpected)}"
        )
    wrong = [
        f"{name} {list(_expected_shape(checkpoint, name, t))} into {list(t.shape)}"
        for name, t in targets.items()
        if tuple(t.shape) != _expected_shape(checkpoint, name, t)
    ]
    if wrong:
        raise CheckpointError(
            f"{checkpoint.model_dir}: {len(wrong)} weights of the wrong shape: {_listing(wrong)}"
        )
    with torch.no_grad():
        for name in stored:
            if name in targets:
                _copy(checkpoint, name, targets[name])
    checkpoint.close()
    if any(ignored.values()):
        parts = [
            f"{n} matching '{p}'" + (f" ({reasons[p]})" if reasons[p] else "")
            for p, n in ignored.items()
            if n
        ]
        log.warning(
            "%s: ignored %d checkpoint tensors: %s",
            checkpoint.model_dir,
            sum(ignored.values()),
            "; ".join(parts),
        )
