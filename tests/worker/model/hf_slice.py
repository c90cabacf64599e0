"""A few-layer slice of DeepSeek-V3.2 / GLM-5 with the released per-layer dimensions, as
transformers 5.17.0 (the oracle) builds it, and what the slice tests compare: transformers'
prefill with its indexers' top-k and its routers' choices recorded by forward hooks, and our
engine's chunked prefill over a resident KV cache, with those choices injected or not.

Config values are transformers' class defaults (which are the released configs: DeepseekV32Config
= DeepSeek-V3.2, GlmMoeDsaConfig = GLM-5), with only the layer count, the number of routed
experts (64, as in the scaled configs of notes/real-models.md §1.7 / §2.7), the dense-layer
count, RoPE (V3.2's released YaRN; GLM-5.2's theta and IndexShare) and, where a test says so,
the vocabulary overridden."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)

from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig, bytes_per_token
from services.worker.kv.workspace import workspace_bytes
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.mla_moe import MoE
from services.worker.serving.cache import KVCache
from tests.hf_tiny import YARN, indexer_hooks, our_topk_order

LAYERS = 4
EXPERTS = 64  # routed experts of the scaled configs (top-8 of 8 groups of 8 stays valid)

# Every per-layer dimension reduced, the structure kept (groups, IndexShare, dense + MoE
# layers, 16 index heads so that exact-zero score ties are rare: notes §5.3).
_SMALL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=384, moe_intermediate_size=64,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64,
    qk_rope_head_dim=16, index_n_heads=16, index_head_dim=32, index_topk=32,
    n_routed_experts=16, num_experts_per_tok=4,
)  # fmt: skip


def v32_slice(small: bool = False, **over) -> DeepseekV32Config:
    """DeepSeek-V3.2's layers 0-3 with the first one dense (released: 3 dense), 64 routed
    experts in 8 groups (top-4 groups, top-8 experts), the released YaRN."""
    kw = dict(
        num_hidden_layers=LAYERS, first_k_dense_replace=1, n_routed_experts=EXPERTS,
        rope_parameters=dict(YARN, rope_type="yarn", rope_theta=10000.0),
    )  # fmt: skip
    if small:
        kw |= _SMALL | dict(qk_nope_head_dim=32, v_head_dim=32, n_group=4, topk_group=2)
    return DeepseekV32Config(**(kw | over))


def glm_slice(small: bool = False, **over) -> GlmMoeDsaConfig:
    """GLM-5's layers 0-3 with GLM-5.2's IndexShare (``index_topk_freq`` 4,
    ``index_skip_topk_offset`` 3: layers 0-2 run an indexer, layer 3 reuses layer 2's top-k) and
    RoPE (theta 8e6, 1M positions), the first layer dense, 64 routed experts (no groups)."""
    kw = dict(
        num_hidden_layers=LAYERS, first_k_dense_replace=1, n_routed_experts=EXPERTS,
        rope_parameters={"rope_type": "default", "rope_theta": 8e6},
        max_position_embeddings=1048576, index_topk_freq=4, index_skip_topk_offset=3,
    )  # fmt: skip
    if small:
        kw |= _SMALL | dict(qk_nope_head_dim=48, v_head_dim=64)
    return GlmMoeDsaConfig(**(kw | over))


SLICES = {"deepseek_v32": v32_slice, "glm_moe_dsa": glm_slice}


def build_on(config, device: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """transformers' model of ``config`` built directly on ``device`` in ``dtype`` (eager
    attention and experts: the plain reference), ``indexer.weights_proj`` in fp32 as
    ``from_pretrained`` keeps it, every weight drawn in place with unit-scale activations:
    projections N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.2^2), the
    indexer's k_norm bias and the routers' correction biases N(0, 0.1^2) (none at its init
    value of 0 or 1, which would hide a wrong read)."""
    cls = DeepseekV32ForCausalLM if config.model_type == "deepseek_v32" else GlmMoeDsaForCausalLM
    with torch.device(device):
        model = cls._from_config(
            config, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        )
    for name, module in model.named_modules():
        if name.endswith("indexer.weights_proj"):
            module.float()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            if "norm" in name and name.endswith("weight"):
                t.normal_(1.0, 0.2, generator=g)
            elif name.endswith(("bias", "e_score_correction_bias")):
                t.normal_(0.0, 0.1, generator=g)
            elif "embed_tokens" in name:
                t.normal_(0.0, 1.0, generator=g)
            else:
                t.normal_(0.0, 1 / math.sqrt(t.shape[-1]), generator=g)
    return model.eval()


@dataclass
class Pass:
    """What one model computed over a prompt of T tokens."""

    logits: torch.Tensor  # [T, vocab] fp32
    selections: dict[int, torch.Tensor]  # index producer -> [T, k'] positions
    experts: dict[int, torch.Tensor]  # MoE layer -> [T, top_k] chosen experts
    weights: dict[int, torch.Tensor]  # MoE layer -> [T, top_k] their weights, fp32


def run_reference(model: torch.nn.Module, ids: torch.Tensor) -> Pass:
    """transformers' uncached forward over ``ids`` [T], its top-k in our order (ties: the lower
    position first), with each indexer's top-k [T, min(index_topk, T)] (masked future
    positions included where fewer are visible) and each router's choice recorded."""
    sel: dict[int, torch.Tensor] = {}
    experts: dict[int, torch.Tensor] = {}
    weights: dict[int, torch.Tensor] = {}
    hooks = indexer_hooks(model, sel)
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:  # (router_logits, topk_weights, topk_indices)

            def routed(_m, _a, out, i=i) -> None:
                weights[i], experts[i] = out[1].float(), out[2].long()

            hooks.append(gate.register_forward_hook(routed))
    try:
        with torch.no_grad(), our_topk_order():
            logits = model(ids.unsqueeze(0), use_cache=False).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return Pass(logits, sel, experts, weights)


def as_given(theirs: torch.Tensor, k: int) -> torch.Tensor:
    """transformers' top-k [T, k'] -> our selection [T, k]: the visible positions (<= t) in its
    order, then -1 pads (for t < k it also picks masked future positions, which attend nothing)."""
    t = torch.arange(theirs.shape[0], device=theirs.device).unsqueeze(1)
    visible = theirs <= t
    order = torch.sort((~visible).int(), dim=1, stable=True).indices
    sel = torch.where(visible, theirs, -1).gather(1, order)
    if sel.shape[1] < k:
        sel = torch.cat([sel, sel.new_full((sel.shape[0], k - sel.shape[1]), -1)], dim=1)
    return sel


@torch.no_grad()
def run_ours(
    model: MLADecoder,
    ids: torch.Tensor,
    chunk: int,
    given_selections: dict[int, torch.Tensor] | None = None,
    given_experts: dict[int, torch.Tensor] | None = None,
) -> Pass:
    """Our prefill of ``ids`` [T] in chunks of ``chunk`` tokens over a resident KV cache in the
    model's dtype, each chunk given its rows of ``given_selections`` / ``given_experts``
    (layer -> [T, ...], see ``SparseDecoder.forward``); records every producer's selection
    [T, k] and every router's choice."""
    device = model.embed.weight.device
    dtype = model.embed.weight.dtype
    n, page = len(ids), 16
    per_token = bytes_per_token(model.cfg, dtype.itemsize, payload=True)
    kv_cfg = KVCacheConfig(
        kv_pool_bytes=int(per_token * (n + 4 * page)) + (1 << 20), page_size=page, max_slots=1,
        max_model_len=n, max_prefill_tokens=chunk, dtype=dtype, device=str(device),
    )  # fmt: skip
    # on a GPU the budget also holds the passes' workspaces (index scores: chunk x context)
    kv_cfg = replace(
        kv_cfg, kv_pool_bytes=kv_cfg.kv_pool_bytes + workspace_bytes(model.cfg, kv_cfg)
    )
    kv = KVCache(model.cfg, kv_cfg)
    moe = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]
    routed: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in moe}
    hooks = [
        model.layers[i].mlp.gate.register_forward_hook(
            lambda _m, _a, out, i=i: routed[i].append(out)  # (weights, experts) of a chunk
        )
        for i in moe
    ]
    logits, chunks = [], []
    try:
        assert kv.admit(0, "slice", n, n)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            batch = ForwardBatch.build([0], [a], [b - a], device)
            sel: dict[int, torch.Tensor] = {}
            hidden = model(
                ids[a:b].to(device), batch, kv, selections=sel,
                given_selections={i: s[a:b] for i, s in (given_selections or {}).items()},
                given_experts={i: e[a:b] for i, e in (given_experts or {}).items()},
            )  # fmt: skip
            kv.commit(batch, [b])
            logits.append(model.logits(hidden))
            chunks.append(sel)
    finally:
        for h in hooks:
            h.remove()
        kv.close()
    producers = [i for i, s in enumerate(model.cfg.layers) if s.index == "producer"]
    selections = {i: torch.cat([c[i] for c in chunks]) for i in producers}
    experts = {i: torch.cat([e for _, e in routed[i]]) for i in moe}
    weights = {i: torch.cat([w for w, _ in routed[i]]) for i in moe}
    return Pass(torch.cat(logits), selections, experts, weights)


# ---- what is compared ----------------------------------------------------------------------
def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """||ours - theirs||_F / ||theirs||_F in fp32."""
    return float(torch.linalg.vector_norm(ours.float() - theirs.float()) / theirs.float().norm())


def selection_recall(ours: torch.Tensor, theirs: torch.Tensor, k: int) -> dict[str, float]:
    """The mean of |ours ∩ theirs| / |theirs| per query t over all queries (``all``) and over
    the sparse ones, which see more than k positions (``sparse``), ``theirs`` [T, k'] counted over visible positions
    (<= t), ``ours`` [T, k] over real ones (>= 0)."""
    n = ours.shape[0]
    recall = torch.empty(n, device=ours.device)
    for a in range(0, n, 256):
        b = min(n, a + 256)
        rows = torch.arange(a, b, device=ours.device).unsqueeze(1)
        mine = _membership(ours[a:b], ours[a:b] >= 0, n)
        ref = _membership(theirs[a:b], theirs[a:b] <= rows, n)
        recall[a:b] = (mine & ref).sum(1) / ref.sum(1)
    sparse = recall[k:]
    return {"all": float(recall.mean()), "sparse": float(sparse.mean()) if len(sparse) else 1.0}


def _membership(pos: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """[R, k] positions (where ``valid``) -> [R, width] bool: which positions each row holds."""
    out = torch.zeros(pos.shape[0], width + 1, dtype=torch.bool, device=pos.device)
    out.scatter_(1, torch.where(valid, pos, width), True)
    return out[:, :width]


def routing_agreement(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    """Of [T, top_k] choices: the share of tokens whose expert sets are identical
    (``identical``), and the mean |ours ∩ theirs| / top_k (``overlap``)."""
    same = (ours.sort(dim=1).values == theirs.sort(dim=1).values).all(dim=1)
    overlap = (ours.unsqueeze(2) == theirs.unsqueeze(1)).any(dim=2).float().mean(dim=1)
    return {"identical": float(same.float().mean()), "overlap": float(overlap.mean())}
