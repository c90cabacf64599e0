"""The index-score workspace of a forward pass, at its largest: device memory the KV budget
holds for it on a GPU (eq. 3: a fixed required allocation, like the prefill scratch).

Selection scores every visible index key of a request (``row_selection.select_rows``). A
prefill scores its chunk's queries in blocks of at most ``SCORE_BLOCK`` against the keys of its request; a
batch of short chunks (at most ``SHORT_CHUNK`` queries per request: verify rounds, and prefill
chunks that short) is scored for all its requests at once, each padded to the longest chunk,
against keys padded to a bucketed width. Chunked prefill bounds both by ``max_prefill_tokens``
(a chunk never exceeds it), where an unchunked prefill's block is bounded only by the context.
On a GPU the caching allocator keeps what a pass took, so the workspace competes with the
pool; host memory on the CPU does not, and there it is not counted."""

from __future__ import annotations

import torch

from dhisparse.family.config import ModelConfig
from services.worker.kv.config import KVCacheConfig

# The model's index scoring (``model.row_selection``) takes these shapes, and the bound below
# follows them: prefill queries are scored against a request's keys per block of SCORE_BLOCK,
# bounding the [T, S] score matrix; chunks of at most SHORT_CHUNK (verify rounds: K_r queries
# per request) are scored for all requests in one batched product instead of a loop over
# requests.
SCORE_BLOCK = 512
SHORT_CHUNK = 16
MIN_ATTENTION_BLOCK = 64  # prefill query tokens per FP8 attention gather, at least


def padded_keys(rows: int) -> int:
    """An upper bound of ``row_selection.key_rows(rows)``, the bucketed key width of short chunks: a
    step of max(256, an eighth of the power of two) adds less than one step."""
    return rows + max(255, rows // 8)


def index_score_bytes(cfg: ModelConfig, kv: KVCacheConfig) -> int:
    """The most bytes one pass's index scoring allocates at once, over the larger of its two
    shapes, with ``n = max(max_prefill_tokens, spec_block)`` the most queries one request
    adds in a pass, ``m`` the least compression of an index producer's source and
    ``S = max_model_len // m`` the most keys a request shows a query:

    - a block: ``min(SCORE_BLOCK, n)`` queries of one request against its ``S`` keys;
    - short chunks: ``max_slots`` requests of ``min(SHORT_CHUNK, n)`` padded queries each,
      against ``padded_keys(S)`` keys each.

    For Q queries against K keys, the fp32 logits [Q, H_i, K], their ReLU and their weighted
    product live at once beside the fp32 scores [Q, K]: ``4·(3·H_i + 1)·Q·K`` bytes (the
    top-k that follows holds less once they are freed: masked scores, sort values and int64
    indices, ``17·Q·K``); plus the gathered keys [requests, K, d_index] in the cache's dtype
    and in fp32."""
    producers = cfg.index_producers
    if not producers:
        return 0
    m = min(cfg.sources[cfg.layers[i].source].compress for i in producers)
    keys = kv.max_model_len // m
    n = max(kv.max_prefill_tokens, kv.spec_block)
    pair = 4 * (3 * cfg.n_index_heads + 1)
    key_row = cfg.d_index * (4 + torch.empty((), dtype=kv.dtype).element_size())
    block = min(SCORE_BLOCK, n) * keys * pair + keys * key_row
    padded = padded_keys(keys)
    short = kv.max_slots * (min(SHORT_CHUNK, n) * padded * pair + padded * key_row)
    return max(block, short)


def attention_block_tokens(kv: KVCacheConfig) -> int:
    """Query tokens whose selected rows one FP8 gather dequantizes at once: every token of a
    decode or verify pass (a captured graph's pass is one block), prefill in blocks of it."""
    return max(kv.max_slots * kv.spec_block, MIN_ATTENTION_BLOCK)


def attention_rows_bytes(cfg: ModelConfig, kv: KVCacheConfig) -> int:
    """With ``kv_cache_dtype="fp8"``, the fixed workspace attention reads dequantized rows
    from: ``attention_block_tokens`` x k rows of ``d_kv`` in the serving dtype; else none."""
    if kv.kv_cache_dtype != "fp8":
        return 0
    esize = torch.empty((), dtype=kv.dtype).element_size()
    return attention_block_tokens(kv) * cfg.index_topk * cfg.d_kv * esize


def workspace_bytes(cfg: ModelConfig, kv: KVCacheConfig) -> int:
    """What the KV budget holds for the passes' workspaces on a GPU (``index_score_bytes``,
    and ``attention_rows_bytes`` in fp8), nothing on the CPU."""
    if not kv.device.startswith("cuda"):
        return 0
    return index_score_bytes(cfg, kv) + attention_rows_bytes(cfg, kv)
