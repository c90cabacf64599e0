"""The MTP layer's draft head over a hot vocabulary (FR-Spec, Zhao et al. 2025; SGLang's
``--speculative-token-map``).

A draft step's logits cover N hot token ids (the most frequent ones), not the V of the
vocabulary: ``HotHead`` holds a copy of the head's rows for those ids, made once at load, so a
step reads N rows of the head instead of V. Its greedy proposal is the argmax over the N hot
logits mapped back to a vocabulary id through ``ids``; where a request samples, its proposal
distribution q is the softmax of the hot logits scattered into the whole vocabulary, zero
outside the hot set. Verification needs nothing more: speculative sampling is exact for any q,
and a token outside the hot set is simply never proposed (the verifier's correction or bonus
may still be any token). The verify pass and the target's head are unchanged.

Device work only, at fixed shapes (``ids`` is a device tensor): a CUDA graph holds a draft step
with its hot head."""

from __future__ import annotations

import torch

from services.worker.model.layers import head_logits


class HotHead:
    def __init__(self, head: torch.Tensor, ids: torch.Tensor) -> None:
        """``head`` [V, d]: the MTP layer's head, every row of the vocabulary; ``ids`` [N]
        int64: the hot token ids, sorted, unique, in [0, V). The copy keeps the head's dtype."""
        vocab = head.shape[0]
        ids = ids.to(device=head.device, dtype=torch.int64)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"hot ids: a non-empty [N] tensor, got shape {tuple(ids.shape)}")
        if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise ValueError(f"hot ids: sorted, unique and in [0, {vocab})")
        self.ids = ids  # [N] int64
        self.weight = head.detach().index_select(0, ids)  # [N, d]
        self.vocab_size = vocab

    @property
    def size(self) -> int:
        """N: the hot ids."""
        return self.ids.numel()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [..., d] -> [..., N] fp32: the head's logits of the hot ids."""
        return head_logits(hidden, self.weight)

    def tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., N] hot logits -> [...] int64: the vocabulary id of each row's argmax."""
        return self.ids[logits.argmax(-1)]

    def probs(self, q: torch.Tensor) -> torch.Tensor:
        """[..., N] a distribution over the hot ids -> [..., V] the same over the vocabulary,
        zero outside the hot set."""
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        return out.scatter_(-1, self.ids.expand_as(q), q)
