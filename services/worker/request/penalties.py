"""A request's logit biases and penalties, applied on the logits' device over a block of rows.

OpenAI's ``logit_bias`` (added to the logits), vLLM's/HF's repetition penalty (a logit of a
token seen in the prompt or the output is divided by the penalty when positive, multiplied when
not) and OpenAI's frequency and presence penalties (``logit -= frequency * count`` then
``logit -= presence * (count > 0)``, over the output's tokens), in that order.

The output's token counts live on the device as one ``[V]`` int32 tensor that follows the
request's output: each application first counts the tokens emitted since the last one. A
request that sets none of these parameters never builds a ``Penalties``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.transfers import to_device


class Penalties:
    """One request's bias and penalty state on ``device`` over a vocabulary of ``vocab``
    (``SamplingParams``' fields of the same names; ``logit_bias``: (token id, bias) pairs of
    distinct ids)."""

    def __init__(
        self,
        logit_bias: Sequence[tuple[int, float]],
        repetition: float,
        frequency: float,
        presence: float,
        prompt_ids: Sequence[int],
        vocab: int,
        device: torch.device,
    ) -> None:
        self.repetition = repetition
        self.frequency = frequency
        self.presence = presence
        self.vocab = vocab
        self.device = device
        self.bias_ids: torch.Tensor | None = None  # [B] int64
        self.bias: torch.Tensor | None = None  # [B] fp32
        if logit_bias:
            ids, bias = zip(*logit_bias, strict=True)
            self.bias_ids = to_device(ids, device, torch.int64)
            self.bias = to_device(bias, device, torch.float32)
        counted = self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0
        # [V] int32: how often each token occurs among output_ids[:self.num_counted]
        self.counts = torch.zeros(vocab, dtype=torch.int32, device=device) if counted else None
        self.num_counted = 0
        self.in_prompt: torch.Tensor | None = None  # [V] bool, for the repetition penalty
        if self.repetition != 1.0:
            self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.in_prompt[to_device(prompt_ids, device, torch.int64)] = True

    def apply(self, logits: torch.Tensor, drafts: Sequence[int], output_ids: Sequence[int]) -> None:
        """logits: [n, V] fp32, in place; row i scores the token after ``output_ids`` and
        ``drafts[:i]`` (len(drafts) >= n - 1), so its penalties count those drafts too."""
        self._follow(output_ids)
        if self.bias_ids is not None:
            logits[:, self.bias_ids] += self.bias
        if self.counts is None:
            return
        n = logits.shape[0]
        counts = self.counts.unsqueeze(0)  # [1, V], or [n, V] with the drafts
        if n > 1:
            # row i adds one count for each of drafts[:i]: a one-hot per draft, summed down
            d = to_device(drafts[: n - 1], self.device, torch.int64)
            step = torch.zeros(n, self.vocab, dtype=torch.int32, device=self.device)
            step[1:].scatter_(1, d.unsqueeze(1), 1)
            counts = counts + step.cumsum(0, dtype=torch.int32)
        if self.repetition != 1.0:
            assert self.in_prompt is not None
            seen = (counts > 0) | self.in_prompt
            r = self.repetition
            logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
        if self.frequency != 0.0:
            logits -= self.frequency * counts
        if self.presence != 0.0:
            logits -= self.presence * (counts > 0)

    def _follow(self, output_ids: Sequence[int]) -> None:
        """Counts the output tokens emitted since the last call."""
        if self.counts is None or self.num_counted == len(output_ids):
            return
        assert self.num_counted < len(output_ids), "the output never shrinks"
        new = to_device(output_ids[self.num_counted :], self.device, torch.int64)
        self.counts.index_add_(0, new, torch.ones_like(new, dtype=torch.int32))
        self.num_counted = len(output_ids)
