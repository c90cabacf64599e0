"""The real DSA families' ``config.json`` (DeepSeek-V3.2 ``deepseek_v32``, GLM-5
``glm_moe_dsa``), parsed in one place: the math of the model as a frozen ``MLAConfig``, and the
topology the KV layer sees as a ``ModelConfig`` (one KV source per layer; index producers and
followers).

Keys are read as the hub ships them and as every transformers release from 5.17.0 writes them:
the legacy ``rope_scaling`` + ``rope_theta`` as well as ``rope_parameters``; GLM's
``indexer_types``, ``index_topk_pattern``, or ``index_topk_freq`` + ``index_skip_topk_offset``;
``layer_types`` naming the indexed attention ``deepseek_sparse_attention`` (5.17) or
``indexed_attention`` (later releases). Absent keys take the transformers class defaults of the
family. A key with no effect on inference is accepted and named in one log line. A key that is
not understood, or a value this engine does not implement, is a ``ConfigError`` naming it: a
model is never served with part of its definition ignored."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from dhisparse.family.config import LayerSpec, ModelConfig, SourceSpec
from dhisparse.family.rope_spec import RopeSpec

log = logging.getLogger(__name__)

Family = Literal["deepseek_v32", "glm_moe_dsa"]


class ConfigError(ValueError):
    """config.json asks for something this engine does not implement (a start-up error)."""


# The transformers 5.17.0 class defaults of each family (DeepseekV32Config, GlmMoeDsaConfig).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=0,
        eos_token_id=1, tie_word_embeddings=False, index_topk=2048, index_head_dim=128,
        index_n_heads=64, first_k_dense_replace=3,
    ),
    "glm_moe_dsa": dict(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=78, num_attention_heads=64, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
        v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=202752, rms_norm_eps=1e-5, bos_token_id=0,
        eos_token_id=1, tie_word_embeddings=False, index_topk=2048, index_head_dim=128,
        index_n_heads=32, first_k_dense_replace=3,
    ),
}  # fmt: skip

# What a file is and how it was written; read where needed, never worth a log line.
_METADATA = frozenset({
    "architectures", "model_type", "transformers_version", "auto_map", "_name_or_path",
    "torch_dtype", "dtype", "tokenizer_class", "quantization_config", "num_key_value_heads",
    "num_nextn_predict_layers", "head_dim", "qk_head_dim",
})  # fmt: skip
# Keys with no effect on inference (training-only settings, outputs, deployment hints): accepted
# whatever their value, and named in one log line.
_INERT = frozenset({
    "use_cache", "initializer_range", "pad_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "attention_dropout", "aux_loss_alpha", "seq_aux",
    "ep_size", "output_router_logits",
})  # fmt: skip
# ``layer_types`` entries that name the indexed (DSA) attention these families run.
_INDEXED_LAYERS = ("indexed_attention", "deepseek_sparse_attention")
# Keys whose value is fixed for these families: any other value is a different model.
_FIXED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "topk_method": ("noaux_tc",),
    "scoring_func": ("sigmoid",),
    "moe_layer_freq": (1,),
    "pretraining_tp": (1,),
    "rope_interleave": (True,),
}
_INDEX_SHARE = ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")
_ROPE_KEYS = frozenset({
    "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
})  # fmt: skip


@dataclass(frozen=True)
class MoESpec:
    n_routed: int
    n_shared: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling: float
    intermediate: int  # per routed (and shared) expert


@dataclass(frozen=True)
class MLAConfig:
    """The math of a DeepSeek-V3.2 / GLM-5 model (names as in config.json)."""

    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_rope_interleaved: bool  # GLM rotates interleaved pairs; V3.2 rotate-half
    indexer_types: tuple[str, ...]  # "full" (an index producer) or "shared" (a follower)
    mlp_types: tuple[str, ...]  # "dense" or "sparse" (MoE)
    intermediate_size: int  # dense MLP layers
    moe: MoESpec
    rope: RopeSpec
    rms_norm_eps: float
    max_position: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    mtp_layers: int  # num_nextn_predict_layers: their tensors follow the main layers
    dtype: str
    # The MTP layer's MLP: MoE when its index is past first_k_dense_replace (as vLLM builds it).
    mtp_mlp: str = "sparse"
    # index_share_for_mtp_iteration (GLM-5.2): draft steps after the first reuse its selection.
    mtp_index_share: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale


def parse_config(raw: dict[str, Any]) -> MLAConfig:
    """config.json (as a dict) -> MLAConfig; raises ConfigError naming the offending key."""
    family = raw.get("model_type")
    if family == "deepseek_v4":
        raise ConfigError(
            "model_type 'deepseek_v4' is served by the engine's V4 model (dhisparse generate / "
            "up, on the CPU in float32: docs/models.md), not by the DeepSeek-V3.2 / GLM-5 path "
            "that reads this config (verify, plan, training)"
        )
    if family not in _DEFAULTS:
        raise ConfigError(
            f"model_type {family!r} is not supported; supported: {', '.join(sorted(_DEFAULTS))}"
        )
    known = set(_DEFAULTS[family]) | _METADATA | _INERT | set(_FIXED)
    known |= {"mlp_layer_types", "layer_types"}
    known |= {"rope_parameters", "rope_scaling", "rope_theta", "indexer_rope_interleave"}
    known |= {"index_share_for_mtp_iteration"}
    if family == "glm_moe_dsa":
        known |= set(_INDEX_SHARE)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"config.json: unsupported field(s) {unknown} for {family}")
    ignored = sorted(_INERT & set(raw))
    if ignored:
        log.info("config.json: ignored, no effect on inference: %s", ", ".join(ignored))
    for key, allowed in _FIXED.items():
        if key in raw and raw[key] not in allowed:
            raise ConfigError(f"config.json: {key}={raw[key]!r} is not supported ({allowed[0]!r})")
    c = {**_DEFAULTS[family], **{k: v for k, v in raw.items() if v is not None}}
    if raw.get("q_lora_rank", 1) is None:
        raise ConfigError("config.json: q_lora_rank=null (no q-LoRA) is not supported")
    heads = c["num_attention_heads"]
    if c.get("num_key_value_heads", heads) != heads:
        raise ConfigError("config.json: num_key_value_heads must equal num_attention_heads (MLA)")
    n = c["num_hidden_layers"]
    _check_layer_types(c.get("layer_types"), n)
    if c["n_routed_experts"] % c["n_group"] or c["n_routed_experts"] // c["n_group"] < 2:
        raise ConfigError("config.json: n_group must split n_routed_experts in groups of >= 2")
    if c["qk_rope_head_dim"] > c["index_head_dim"] or c["qk_rope_head_dim"] % 2:
        raise ConfigError("config.json: qk_rope_head_dim must be even and <= index_head_dim")
    interleaved = family == "glm_moe_dsa"  # as transformers implements each family
    if raw.get("indexer_rope_interleave", interleaved) != interleaved:
        raise ConfigError(
            f"config.json: indexer_rope_interleave={raw['indexer_rope_interleave']!r} differs "
            f"from {family}'s indexer (interleaved={interleaved})"
        )
    eos = c["eos_token_id"]
    return MLAConfig(
        family=family,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        num_layers=n,
        num_heads=heads,
        q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        index_n_heads=c["index_n_heads"],
        index_head_dim=c["index_head_dim"],
        index_topk=c["index_topk"],
        indexer_rope_interleaved=interleaved,
        indexer_types=_indexer_types(c, n),
        mlp_types=_mlp_types(c, n),
        intermediate_size=c["intermediate_size"],
        moe=MoESpec(
            n_routed=c["n_routed_experts"],
            n_shared=c["n_shared_experts"],
            top_k=c["num_experts_per_tok"],
            n_group=c["n_group"],
            topk_group=c["topk_group"],
            norm_topk_prob=bool(c["norm_topk_prob"]),
            routed_scaling=float(c["routed_scaling_factor"]),
            intermediate=c["moe_intermediate_size"],
        ),
        rope=_rope(raw, c),
        rms_norm_eps=float(c["rms_norm_eps"]),
        max_position=c["max_position_embeddings"],
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list | tuple) else (eos,),
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        mtp_layers=int(c.get("num_nextn_predict_layers") or 0),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        mtp_mlp="sparse" if n >= int(c["first_k_dense_replace"]) else "dense",
        mtp_index_share=bool(c.get("index_share_for_mtp_iteration", False)),
    )


def _check_layer_types(layer_types: list[str] | None, n: int) -> None:
    """Raises ConfigError unless every one of the ``n`` layers runs indexed attention (absent:
    all do), naming the other kinds and their layers."""
    if layer_types is None:
        return
    if len(layer_types) != n:
        raise ConfigError(f"config.json: layer_types has {len(layer_types)} entries for {n} layers")
    other: dict[str, list[int]] = {}
    for i, kind in enumerate(layer_types):
        if kind not in _INDEXED_LAYERS:
            other.setdefault(str(kind), []).append(i)
    if other:
        named = "; ".join(
            f"{kind!r} at layers {at[:8]}{' ...' if len(at) > 8 else ''}"
            for kind, at in other.items()
        )
        raise ConfigError(
            f"config.json: layer_types has {named}: only indexed attention "
            f"({', '.join(_INDEXED_LAYERS)}) is implemented"
        )


def _rope(raw: dict[str, Any], c: dict[str, Any]) -> RopeSpec:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise ConfigError(f"config.json: unsupported rope parameter(s) {unknown}")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", raw.get("rope_theta") or 10000.0))
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind != "yarn":
        raise ConfigError(f"config.json: rope_type {kind!r} is not supported (default, yarn)")
    original = params.get("original_max_position_embeddings", c["max_position_embeddings"])
    factor = params.get("factor")
    return RopeSpec(
        theta=theta,
        kind="yarn",
        factor=float(factor if factor is not None else c["max_position_embeddings"] / original),
        original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _indexer_types(c: dict[str, Any], n: int) -> tuple[str, ...]:
    """Every layer ``full`` for V3.2; GLM: the explicit list, else the F/S pattern, else layer i
    is full iff max(i - offset + 1, 0) % freq == 0 (GLM-5.2: freq 4, offset 3)."""
    types = c.get("indexer_types")
    if types is None and c.get("index_topk_pattern") is not None:
        pattern = c["index_topk_pattern"]
        try:
            types = [{"F": "full", "S": "shared"}[ch] for ch in pattern]
        except KeyError as e:
            raise ConfigError(f"config.json: index_topk_pattern has {e.args[0]!r}") from None
    if types is None:
        freq = max(int(c.get("index_topk_freq", 1)), 1)
        offset = int(c.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    types = tuple(types)
    if len(types) != n or set(types) - {"full", "shared"}:
        raise ConfigError(f"config.json: indexer_types {list(types)} is not {n} of full/shared")
    if types[0] != "full":
        raise ConfigError("config.json: the first layer must run its indexer (full)")
    return types


def _mlp_types(c: dict[str, Any], n: int) -> tuple[str, ...]:
    types = c.get("mlp_layer_types")
    if types is None:
        k = min(int(c["first_k_dense_replace"]), n)
        types = ["dense"] * k + ["sparse"] * (n - k)
    types = tuple(types)
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise ConfigError(f"config.json: mlp_layer_types {list(types)} is not {n} of dense/sparse")
    return types


def topology(cfg: MLAConfig, name: str, mtp: bool = False) -> ModelConfig:
    """The engine's view: one KV source per layer (576-element rows in the released models);
    ``full`` layers are index producers, ``shared`` layers follow the last full layer before
    them (shared indices, their own payload). ``mtp``: the MTP layer (``--drafter mtp``) is
    layer N = num_hidden_layers, a draft layer producing its own indices over a source of its
    own that lags the tokens by one (docs/mtp.md)."""
    layers, leader = [], 0
    for i, kind in enumerate(cfg.indexer_types):
        if kind == "full":
            leader = i
            layers.append(LayerSpec(source=i, index="producer"))
        else:
            layers.append(LayerSpec(source=i, index="follower", leader=leader))
    sources = [SourceSpec() for _ in layers]
    if mtp:
        if cfg.mtp_layers != 1:
            raise ConfigError(
                f"config.json: num_nextn_predict_layers={cfg.mtp_layers}; the MTP drafter needs "
                "exactly one MTP layer"
            )
        layers.append(LayerSpec(source=len(sources), index="producer", draft=True))
        sources.append(SourceSpec(lag=1))
    return ModelConfig(
        name=name,
        vocab_size=cfg.vocab_size,
        d_model=cfg.hidden_size,
        n_heads=cfg.num_heads,
        d_latent=cfg.kv_lora_rank,
        d_rope=cfg.qk_rope_head_dim,
        d_ff=cfg.intermediate_size,
        n_index_heads=cfg.index_n_heads,
        d_index=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        sources=tuple(sources),
        layers=tuple(layers),
        max_position=cfg.max_position,
        rope_theta=cfg.rope.theta,
        norm_eps=cfg.rms_norm_eps,
        eos_token_id=cfg.eos_token_ids[0],
        bos_token_id=cfg.bos_token_id,
        # The last embedding row fills a block-diffusion drafter's block: the released
        # vocabularies are padded past the tokenizer's ids, so no prompt holds it.
        mask_token_id=cfg.vocab_size - 1,
        tie_embeddings=cfg.tie_word_embeddings,
        dtype=cfg.dtype,
    )
