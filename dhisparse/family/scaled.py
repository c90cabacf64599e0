"""Real-dimension models that fit one 141 GB GPU, for speed runs with random weights built in place
(``io.build_model(..., in_place=True)``; no files): every per-layer dimension, the attention,
indexer, IndexShare schedule and MoE routing of the released config, with fewer layers and
fewer routed experts (``shared/notes/real-models.md`` §1.7 and §2.7).

- ``v32-scaled``: DeepSeek-V3.2 with 16 layers (3 dense, 13 MoE) and 64 routed experts (8
  groups, top-4 groups, top-8): 43.48 B parameters.
- ``glm5-scaled``: GLM-5.2 with 20 layers (3 dense, 17 MoE; indexers on layers 0, 1, 2, 6, 10,
  14 and 18, IndexShare followers between) and 64 routed experts: 47.67 B parameters.

Both keep their checkpoint's FP8 ``quantization_config``, so ``weights="auto"`` is FP8, and
its MTP layer (``num_nextn_predict_layers`` 1): built with it (``build_model(..., mtp=True)``,
``--drafter mtp``), a model holds that layer as layer N, random like the rest, its head the
target's as in the released checkpoints. Pure Python, like ``presets``."""

from __future__ import annotations

from typing import Any

from dhisparse.family.presets import FamilyPreset
from dhisparse.family.released_fp8 import RELEASED_FP8 as _FP8

# deepseek-ai/DeepSeek-V3.2's config.json (tests/fixtures/configs/deepseek-v3.2), scaled.
_V32: dict[str, Any] = {
    "model_type": "deepseek_v32",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 16, "first_k_dense_replace": 3,
    "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
    "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
    },
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16", "quantization_config": _FP8,
}  # fmt: skip


def _glm_layers(n: int, dense: int, freq: int, offset: int) -> dict[str, list[str]]:
    """GLM-5.2's per-layer lists for ``n`` layers: layer i runs its indexer ("full") iff
    max(i - offset + 1, 0) % freq == 0, else shares its group's ("shared"); the first
    ``dense`` layers are dense."""
    return {
        "indexer_types": [
            "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)
        ],
        "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(n)],
    }


# zai-org/GLM-5.2's config.json (tests/fixtures/configs/glm-5.2), scaled.
_GLM5: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
    "moe_intermediate_size": 2048, "num_hidden_layers": 20, "first_k_dense_replace": 3,
    "num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
    "index_topk_freq": 4, "index_skip_topk_offset": 3, "index_topk_pattern": None,
    "indexer_rope_interleave": True, "index_share_for_mtp_iteration": True,
    **_glm_layers(20, dense=3, freq=4, offset=3),
    "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576, "rope_interleave": True,
    "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
    "eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "dtype": "bfloat16",
    "quantization_config": _FP8,
}  # fmt: skip

SCALED: dict[str, FamilyPreset] = {
    # the drafters' mask token: the last embedding row, as hf_config's topology takes it
    "v32-scaled": FamilyPreset("v32-scaled", _V32, mask_token_id=_V32["vocab_size"] - 1),
    "glm5-scaled": FamilyPreset("glm5-scaled", _GLM5, mask_token_id=_GLM5["vocab_size"] - 1),
}
