"""Forward passes of the model over the KV cache: eager, or replayed from a CUDA graph where one
covers the pass (decode and verify passes, ``graphs.cuda_graph``). What a pass computes, and
what its tokens become, is the engine's; running it is this module's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from services.worker.graphs.cuda_graph import DecodeGraphs, GraphConfig
from services.worker.kv.batch import ForwardBatch
from services.worker.model.decoder import SparseDecoder
from services.worker.model.hot_vocab import HotHead
from services.worker.model.mla_mtp import MTPStep, greedy_block
from services.worker.ops.fusion import kernel_fusion
from services.worker.serving.cache import KVCache
from services.worker.transfers import to_device


class PassLogits(NamedTuple):
    """What a plain pass gives back: ``sampled`` [S, V] fp32 logits at the last token of each
    request that samples, and ``scored`` [R, d_model] the hidden states of the rows asked for
    (prompt logprobs; None when none were)."""

    sampled: torch.Tensor
    scored: torch.Tensor | None


class ModelPasses:
    """``graphs``: the captured decode and verify passes, or None when every pass runs eagerly
    (set once the engine knows the widest verify block). ``fused``: every pass, eager or
    captured, runs the fused kernels (``ops.fusion``). ``hot_head``: the MTP layer's draft
    steps score its hot ids only (``HotHead``); None: the whole vocabulary."""

    def __init__(
        self,
        model: SparseDecoder,
        kv: KVCache,
        device: torch.device,
        fused: bool = False,
        hot_head: HotHead | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.fused = fused
        self.hot_head = hot_head
        self.graphs: DecodeGraphs | None = None

    def cold_passes(self) -> int:
        """Decode and verify passes and MTP draft steps so far that captured a CUDA graph or
        ran eagerly while graphs are on; 0 without graphs."""
        g = self.graphs
        return 0 if g is None else g.captures + g.eager

    def sampled_logits(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        sampled: list[int],
        features: dict | None,
        scored: list[int] | None = None,
    ) -> PassLogits:
        """Logits at the last token of each request ``sampled`` (indices into ``batch``'s
        requests) of a plain pass over ``tokens`` [N], and the hidden states of the rows
        ``scored`` (indices into ``tokens``; a prefill pass's only); writes the pass's rows into
        the KV cache (the caller commits). A decode pass, in which every request samples, is
        replayed from its graph where one covers it."""
        with kernel_fusion(self.fused):
            return self._sampled_logits(tokens, batch, sampled, features, scored)

    def _sampled_logits(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        sampled: list[int],
        features: dict | None,
        scored: list[int] | None,
    ) -> PassLogits:
        if self.graphs is not None and batch.is_decode and not batch.prefill:
            assert not scored, "a decode pass scores no prompt rows"
            return PassLogits(self.graphs.logits(tokens, batch, features), None)
        hidden = self.model(tokens, batch, self.kv, features=features)
        last = batch.last_token_index
        if len(sampled) < batch.num_requests:
            last = last[to_device(sampled, self.device)]
        kept = hidden[to_device(scored, self.device)] if scored else None
        return PassLogits(self.model.logits(hidden[last]), kept)

    def forward_logits(
        self, tokens: torch.Tensor, batch: ForwardBatch, features: dict | None = None
    ) -> torch.Tensor:
        """[N, V] fp32 logits of every new token of a decode or verify ``batch`` (tokens [N]),
        replayed from a CUDA graph where one covers the pass; writes the pass's rows into the
        KV cache (the caller commits). ``features``: as ``SparseDecoder.forward`` takes them."""
        with kernel_fusion(self.fused):
            if self.graphs is not None and self.graphs.covers(batch):
                return self.graphs.logits(tokens, batch, features)
            return self.model.logits(self.model(tokens, batch, self.kv, features=features))

    def mtp_step(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        hidden: torch.Tensor | None,
        selection: torch.Tensor | None,
    ) -> MTPStep:
        """One MTP-only draft pass over the KV cache (``MLADecoder.mtp_step``,
        ``V4Model.mtp_step``), replayed from a CUDA graph once one is captured."""
        with kernel_fusion(self.fused):
            if self.graphs is not None:
                return self.graphs.mtp_step(tokens, batch, hidden, selection, self.hot_head)
            return self.model.mtp_step(tokens, batch, self.kv, hidden, selection, hot=self.hot_head)

    def mtp_block(
        self, anchors: torch.Tensor, batches: Sequence[ForwardBatch], share_index: bool
    ) -> torch.Tensor:
        """A round's greedy MTP draft steps for requests that each draft every one of them
        (``greedy_block``): [R, S] proposals. Replayed as one CUDA graph where the graphs hold
        MTP blocks (``GraphConfig.mtp_block``), else step by step (``mtp_step``)."""
        if self.graphs is not None and self.graphs.mtp_blocks:
            with kernel_fusion(self.fused):
                return self.graphs.mtp_block(anchors, batches, share_index, self.hot_head)
        return greedy_block(self.mtp_step, anchors, batches, share_index)


def graphs_off(
    cfg: GraphConfig,
    model: SparseDecoder,
    device: torch.device,
    check_invariants: bool,
    data_parallel: bool,
) -> str | None:
    """Why decode and verify passes are not replayed as CUDA graphs, or None when they are."""
    if not cfg.enabled:
        return "turned off (--no-cuda-graphs)"
    if device.type != "cuda":
        return f"device {device} is not a GPU"
    if any(src.lag for src in model.cfg.sources) and not cfg.mtp:
        return "served with its MTP layer, whose passes are not captured (--no-cuda-graphs-mtp)"
    if check_invariants:  # the checks read counters back: not capturable
        return "DHISPARSE_CHECK_INVARIANTS is set"
    if data_parallel:
        return "data-parallel attention: each MoE layer exchanges a varying number of tokens"
    return None
