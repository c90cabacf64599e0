"""The models the roofline measures: a real-dimension family built in place with FP8 weights
(``dhisparse/family/scaled.py``, as ``bench scaled`` builds it), or for runs on the CPU a tiny
model of the same family (every per-layer size shrunk, the topology kept: V3.2's expert
groups, GLM-5.2's IndexShare followers).
And the model's sizes as the byte model (``cost.Dims``) reads them."""

from __future__ import annotations

import torch

from bench.roofline.cost import Dims, LayerDims
from dhisparse.family.presets import FamilyPreset
from dhisparse.family.scaled import SCALED
from services.worker.model.weight_format import WeightFormat
from services.worker.weights.model_io import build_model

TINY_VOCAB = 512  # above the byte tokenizer's ids
_TINY = dict(
    vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
    num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=32,
    n_routed_experts=16, num_experts_per_tok=4, num_hidden_layers=4, first_k_dense_replace=1,
    bos_token_id=0, eos_token_id=1, pad_token_id=1, torch_dtype="float32", dtype="float32",
)  # fmt: skip


def tiny(name: str) -> FamilyPreset:
    """``name``'s scaled preset at tiny sizes (named ``<name>-tiny``)."""
    base = SCALED[name].config
    over: dict = dict(_TINY)
    if base["model_type"] == "deepseek_v32":
        over |= dict(n_group=4, topk_group=2)
    else:  # IndexShare over 4 layers: indexers on 0, 1, 2; layer 3 shares layer 2's
        over |= dict(
            indexer_types=["full", "full", "full", "shared"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        )
    return FamilyPreset(f"{name}-tiny", base | over, mask_token_id=TINY_VOCAB - 1)


def build(
    name: str, device: str, tiny_model: bool, fp8: bool = True
) -> tuple[FamilyPreset, torch.nn.Module]:
    """(the preset, its model built in place on ``device``, bf16 on a GPU and fp32 on the CPU):
    projections and experts in FP8 (``fp8``, as the released checkpoints) or in that dtype."""
    preset = tiny(name) if tiny_model else SCALED[name]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(preset, seed=0, device=device, dtype=dtype,
                        weights=WeightFormat(fp8=fp8), in_place=True)  # fmt: skip
    return preset, model


def dims_of(model: torch.nn.Module, row_bytes: int, key_bytes: int) -> Dims:
    """The byte model's view of a family model (``MLADecoder``) served with KV rows and index
    keys of these stored sizes."""
    f = model.family
    size = model.embed.weight.element_size()  # the serving dtype
    return Dims(
        hidden=f.hidden_size, vocab=f.vocab_size, heads=f.num_heads, q_lora=f.q_lora_rank,
        kv_lora=f.kv_lora_rank, rope=f.qk_rope_head_dim, nope=f.qk_nope_head_dim,
        v_head=f.v_head_dim, index_heads=f.index_n_heads, index_dim=f.index_head_dim,
        index_topk=f.index_topk, intermediate=f.intermediate_size,
        moe_intermediate=f.moe.intermediate, n_shared=f.moe.n_shared, n_routed=f.moe.n_routed,
        top_k=f.moe.top_k,
        layers=tuple(
            LayerDims(sparse_mlp=kind == "sparse", indexer=model.layers[i].indexer is not None)
            for i, kind in enumerate(f.mlp_types[: f.num_layers])
        ),
        fp8=model.weight_format.fp8, weight_bytes=size, act_bytes=size,
        row_bytes=row_bytes, key_bytes=key_bytes,
    )  # fmt: skip
