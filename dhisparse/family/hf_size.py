"""What a DeepSeek-V3.2 / GLM-5 model weighs, counted from its ``MLAConfig`` alone (pure
Python: ``dhisparse plan`` sizes a model without torch or its weights).

The count is of the main model that transformers instantiates: embeddings, every decoder layer
and the final norm, ``lm_head`` when untied; the MTP layers that follow the main layers in the
checkpoint are not counted. Every tensor is listed with the part it belongs to; the routers'
``e_score_correction_bias`` is a buffer in transformers (and here), so ``total`` leaves it out
and ``with_router_bias`` adds it (the elements a checkpoint stores for these layers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dhisparse.family.hf_config import MLAConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameters by part, each summed over the layers that have it."""

    embed: int  # embed_tokens
    lm_head: int  # 0 when tied to the embeddings
    attention: int  # q_a, q_a_layernorm, q_b, kv_a (with the MQA rope key), kv_a_layernorm, kv_b, o
    indexer: int  # full layers: wq_b, wk, k_norm weight and bias, weights_proj
    norms: int  # input_layernorm, post_attention_layernorm per layer; the final norm
    dense_mlp: int  # gate, up, down on the first_k_dense_replace layers
    router: int  # MoE layers: the gate's weight
    routed_experts: int
    shared_experts: int
    router_bias: int  # MoE layers: e_score_correction_bias (a buffer: not in ``total``)

    @property
    def total(self) -> int:
        """The parameters transformers' model has (``num_parameters()``)."""
        return self.with_router_bias - self.router_bias

    @property
    def with_router_bias(self) -> int:
        return sum(asdict(self).values())

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total, "with_router_bias": self.with_router_bias}


def attention_params(cfg: MLAConfig) -> int:
    """One layer's MLA: q-LoRA with its norm, the 576-row kv_a (latent + rope key) with the
    latent's norm, kv_b expanding the latent to per-head k_nope and v, and o."""
    h, d = cfg.num_heads, cfg.hidden_size
    q_a = cfg.q_lora_rank * d + cfg.q_lora_rank
    q_b = h * cfg.qk_head_dim * cfg.q_lora_rank
    kv_a = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * d + cfg.kv_lora_rank
    kv_b = h * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
    o = d * h * cfg.v_head_dim
    return q_a + q_b + kv_a + kv_b + o


def indexer_params(cfg: MLAConfig) -> int:
    """One index producer's indexer: wq_b from the q latent, wk and weights_proj from the hidden
    state, and k_norm (a LayerNorm with a bias)."""
    heads, dim, d = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    return heads * dim * cfg.q_lora_rank + dim * d + 2 * dim + heads * d


def param_count(cfg: MLAConfig) -> ParamCount:
    d, moe = cfg.hidden_size, cfg.moe
    full = cfg.indexer_types.count("full")
    dense = cfg.mlp_types.count("dense")
    sparse = cfg.mlp_types.count("sparse")
    swiglu = 3 * d  # gate, up and down per unit of intermediate width
    vocab = cfg.vocab_size * d
    return ParamCount(
        embed=vocab,
        lm_head=0 if cfg.tie_word_embeddings else vocab,
        attention=cfg.num_layers * attention_params(cfg),
        indexer=full * indexer_params(cfg),
        norms=cfg.num_layers * 2 * d + d,
        dense_mlp=dense * swiglu * cfg.intermediate_size,
        router=sparse * moe.n_routed * d,
        routed_experts=sparse * moe.n_routed * swiglu * moe.intermediate,
        shared_experts=sparse * swiglu * moe.intermediate * moe.n_shared,
        router_bias=sparse * moe.n_routed,
    )
