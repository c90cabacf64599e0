"""Writing an ``MLADecoder`` as a Hugging Face checkpoint in the released layout: the
checkpoint's names (``model.layers.L.self_attn.q_a_proj.weight``, one tensor per expert and
projection), FP8 weights as ``F8_E4M3`` with their ``weight_scale_inv`` grids, everything else
in its dtype, config.json given by the caller (with a ``quantization_config`` when any weight is
FP8). What ``hf_io.load_hf_model`` reads back bit for bit: the way a model built in place (a
real-dimension one, ``scaled``) reaches disk, the loader's check at that scale, and how a
trained model ships (its MTP layer as layer N, without copies of the target's tensors).

``checkpoint_tensors`` is the inverse of ``mla_names.checkpoint_targets``'s table."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dhisparse.family.quantization_config import SCALE_SUFFIX
from dhisparse.family.released_fp8 import RELEASED_FP8
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.mla_mtp import MTP_NAMES
from services.worker.ops.fp8_blockwise import FP8_DTYPE
from services.worker.ops.fp8_moe import gate_up_halves
from services.worker.weights.checkpoint import INDEX_FILE, WEIGHTS_FILE

CONFIG_FILE = "config.json"

# our name after ``layers.L.`` -> the checkpoint's after ``model.layers.L.`` (prefix rules)
_LAYER = (
    ("attn_norm.", "input_layernorm."),
    ("mlp_norm.", "post_attention_layernorm."),
    ("indexer.", "self_attn.indexer."),
    ("attn.", "self_attn."),
    ("mlp.", "mlp."),
)
_GLOBAL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_EXPERTS = "mlp.experts."
_MTP = "mtp."
_MTP_OWN = {ours: theirs for theirs, ours in MTP_NAMES.items()}


def _rename(ours: str) -> str:
    if ours in _GLOBAL:
        return _GLOBAL[ours]
    layer, rest = ours.removeprefix("layers.").split(".", 1)
    if rest in _MTP_OWN:
        return f"model.layers.{layer}.{_MTP_OWN[rest]}"
    for mine, theirs in _LAYER:
        if rest.startswith(mine):
            return f"model.layers.{layer}.{theirs}{rest.removeprefix(mine)}"
    raise ValueError(f"{ours}: no checkpoint name")


def _experts(
    prefix: str, state: dict[str, torch.Tensor], ours: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's fused experts (``ours``: their prefix in ``state``; ``prefix``: the same
    with the layer's index, ``layers.L.mlp.experts.``) as the checkpoint stores them, per
    expert and projection: gate and up are the halves of gate_up_proj (and of its scale grid,
    for FP8 experts)."""
    gate_up, down = state[ours + "gate_up_proj"], state[ours + "down_proj"]
    layer = prefix.removeprefix("layers.").split(".", 1)[0]
    out = f"model.layers.{layer}.mlp.experts."
    fp8 = gate_up.dtype == FP8_DTYPE
    gate_up_s = state[ours + "gate_up_proj" + SCALE_SUFFIX] if fp8 else None
    down_s = state[ours + "down_proj" + SCALE_SUFFIX] if fp8 else None
    for e in range(gate_up.shape[0]):
        gate, up = gate_up_halves(gate_up[e], None if gate_up_s is None else gate_up_s[e])
        down_e = (down[e], None if down_s is None else down_s[e])
        for proj, (w, s) in (("gate_proj", gate), ("up_proj", up), ("down_proj", down_e)):
            yield f"{out}{e}.{proj}.weight", w
            if s is not None:
                yield f"{out}{e}.{proj}.weight{SCALE_SUFFIX}", s


def checkpoint_tensors(model: MLADecoder) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every weight the released layout stores, as views of the
    model's tensors. A model holding its MTP layer writes it as layer N
    (``model.layers.{N}.*``: the decoder layer's names, and ``MTP_NAMES`` for its own tensors)
    without the released copies of the target's tensors: no ``embed_tokens`` of its own, and no
    ``shared_head.head`` when the layer's head is the target's head (or tied embedding); the
    loader ties them back (``hf_io.load_hf_model``)."""
    state = model.state_dict()
    shared = _shared_head(model)
    done: set[str] = set()
    for name in state:
        scale_of_a_weight = name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in state
        if name in done or scale_of_a_weight:  # a weight's scales go with it
            continue
        if name == shared:
            continue  # the target's head, shared by the MTP layer
        if _EXPERTS in name:
            prefix = name[: name.index(_EXPERTS) + len(_EXPERTS)]
            done |= {n for n in state if n.startswith(prefix)}
            yield from _experts(_layer_name(model, prefix), state, prefix)
            continue
        theirs = _rename(_layer_name(model, name))
        yield theirs, state[name]
        scale = name + SCALE_SUFFIX
        if scale in state:
            yield theirs + SCALE_SUFFIX, state[scale]


def _shared_head(model: MLADecoder) -> str | None:
    """``mtp.shared_head.head.weight`` when that tensor is the target's head or tied
    embedding (``tie_mtp_head``), else None."""
    if model.mtp is None:
        return None
    head = model.mtp.shared_head.head.weight
    targets = [model.embed.weight] + ([] if model.lm_head is None else [model.lm_head.weight])
    return "mtp.shared_head.head.weight" if any(head is t for t in targets) else None


def _layer_name(model: MLADecoder, ours: str) -> str:
    """Our name with the MTP layer's ``mtp.`` prefix as its layer, ``layers.{N}.``; its own
    tensors (``MTP_NAMES``) keep their names there."""
    if not ours.startswith(_MTP):
        return ours
    return f"layers.{model.mtp_layer}." + ours.removeprefix(_MTP)


def save_hf_checkpoint(
    model: MLADecoder,
    path: str | Path,
    config: dict[str, Any],
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Writes config.json (``config``, plus FP8's ``quantization_config`` when the model holds
    FP8 weights) and the weights under ``path``, in shards of at most ``max_shard_bytes`` (a
    larger tensor alone) with ``model.safetensors.index.json``, or one ``model.safetensors``.
    Tensors are copied to the host one shard at a time."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = list(checkpoint_tensors(model))
    config = dict(config)
    if any(t.dtype == FP8_DTYPE for _, t in tensors):
        config.setdefault("quantization_config", RELEASED_FP8)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    if len(shards) == 1:
        save_file(_host(shards[0]), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(_host(shard), str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys((n for n, _ in shard), file))
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return path


def _host(shard: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {n: t.detach().contiguous().cpu() for n, t in shard}
