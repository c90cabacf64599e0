"""The DeepSeek-V3.2 / GLM-5 decoder (``deepseek_v32``, ``glm_moe_dsa``): one code path, the
families differ only in config (YaRN or plain RoPE, the indexer's RoPE layout, MoE groups,
GLM-5.2's IndexShare), all read by ``hf_config``.

Layer by layer, as the checkpoint names them: input_layernorm, MLA (q-LoRA, the 576-element
stored row), the indexer on ``full`` layers, post_attention_layernorm, then a dense MLP below
``first_k_dense_replace`` and the MoE above. ``CHECKPOINT_NAMES`` maps checkpoint tensor names
onto this module's parameters in one table."""

from __future__ import annotations

import re

import torch
from torch import nn

from services.worker.model.checkpoint import CheckpointError
from services.worker.model.config import ModelConfig
from services.worker.model.dsa_indexer import DSAIndexer
from services.worker.model.hf_config import MLAConfig
from services.worker.model.layers import RMSNorm
from services.worker.model.mla import MLA
from services.worker.model.model import SparseDecoder
from services.worker.model.moe import MLP, MoE
from services.worker.model.rotary import Rotary

# Parameters kept in fp32 whatever the serving dtype, as transformers keeps them.
FP32_PARAMS = ("indexer.weights_proj.weight", "mlp.gate.e_score_correction_bias")


class MLALayer(nn.Module):
    def __init__(self, cfg: MLAConfig, topo: ModelConfig, layer: int) -> None:
        super().__init__()
        self.spec = topo.layers[layer]
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MLA(cfg)
        self.indexer = DSAIndexer(cfg) if self.spec.index == "producer" else None
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(cfg.moe, cfg.hidden_size)
            if cfg.mlp_types[layer] == "sparse"
            else MLP(cfg.hidden_size, cfg.intermediate_size)
        )


class MLADecoder(SparseDecoder):
    def __init__(self, cfg: MLAConfig, topo: ModelConfig) -> None:
        super().__init__()
        self._init_topology(topo)
        self.family = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MLALayer(cfg, topo, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return Rotary(positions, self.family.rope)

    def cast(self, dtype: torch.dtype) -> MLADecoder:
        """Casts to the serving dtype, keeping FP32_PARAMS in fp32."""
        self.to(dtype=dtype)
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if name.endswith(FP32_PARAMS):
                t.data = t.data.float()
        return self


# checkpoint name (regex, per layer L) -> this module's name; experts E may come one by one
# (the released layout) or fused (transformers' in-memory layout).
_LAYER_NAMES = (
    (r"input_layernorm\.weight", "attn_norm.weight"),
    (r"post_attention_layernorm\.weight", "mlp_norm.weight"),
    (r"self_attn\.indexer\.(wq_b|wk|weights_proj)\.weight", r"indexer.\1.weight"),
    (r"self_attn\.indexer\.k_norm\.(weight|bias)", r"indexer.k_norm.\1"),
    (
        r"self_attn\.(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm"
        r"|kv_b_proj|o_proj)\.weight",
        r"attn.\1.weight",
    ),
    (r"mlp\.(gate_proj|up_proj|down_proj)\.weight", r"mlp.\1.weight"),
    (r"mlp\.gate\.(weight|e_score_correction_bias)", r"mlp.gate.\1"),
    (
        r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight",
        r"mlp.shared_experts.\1.weight",
    ),
    (r"mlp\.experts\.(gate_up_proj|down_proj)", r"mlp.experts.\1"),
)
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def checkpoint_targets(model: MLADecoder, names: list[str]) -> dict[str, torch.Tensor]:
    """For each checkpoint tensor name this model reads: the tensor (a parameter, or a view
    of one: one expert's slice of the fused expert weights) it is copied into. Names the model
    has no place for are left out (the loader reports them); parameters that no name fills
    raise ``CheckpointError`` listing them."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}  # elements of each parameter some checkpoint tensor fills
    for name in names:
        hit = _target(params, name)
        if hit is not None:
            ours, view = hit
            out[name] = view
            filled[ours] = filled.get(ours, 0) + view.numel()
    unfilled = sorted(n for n in _expected(model) if filled.get(n, 0) != params[n].numel())
    if unfilled:
        listed = ", ".join(unfilled[:20]) + (
            f" and {len(unfilled) - 20} more" if len(unfilled) > 20 else ""
        )
        raise CheckpointError(f"the checkpoint lacks weights for {len(unfilled)} tensors: {listed}")
    return out


def _target(params: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor] | None:
    """(our parameter, the tensor to copy into) for one checkpoint name, or None."""
    if name in _GLOBAL_NAMES:
        ours = _GLOBAL_NAMES[name]
        return (ours, params[ours]) if ours in params else None
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    e = _EXPERT.fullmatch(rest)
    if e is not None:
        return _expert_view(params, prefix, int(e.group(1)), e.group(2))
    for pattern, repl in _LAYER_NAMES:
        if re.fullmatch(pattern, rest):
            ours = prefix + re.sub(pattern, repl, rest)
            return (ours, params[ours]) if ours in params else None
    return None


def _expert_view(
    params: dict[str, torch.Tensor], prefix: str, e: int, proj: str
) -> tuple[str, torch.Tensor] | None:
    """One expert's slice of the fused expert weights: gate and up are the two halves of
    gate_up_proj[e] (as transformers fuses them), down is down_proj[e]."""
    ours = prefix + ("mlp.experts.down_proj" if proj == "down_proj" else "mlp.experts.gate_up_proj")
    fused = params.get(ours)
    if fused is None or e >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return ours, fused[e]
    half = fused.shape[1] // 2
    return ours, (fused[e, :half] if proj == "gate_proj" else fused[e, half:])


def _expected(model: MLADecoder) -> set[str]:
    """Our tensors that a checkpoint must fill: every parameter and the router biases."""
    return set(dict(model.named_parameters())) | {
        n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")
    }


def ignored_patterns(cfg: MLAConfig) -> list[tuple[str, str]]:
    """(regex, why) of checkpoint tensors this decoder does not read."""
    out = []
    if cfg.mtp_layers:
        last = cfg.num_layers + cfg.mtp_layers - 1
        layers = "|".join(str(i) for i in range(cfg.num_layers, last + 1))
        out.append((rf"model\.layers\.({layers})\..*", "the MTP layer (no MTP drafter asked for)"))
    shared = [str(i) for i, t in enumerate(cfg.indexer_types) if t == "shared"]
    if shared:
        out.append(
            (
                rf"model\.layers\.({'|'.join(shared)})\.self_attn\.indexer\..*",
                "indexer tensors of IndexShare (shared) layers",
            )
        )
    return out
