"""DeepSeek-V4 checkpoints onto ``V4Decoder``, whose parameters carry DeepSeek's own names.

A checkpoint meets the loader in one of three namings, all read:
- the hub's: ``layers.0.attn.wq_a.weight``, ``embed.weight``, ``hc_head_fn``, ``head.weight``;
- what transformers 5.17 ``save_pretrained`` writes: the same behind ``model.``, with
  ``model.embed_tokens.weight`` and ``model.hc_head.hc_fn``;
- transformers' module names (a raw ``state_dict``): ``model.layers.0.self_attn.q_a_proj``,
  ``compressor.indexer.*``, the routed experts fused into ``experts.gate_up_proj`` [E, 2I, H]
  and ``experts.down_proj`` [E, H, I].

The MTP layer (``mtp.*``) is not run here; its tensors are left unread and named in one log
line. The released FP8 / FP4 form (``quantization_config``, FP8 and packed FP4 tensors) is
refused."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from dhisparse.family.quantization_config import CheckpointError
from dhisparse.family.v4_config import V4Config, parse_v4_config
from services.worker.model.v4_decoder import V4Decoder
from services.worker.weights.checkpoint import Checkpoint

log = logging.getLogger(__name__)

# transformers' names -> DeepSeek's, applied in order (native names are fixed points).
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.position_bias$", ".ape"),
    (r"\.kv_norm\.", ".norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)
# FP8 e4m3 weights, their UE8M0 scales, FP4 e2m1 experts packed two per byte.
_QUANTIZED = frozenset({"F8_E4M3", "F8_E8M0", "I8", "U8"})
_FUSED = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$")


def native_name(name: str) -> str:
    """One tensor's name in DeepSeek's naming (fused experts aside: ``native_tensors``)."""
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def native_tensors(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One stored tensor -> its tensors in DeepSeek's naming: a fused expert tensor splits into
    the experts' ``w1`` / ``w3`` (the gate, then the up half of ``gate_up_proj``) or ``w2``."""
    name = native_name(name)
    fused = _FUSED.match(name)
    if fused is None:
        return {name: t}
    prefix, kind = fused.groups()
    out = {}
    for e, w in enumerate(t):
        if kind == "down_proj":
            out[f"{prefix}.{e}.w2.weight"] = w
        else:
            gate, up = w.chunk(2, dim=0)
            out[f"{prefix}.{e}.w1.weight"] = gate
            out[f"{prefix}.{e}.w3.weight"] = up
    return out


def read_v4_config(path: str | Path) -> V4Config:
    raw = json.loads((Path(path) / "config.json").read_text())
    if raw.get("quantization_config") is not None:
        raise CheckpointError(
            f"{path}: the released FP8 / FP4 form of DeepSeek-V4 (quantization_config) is not "
            "supported yet; give an unquantised (bf16 / fp32) checkpoint"
        )
    return parse_v4_config(raw)


def load_v4_model(path: str | Path, dtype: torch.dtype = torch.float32) -> V4Decoder:
    """The V4 checkpoint in ``path`` as a ``V4Decoder`` of ``dtype`` on the CPU; every parameter
    must come from the checkpoint and every tensor but the MTP layer's must be used."""
    cfg = read_v4_config(path)
    model = V4Decoder(cfg).to(dtype)
    want = model.state_dict()
    found: dict[str, torch.Tensor] = {}
    skipped = 0
    with Checkpoint(path) as ckpt:
        for stored in ckpt.names():
            if re.match(r"^(model\.)?mtp\.", stored):
                skipped += 1
                continue
            if ckpt.dtype(stored) in _QUANTIZED:
                raise CheckpointError(
                    f"{path}: {stored} is stored as {ckpt.dtype(stored)}: the FP8 / FP4 form is "
                    "not supported yet"
                )
            target = want.get(native_name(stored))
            kind = target.dtype if target is not None and not target.is_floating_point() else dtype
            found |= native_tensors(stored, ckpt.get(stored, kind))
    if skipped:
        log.info("%s: %d MTP tensors (mtp.*) not loaded: the MTP layer is not run", path, skipped)
    missing, unexpected = sorted(set(want) - set(found)), sorted(set(found) - set(want))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: DeepSeek-V4 tensors missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, t in found.items():
        if t.shape != want[name].shape:
            raise CheckpointError(
                f"{path}: {name} has shape {list(t.shape)}, the config gives {list(want[name].shape)}"
            )
    model.load_state_dict(found, strict=True)
    return model.eval()
