"""The index-score workspace the KV budget holds on a GPU (``kv/workspace.py``): its bound
follows the model's scoring shapes, a chunk bounds it, and the CPU holds none of it. The bound
is measured against what selection allocates in ``engine/test_chunked_prefill.py`` (on a GPU)."""

from __future__ import annotations

from dhisparse.family.presets import preset_topology
from services.worker.kv.config import KVCacheConfig
from services.worker.kv.pass_rows import key_rows
from services.worker.kv.workspace import (
    index_score_bytes,
    padded_keys,
    workspace_bytes,
)


def test_the_bound_follows_the_models_scoring_shapes() -> None:
    for rows in range(1, 70_000, 53):
        assert padded_keys(rows) >= key_rows(rows)


def test_a_chunk_bounds_the_prefill_block_and_the_cpu_holds_none() -> None:
    cfg = preset_topology("tiny-glm")  # 4 index heads of 32, uncompressed: 52 B per query and key
    pair, key_row = 4 * (3 * 4 + 1), 32 * (4 + 4)
    kv = KVCacheConfig(max_slots=2, max_model_len=2048, max_prefill_tokens=8192)
    assert index_score_bytes(cfg, kv) == 512 * 2048 * pair + 2048 * key_row
    small = KVCacheConfig(max_slots=2, max_model_len=2048, max_prefill_tokens=100)
    assert index_score_bytes(cfg, small) == 100 * 2048 * pair + 2048 * key_row
    many = KVCacheConfig(max_slots=64, max_model_len=2048, max_prefill_tokens=8192)
    padded = padded_keys(2048)
    assert index_score_bytes(cfg, many) == 64 * (16 * padded * pair + padded * key_row)
    assert workspace_bytes(cfg, kv) == 0  # device "cpu"
    compressed = preset_topology("tiny-dsv4")  # the least compression of a producer's source is 1
    assert index_score_bytes(compressed, kv) == 512 * 2048 * pair + 2048 * key_row
