"""The roofline's byte and FLOP model (``bench/roofline/cost.py``) against numbers computed by
hand for a small two-layer model: a dense layer with an indexer, an MoE layer following it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.roofline.cost import Cost, Dims, LayerDims, PassShape, pass_costs, passes_costs, total

DIMS = Dims(
    hidden=256, vocab=1000, heads=2, q_lora=128, kv_lora=64, rope=16, nope=32, v_head=32,
    index_heads=4, index_dim=32, index_topk=8, intermediate=512, moe_intermediate=128,
    n_shared=1, n_routed=8, top_k=2,
    layers=(LayerDims(sparse_mlp=False, indexer=True), LayerDims(sparse_mlp=True, indexer=False)),
    fp8=True, weight_bytes=2, act_bytes=2, row_bytes=160, key_bytes=64,
)  # fmt: skip
# two decode tokens seeing 5 and 20 rows; the MoE layer's tokens chose 3 distinct experts
SHAPE = PassShape(visible=(5, 20), experts={1: 3}, sampled=2)


def test_fp8_projection_reads_its_weight_scales_and_activations() -> None:
    c = pass_costs(DIMS, SHAPE)["attn.q_a_proj"]
    # per layer: 128 x 256 e4m3 weight, a 1 x 2 grid of fp32 scales, x [2, 256] and y [2, 128]
    per_layer = 128 * 256 + 2 * 4 + 2 * (256 + 128) * 2
    assert c == Cost(2 * per_layer, 2 * (2 * 2 * 128 * 256))
    assert pass_costs(DIMS, SHAPE)["indexer.wk"] == Cost(32 * 256 + 2 * 4 + 2 * 288 * 2, 32768)


def test_dense_weights_take_their_element_size() -> None:
    c = pass_costs(replace(DIMS, fp8=False), SHAPE)["attn.q_a_proj"]
    assert c.bytes == 2 * (128 * 256 * 2 + 2 * (256 + 128) * 2)


def test_sparse_attention_reads_min_k_visible_rows_per_token() -> None:
    c = pass_costs(DIMS, SHAPE)["attn.sparse"]
    rows = 5 + 8  # min(8, 5) + min(8, 20)
    per_layer = rows * 160 + 2 * 2 * (80 + 64) * 2
    assert c == Cost(2 * per_layer, 2 * (2 * 2 * rows * (80 + 64)))


def test_the_indexer_scores_every_visible_key_on_producers_only() -> None:
    costs = pass_costs(DIMS, SHAPE)
    assert costs["indexer.select"] == Cost(25 * 64 + 2 * 4 * 33 * 2, 2 * 4 * 25 * 32)
    assert costs["indexer.wq_b"].flops == 2 * 2 * 128 * 128  # one producer layer
    follower_only = replace(DIMS, layers=(LayerDims(sparse_mlp=True, indexer=False),))
    assert "indexer.select" not in pass_costs(follower_only, PassShape((5,), {0: 2}, 1))


def test_routed_experts_count_each_distinct_expert_once() -> None:
    c = pass_costs(DIMS, SHAPE)["mlp.experts"]
    expert = 3 * 128 * 256 + (2 * 1 * 2 + 2 * 1) * 4  # gate_up [256, 256], down [256, 128]
    assert c == Cost(3 * expert + 2 * 2 * 256 * 2, 2 * 2 * 2 * 3 * 128 * 256)
    router = pass_costs(DIMS, SHAPE)["mlp.gate"]
    assert router == Cost(8 * 256 * 2 + 8 * 4 + 2 * 256 * 2, 2 * 2 * 8 * 256)
    # the dense layer's MLP is its own three projections
    assert pass_costs(DIMS, SHAPE)["mlp.down_proj"].flops == 2 * 2 * 256 * 512


def test_the_head_scores_only_sampled_tokens() -> None:
    head = pass_costs(DIMS, SHAPE)["lm_head"]
    assert head == Cost(1000 * 256 * 2 + 2 * 256 * 2 + 2 * 1000 * 4, 2 * 2 * 1000 * 256)
    chunk = pass_costs(DIMS, replace(SHAPE, sampled=0))
    assert "lm_head" not in chunk


def test_passes_sum_and_the_total_is_the_sum_of_regions() -> None:
    one = pass_costs(DIMS, SHAPE)
    two = passes_costs(DIMS, [SHAPE, SHAPE])
    assert set(one) == set(two)
    for region, c in one.items():
        assert two[region].bytes == pytest.approx(2 * c.bytes)
    t = total(one)
    assert t.bytes == pytest.approx(sum(c.bytes for c in one.values())) and t.flops > 0
