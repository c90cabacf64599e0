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
target's as in the released checkpoints.

- ``v4flash-scaled`` (``V4_SCALED``): DeepSeek-V4-Flash with all 43 layers, so its whole
  schedule is kept (2 sliding-window, 21 CSA and 20 HCA layers: ``compress_ratios``
  ``[0, 0] + [4, 128] * 20 + [4]``, the MTP layer's trailing 0), the 3 hash-routed layers
  (0-2) and its MTP layer, with 32 routed experts (top-6) instead of 256 (notes §3.7). Every
  other key is the released config's (``tests/fixtures/configs/deepseek-v4-flash``).
  - What depends on the expert count follows it: every gate is [32, 4096] with a [32]
    correction bias; a hash layer's ``tid2eid`` [129280, 6] is a weight, not a config value:
    the builder draws it giving each token 6 distinct experts of the 32 (``weights/v4_build``;
    the released table names experts of 256).
  - Parameters (a ``meta`` build's, ``tests/worker/model/test_v4_scaled.py``):
    **42,867,548,658** (42.87 B) with the MTP layer, 41,895,562,071 without. Transformers'
    count (notes §3.7) is 1,280 fewer: the 40 learned gates' correction biases are
    parameters here, buffers there.
  - Built in bf16 (the tensors V4 holds in fp32 stay so: hyper-connections, sinks, norms,
    position and correction biases), not in the released form (FP8 dense, FP4 routed
    experts): V4's model holds dense weights (a checkpoint's FP8 / FP4 is dequantised at
    load), so there is no FP8 / FP4 V4 layer to build into. 83.88 GB (78.12 GiB) of weights
    without the MTP layer, 85.83 GB with it.
  - KV as the engine's V4 model holds it, in bf16: 6,880 B per token, the model's own (CSA
    rows 256 B and index keys 64 B, HCA rows 8 B), with the MTP layer as without it (its
    source keeps no history: its rows live in its window's ring). Per session besides: each
    layer's 128-row window, the MTP layer's, and the compressors' rings.
  - ``bench scaled`` runs this preset on a GPU whose memory holds its weights and, shrunk,
    on the CPU in its tests.

Pure Python, like ``presets``."""

from __future__ import annotations

from typing import Any

from dhisparse.family.presets import FamilyPreset, V4Preset
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

# deepseek-ai/DeepSeek-V4-Flash's config.json (tests/fixtures/configs/deepseek-v4-flash), with 32
# routed experts: every layer, its compression schedule and hash layers as released.
_V4_FLASH: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "n_routed_experts": 32, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0, "hidden_act": "silu", "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576,
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn", "rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
        "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000,
    },
    "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16", "expert_dtype": "fp4",
    "quantization_config": _FP8,
}  # fmt: skip

V4_SCALED: dict[str, V4Preset] = {"v4flash-scaled": V4Preset("v4flash-scaled", _V4_FLASH)}
"""Served by the engine's V4 model (``V4Model``), which the MLA families' tools (roofline, load,
profile-step) do not run: apart from ``SCALED``, taken by ``bench scaled``."""
