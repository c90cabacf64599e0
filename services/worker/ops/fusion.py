"""Whether an op runs as one fused Triton kernel or as the torch ops it replaces.

A fused op (norms, RoPE, the MoE router, the split-K sum of the FP8 matmul, ...) runs its
Triton kernel inside ``kernel_fusion()`` on a CUDA tensor, and its torch form elsewhere: on
other devices, outside the block (fusion is off by default: the engine turns it on for its
passes with ``--fused-kernels``), inside ``unfused_kernels()``, and in a pass that records
gradients (the kernels have no backward; serving passes record none). So a benchmark can serve
one model with and without fusion side by side (a CUDA graph captured in either keeps its
choice when replayed), and a test can compare the two through a whole model. The choice holds
in the thread (and asyncio context) that entered it.

Each fused op has a name (``FUSED_OPS``); ``fused_without(*ops)`` runs the named ones in their
torch forms while fusion stays on for the rest, so a divergence between the fused and unfused
passes can be traced to one op. Outside such a block the ops of ``NOT_YET_ON_GPU`` run their
torch forms."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar

import torch

# the ops that have a fused kernel, by the name ``fused`` is asked with
FUSED_OPS = (
    "mla_row",  # the stored row: kv_a_layernorm and RoPE (mla_attention)
    "mla_query",  # the absorbed query: W_UK's GEMM and RoPE into one output (mla_attention)
    "index_rope",  # the indexer's query RoPE (mla_indexer)
    "index_key",  # the indexer's key: LayerNorm and RoPE (mla_indexer)
    "index_scores",  # the decode indexer's scores over paged keys (index_keys)
    "select_topk",  # the indexer's top-k (indexer)
    "rms_norm",  # RMSNorm, weighted or not (layers, v4_norm)
    "add_norm",  # the residual join and the norm after it (layers)
    "silu_mul",  # silu(gate) * up (mla_moe)
    "moe_route",  # the MoE router's choice and weights (mla_moe)
    "moe_align",  # the routed pairs' alignment into expert blocks (moe_align_triton)
    "moe_combine",  # the routed experts' outputs summed per token (fp8_moe)
    "fp8_split_sum",  # the FP8 matmul's split-K sum in its kernel (fp8_linear)
    "attention_combine",  # sparse attention's splits combined in its kernel
    "page_locations",  # rows' locations through the page tables (paged)
    "hyper_mix",  # DeepSeek-V4's hyper-connection weights, Sinkhorn included (v4_hyper)
    "hyper_streams",  # DeepSeek-V4's streams collapsed and merged (v4_hyper)
    "rope_tail",  # DeepSeek-V4's RoPE of each head's trailing channels (v4_rope)
)
# fused ops whose kernels have passed their torch references under the interpreter but have not
# yet run on a GPU: left out by default (as if named by ``fused_without``) until their GPU tests
# pass; a ``fused_without`` block sets its own list, so ``fused_without()`` turns them on
NOT_YET_ON_GPU: frozenset[str] = frozenset()
_FUSED: ContextVar[bool] = ContextVar("dhisparse_kernel_fusion", default=False)
_WITHOUT: ContextVar[frozenset[str]] = ContextVar("dhisparse_fused_without", default=NOT_YET_ON_GPU)


def fused(t: torch.Tensor, op: str) -> bool:
    """True when op ``op`` (``FUSED_OPS``) on ``t`` runs its fused Triton kernel: ``t`` is on
    a CUDA device, fusion is on (``kernel_fusion``), ``op`` is not excluded
    (``fused_without``) and no gradient is recorded."""
    assert op in FUSED_OPS, f"unknown fused op {op!r}"
    return t.is_cuda and _FUSED.get() and op not in _WITHOUT.get() and not torch.is_grad_enabled()


@contextmanager
def kernel_fusion(on: bool = True) -> Iterator[None]:
    """Within the block, fused ops run their kernels (``on``) or their torch forms."""
    token = _FUSED.set(on)
    try:
        yield
    finally:
        _FUSED.reset(token)


@contextmanager
def fused_without(*ops: str) -> Iterator[None]:
    """Within the block, the named ops (``FUSED_OPS``) run their torch forms even where
    fusion is on; the others are as ``kernel_fusion`` says."""
    unknown = set(ops) - set(FUSED_OPS)
    if unknown:
        raise ValueError(f"unknown fused ops {sorted(unknown)}; choose from {FUSED_OPS}")
    token = _WITHOUT.set(frozenset(ops))
    try:
        yield
    finally:
        _WITHOUT.reset(token)


def unfused_kernels() -> AbstractContextManager[None]:
    """Within the block, every fused op runs its torch form (``kernel_fusion(False)``)."""
    return kernel_fusion(False)
