"""DeepSeek-V4's ``config.json`` (``model_type`` ``deepseek_v4``), parsed into the frozen
``V4Config`` the worker's V4 model is built from.

Read as transformers 5.17.0 writes it (``layer_types``, ``mlp_layer_types``, ``compress_rates``,
``partial_rotary_factor`` and a nested ``rope_parameters`` ``{main, compress}``) and as the hub
ships it (the legacy ``compress_ratios`` with its trailing MTP entry, ``num_hash_layers``,
``qk_rope_head_dim``, ``rope_scaling`` + ``rope_theta`` + ``compress_rope_theta``,
``expert_dtype``), folded the way ``DeepseekV4Config.__post_init__`` folds them: absent keys take
its class defaults. A key with no effect on inference is accepted and named in one log line; a
key not understood, or a value that changes the math in a way this engine does not implement,
is a ``ConfigError`` naming it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from dhisparse.family.config import LayerSpec, ModelConfig, SourceSpec
from dhisparse.family.hf_config import ConfigError
from dhisparse.family.rope_spec import RopeSpec
from dhisparse.family.v41_candidates import KEYS as CANDIDATE_KEYS
from dhisparse.family.v41_candidates import CandidateBlocks, parse_candidates
from dhisparse.family.v41_sources import KEYS, SharedSources, parse_shared_sources

log = logging.getLogger(__name__)

AttentionKind = Literal["sliding", "csa", "hca"]
MlpKind = Literal["hash", "moe"]

# transformers 5.17.0 ``DeepseekV4Config`` class defaults (DeepSeek-V4-Flash).
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
    num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus",
    norm_topk_prob=True, routed_scaling_factor=1.5, max_position_embeddings=1048576,
    rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024,
    index_n_heads=64, index_head_dim=128, index_topk=512, num_nextn_predict_layers=1,
    rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)  # fmt: skip
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_DEFAULT_HASH_LAYERS = 3
_KINDS: dict[str, AttentionKind] = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_RATIO_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention",
                128: "heavily_compressed_attention"}  # fmt: skip
_MLP_KINDS: dict[str, MlpKind] = {"hash_moe": "hash", "moe": "moe"}

# What a file is and how it was written; read where needed, never worth a log line.
_METADATA = frozenset({
    "architectures", "model_type", "transformers_version", "auto_map", "_name_or_path",
    "torch_dtype", "dtype", "quantization_config", "expert_dtype",
})  # fmt: skip
# No effect on inference (training-only settings, outputs): accepted and named in one log line.
_INERT = frozenset({
    "use_cache", "initializer_range", "pad_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "attention_dropout", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise",
})  # fmt: skip
# Keys whose value is fixed by what transformers' V4 computes: any other value is another model.
_FIXED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "num_key_value_heads": (1,),
    "scoring_func": ("sqrtsoftplus",),
    "topk_method": ("noaux_tc",),
    "norm_topk_prob": (True,),
    "n_shared_experts": (1,),
}
_LEGACY = frozenset({
    "compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers",
    "qk_rope_head_dim", "rope_scaling",
})  # fmt: skip
_STRUCTURE = frozenset({
    "layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor",
    "rope_parameters",
})  # fmt: skip
_ROPE_KEYS = frozenset({
    "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "attention_factor", "truncate", "partial_rotary_factor",
})  # fmt: skip


@dataclass(frozen=True)
class V4Config:
    """The math of a DeepSeek-V4 model. Per layer: its attention kind, its compression rate
    (tokens per compressed row; 0 on sliding-only layers) and its MoE routing (``hash``: experts
    from ``tid2eid[token]``; ``moe``: learned top-k)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int  # the single K=V head, and every query head
    rope_dim: int  # the trailing rotary slice of every head (qk_rope_head_dim)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    attention: tuple[AttentionKind, ...]
    compress: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    mlp: tuple[MlpKind, ...]
    n_routed: int
    top_k: int
    moe_intermediate: int  # routed and shared experts
    routed_scaling: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: RopeSpec  # sliding-only layers
    compress_rope: RopeSpec  # CSA / HCA layers: attention, compressor and indexer
    max_position: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    mtp_layers: int
    dtype: str
    expert_dtype: str | None  # "fp4": the released routed experts are FP4 e2m1
    # whose compressed rows, index keys and selection each layer reads: its own (V4), or
    # DeepSeek-V4.1's shared sources where the config names them (``v41_sources``)
    sharing: SharedSources
    # DeepSeek-V4.1's candidate blocks where the config names a candidate source
    # (``v41_candidates``); None: every indexer scores every position it sees
    candidates: CandidateBlocks | None = None
    # the MTP layer's compression ratio: the legacy ``compress_ratios``' trailing entry (0 in
    # the releases, and where the config names none: a sliding-window layer)
    mtp_compress: int = 0

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5


def parse_v4_config(raw: dict[str, Any]) -> V4Config:
    """config.json (as a dict) -> V4Config; raises ConfigError naming the offending key."""
    if raw.get("model_type") != "deepseek_v4":
        raise ConfigError(f"model_type {raw.get('model_type')!r} is not deepseek_v4")
    known = set(_DEFAULTS) | _METADATA | _INERT | set(_FIXED) | _LEGACY | _STRUCTURE
    known |= KEYS | CANDIDATE_KEYS
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"config.json: unsupported field(s) {unknown} for deepseek_v4")
    ignored = sorted(_INERT & set(raw))
    if ignored:
        log.info("config.json: ignored, no effect on inference: %s", ", ".join(ignored))
    for key, allowed in _FIXED.items():
        if key in raw and raw[key] not in allowed:
            raise ConfigError(f"config.json: {key}={raw[key]!r} is not supported ({allowed[0]!r})")
    c = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    n = int(c["num_hidden_layers"])
    attention, compress = _attention(raw, n)
    head_dim = int(c["head_dim"])
    main_rope, compress_rope, rope_dim = _ropes(raw, c, head_dim)
    if rope_dim % 2 or not 0 < rope_dim <= min(head_dim, int(c["index_head_dim"])):
        raise ConfigError(
            f"config.json: the rotary slice ({rope_dim}) must be even and fit head_dim and "
            "index_head_dim"
        )
    heads, groups = int(c["num_attention_heads"]), int(c["o_groups"])
    if heads % groups:
        raise ConfigError(f"config.json: o_groups={groups} does not divide {heads} heads")
    expert_dtype = raw.get("expert_dtype")
    if expert_dtype not in (None, "fp4", "fp8", "bf16"):
        raise ConfigError(f"config.json: expert_dtype={expert_dtype!r} is not supported")
    eos = c["eos_token_id"]
    sharing = parse_shared_sources(raw, attention, compress)
    candidates = parse_candidates(raw, sharing, compress, int(c["index_topk"]))
    if candidates is None:  # the block keys change nothing without a candidate source
        inert = sorted(CANDIDATE_KEYS & set(raw))
        if inert:
            log.info("config.json: ignored, no candidate source: %s", ", ".join(inert))
    return V4Config(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        num_layers=n,
        num_heads=heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int(c["q_lora_rank"]),
        o_groups=groups,
        o_lora_rank=int(c["o_lora_rank"]),
        sliding_window=int(c["sliding_window"]),
        attention=attention,
        compress=compress,
        index_n_heads=int(c["index_n_heads"]),
        index_head_dim=int(c["index_head_dim"]),
        index_topk=int(c["index_topk"]),
        mlp=_mlp(raw, n),
        n_routed=int(c["n_routed_experts"]),
        top_k=int(c["num_experts_per_tok"]),
        moe_intermediate=int(c["moe_intermediate_size"]),
        routed_scaling=float(c["routed_scaling_factor"]),
        swiglu_limit=float(c["swiglu_limit"]),
        hc_mult=int(c["hc_mult"]),
        hc_sinkhorn_iters=int(c["hc_sinkhorn_iters"]),
        hc_eps=float(c["hc_eps"]),
        rms_norm_eps=float(c["rms_norm_eps"]),
        main_rope=main_rope,
        compress_rope=compress_rope,
        max_position=int(c["max_position_embeddings"]),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list | tuple) else (eos,),
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        mtp_layers=int(c["num_nextn_predict_layers"] or 0),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        expert_dtype=expert_dtype,
        sharing=sharing,
        candidates=candidates,
        mtp_compress=_mtp_compress(raw, n),
    )


def _attention(raw: dict[str, Any], n: int) -> tuple[tuple[AttentionKind, ...], tuple[int, ...]]:
    """Per layer (kind, rate): ``layer_types``, else the legacy per-layer ``compress_ratios``
    (0 / 4 / 128; entries past ``n``, the MTP layer's, dropped), else transformers' default
    schedule (2 HCA, then CSA / HCA alternating); rates from ``compress_rates`` and the legacy
    ``compress_rate_csa`` / ``compress_rate_hca``."""
    rates = dict(_DEFAULT_RATES)
    rates |= raw.get("compress_rates") or {}
    for kind, key in (("compressed_sparse_attention", "compress_rate_csa"),
                      ("heavily_compressed_attention", "compress_rate_hca")):  # fmt: skip
        if raw.get(key) is not None:
            rates[kind] = raw[key]
    if set(rates) != set(_DEFAULT_RATES) or any(int(r) < 1 for r in rates.values()):
        raise ConfigError(f"config.json: compress_rates {rates} is not a rate >= 1 per kind")
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        try:
            types = [_RATIO_KINDS[int(r)] for r in raw["compress_ratios"]]
        except KeyError as e:
            raise ConfigError(
                f"config.json: compress_ratios has {e.args[0]!r} (supported: 0, 4, 128)"
            ) from None
    if types is None:
        alternate = ["compressed_sparse_attention", "heavily_compressed_attention"]
        types = ["heavily_compressed_attention"] * min(n, 2)
        types += [alternate[(i + 1) % 2] for i in range(max(n - 2, 0))]
    types = list(types)[:n]
    bad = sorted({str(t) for t in types} - set(_KINDS))
    if len(types) != n or bad:
        raise ConfigError(f"config.json: layer_types must be {n} of {sorted(_KINDS)}; got {bad}")
    kinds = tuple(_KINDS[t] for t in types)
    return kinds, tuple(0 if t == "sliding_attention" else int(rates[t]) for t in types)


def _mtp_compress(raw: dict[str, Any], n: int) -> int:
    """The MTP layer's ratio: ``compress_ratios[n]`` where the legacy key has one, else 0."""
    ratios = raw.get("compress_ratios")
    if ratios is not None and len(ratios) > n:
        return int(ratios[n])
    return 0


def _mlp(raw: dict[str, Any], n: int) -> tuple[MlpKind, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        k = raw.get("num_hash_layers")
        k = _DEFAULT_HASH_LAYERS if k is None else int(k)
        types = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
    types = list(types)[:n]
    if len(types) != n or set(types) - set(_MLP_KINDS):
        raise ConfigError(f"config.json: mlp_layer_types must be {n} of {sorted(_MLP_KINDS)}")
    return tuple(_MLP_KINDS[t] for t in types)


def _ropes(raw: dict[str, Any], c: dict[str, Any], head_dim: int) -> tuple[RopeSpec, RopeSpec, int]:
    """(main, compress, rotary width). A nested ``rope_parameters`` {main, compress} is read as
    written; otherwise main is plain RoPE at ``rope_theta`` and compress is the flat
    ``rope_parameters`` / legacy ``rope_scaling`` (YaRN in the releases) at
    ``compress_rope_theta``, with YaRN's attention factor 1 unless stated."""
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        legacy = raw.get("qk_rope_head_dim")
        factor = legacy / head_dim if legacy is not None else 64 / 512
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": c["rope_theta"]}
        compress = flat | {"rope_theta": c["compress_rope_theta"]}
        if compress.get("rope_type", compress.get("type")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
    widths = {
        int(head_dim * float(p.get("partial_rotary_factor", factor))) for p in (main, compress)
    }
    if len(widths) != 1:
        raise ConfigError(f"config.json: main and compress rotary widths differ: {widths}")
    return _rope(main, c), _rope(compress, c), widths.pop()


def _rope(params: dict[str, Any], c: dict[str, Any]) -> RopeSpec:
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise ConfigError(f"config.json: unsupported rope parameter(s) {unknown}")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", c["rope_theta"]))
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
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def v4_topology(cfg: V4Config, name: str, mtp: bool = False) -> ModelConfig:
    """The engine's KV topology of a V4 model: one source per layer that computes compressed
    rows, which that layer owns and runs its own selection over. A sliding layer has no source
    (``source=-1``, ``index="none"``): its K=V rows of the last ``sliding_window`` positions are
    a state ring of its own, and no row of it is stored in the payload. A CSA / HCA layer's
    source stores one compressed row per ``rate`` tokens in the payload, beside the same window
    (the source's token ring); a CSA layer's index keys are its indexer's compressed rows
    (``index_head_dim`` each), and an HCA layer, which runs no indexer, holds none
    (``index="none"``). ``d_kv`` is the K=V head (``head_dim``, its tail
    rotated). ``extra["state_rings"]``: the per-slot rings the cache keeps
    (``v4_state_rings``).

    With DeepSeek-V4.1's shared sources (``cfg.sharing``) a consumer layer reads its KV
    source's source: a Reindex layer as a producer scoring the source's index keys
    (``keys_from``), a Reuse layer as a ``reuse`` consumer of its index source's selection;
    its own window is a state ring. Shared rows and keys are stored once.

    ``mtp``: with the MTP layer as layer N, a draft layer over a sliding source of its own that
    lags by one (its row t is from the token at t + 1 and the target's streams at t,
    docs/mtp.md) and keeps no history (``stored=False``: its rows live in the source's token
    ring alone, as a sliding layer's in its state ring); ``extra["carry_width"]``: the carry holds the target's last ``hc_mult``
    streams (``hc_mult * hidden``), what the MTP layer reads."""
    share = cfg.sharing
    sources: list[SourceSpec] = []
    layers: list[LayerSpec] = []
    source_of: dict[int, int] = {}  # a layer that computes rows -> its source
    for i, rate in enumerate(cfg.compress):
        owner = share.kv_source[i]
        if cfg.attention[i] == "sliding":  # its window is a state ring: no source, no row stored
            layers.append(LayerSpec(source=-1, index="none"))
        elif owner < 0 or owner == i:
            source_of[i] = len(sources)
            sources.append(SourceSpec(compress=max(rate, 1), window=cfg.sliding_window))
            indexed = cfg.attention[i] == "csa"  # an HCA layer runs no indexer
            layers.append(LayerSpec(source=source_of[i], index="producer" if indexed else "none"))
        elif share.runs_indexer(i):
            layers.append(LayerSpec(source=source_of[owner], keys_from=owner))
        else:
            leader = share.index_source[i]
            layers.append(LayerSpec(source=source_of[owner], index="reuse", leader=leader))
    extra: dict = {"state_rings": [[rows, width] for _, _, rows, width in v4_state_rings(cfg)]}
    if mtp:
        if cfg.mtp_compress:
            raise ConfigError(
                f"config.json: compress_ratios gives the MTP layer ratio {cfg.mtp_compress}; "
                "only a sliding-window MTP layer (0, as released) is served"
            )
        sources.append(SourceSpec(compress=1, window=cfg.sliding_window, lag=1, stored=False))
        layers.append(LayerSpec(source=len(sources) - 1, index="none", draft=True))
        extra["carry_width"] = cfg.hc_mult * cfg.hidden_size
    return ModelConfig(
        name=name, vocab_size=cfg.vocab_size, d_model=cfg.hidden_size, n_heads=cfg.num_heads,
        d_latent=cfg.head_dim - cfg.rope_dim, d_rope=cfg.rope_dim, d_ff=cfg.moe_intermediate,
        n_index_heads=cfg.index_n_heads, d_index=cfg.index_head_dim, index_topk=cfg.index_topk,
        sources=tuple(sources), layers=tuple(layers), max_position=cfg.max_position,
        eos_token_id=cfg.eos_token_ids[0], bos_token_id=cfg.bos_token_id, mask_token_id=None,
        tie_embeddings=cfg.tie_word_embeddings, dtype=cfg.dtype, extra=extra,
    )  # fmt: skip


def v4_state_rings(cfg: V4Config) -> tuple[tuple[int, str, int, int], ...]:
    """(layer, part, rows, width) of each per-slot ring of a V4 model's own state, in the KV
    cache's order. Per CSA / HCA layer that computes rows: its attention's compressor's token
    projections (``"kv"``: ``wkv`` then ``wgate``, ``width`` elements), then a CSA layer's
    indexer's (``"index"``); an overlapping (CSA) compressor keeps ``2 * rate`` positions, a
    row pooling its window and the one before, HCA's keeps ``rate``. Per sliding layer, and per
    consumer of a shared source (DeepSeek-V4.1), its own window's K=V rows (``"window"``:
    ``sliding_window`` rows of ``head_dim``; a consumer's source's token ring holds the source
    layer's)."""
    out = []
    for i, (kind, rate) in enumerate(zip(cfg.attention, cfg.compress, strict=True)):
        if kind == "sliding" or not cfg.sharing.owns_rows(i):
            out.append((i, "window", cfg.sliding_window, cfg.head_dim))
            continue
        overlap = kind == "csa"
        dim = 2 * cfg.head_dim if overlap else cfg.head_dim
        out.append((i, "kv", rate * (2 if overlap else 1), 2 * dim))
        if overlap:
            out.append((i, "index", 2 * rate, 4 * cfg.index_head_dim))
    return tuple(out)
