"""The scaled presets (``dhisparse/family/scaled.py``) at shrunk dimensions, for CPU tests: the
scaled topology kept (V3.2's YaRN and expert groups, GLM-5.2's IndexShare, V4-Flash's
sliding-window, CSA and HCA layers and hash routing, the MTP layer),
every per-layer size and the layer count reduced, fp32, and an engine around a model built in
place of the preset (as ``bench scaled`` builds its)."""

from __future__ import annotations

from dhisparse.family.presets import FamilyPreset, V4Preset
from dhisparse.family.scaled import SCALED, V4_SCALED
from dhisparse.tokenizer import ByteTokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.speculative.config import SpeculationConfig

VOCAB = 512
# Every per-layer size reduced; the routing groups of V3.2 kept at 4 of 16 experts.
_SHRINK = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=192, moe_intermediate_size=32,
    num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=32,
    n_routed_experts=16, num_experts_per_tok=4, num_hidden_layers=4, first_k_dense_replace=1,
    bos_token_id=0, eos_token_id=1, pad_token_id=1,
)  # fmt: skip


# V4-Flash over 5 layers: 2 sliding-window, CSA, HCA (rate 8, so short prompts complete rows),
# CSA; layers 0-2 hash-routed, as released; the MTP layer's trailing 0.
_V4_SHRINK = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
    q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=4,
    index_head_dim=16, index_topk=4, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, num_hidden_layers=5, compress_ratios=[0, 0, 4, 128, 4, 0],
    compress_rate_hca=8,
)  # fmt: skip


def shrunk_v4(name: str, **config) -> V4Preset:
    """A V4 scaled preset shrunk (``_V4_SHRINK``), fp32; ``config``: keys to set besides."""
    base = V4_SCALED[name].config
    small = {k: v for k, v in base.items() if k not in ("quantization_config", "expert_dtype")}
    small |= _V4_SHRINK | {"torch_dtype": "float32"} | config
    return V4Preset(f"{name}-shrunk", small)


def shrunk(name: str, **config) -> FamilyPreset:
    """``config``: keys of config.json to set besides."""
    base = SCALED[name].config
    over: dict = dict(_SHRINK)
    if base["model_type"] == "deepseek_v32":
        over |= dict(n_group=4, topk_group=2)
    else:  # GLM-5.2's IndexShare over 4 layers: indexers on 0, 1, 2; layer 3 shares layer 2's
        over |= dict(
            indexer_types=["full", "full", "full", "shared"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        )
    small = {k: v for k, v in base.items() if k != "quantization_config"}  # fp32 on the CPU
    small |= over | {"torch_dtype": "float32", "dtype": "float32"} | config
    return FamilyPreset(f"{name}-shrunk", small, mask_token_id=VOCAB - 1)


def engine(name: str, model, mode: str, spec: SpeculationConfig | None, **kw) -> Engine:
    base = dict(
        model=name, mode=mode, kv_pool_mib=24, host_arena_mib=16, max_num_seqs=3,
        max_model_len=256, max_prefill_tokens=256, page_size=16, hot_cache_rows=32,
        speculation=spec or SpeculationConfig(),
    )  # fmt: skip
    return Engine(EngineConfig(**(base | kw)), model=model, tokenizer=ByteTokenizer())
