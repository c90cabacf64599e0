"""Compute ops with a plain-torch reference each; Triton kernels live beside them and are
checked against these references."""

from services.worker.ops.indexer import index_scores, select_topk
from services.worker.ops.sparse_attention import sparse_attention_ref

__all__ = ["index_scores", "select_topk", "sparse_attention_ref"]
