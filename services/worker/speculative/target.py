"""What speculative decoding needs of the engine that serves the target model: a narrow
interface, so the speculator neither reaches into the engine nor depends on its other parts
(the KV cache and the verify pass it is given apart: ``Speculator``)."""

from __future__ import annotations

from typing import Protocol

import torch

from services.worker.request.grammar_masks import GrammarMasks
from services.worker.request.request import Request, RequestOutput


class Target(Protocol):
    device: torch.device

    eos_token_ids: frozenset[int]  # any of them ends a request
    grammar_masks: GrammarMasks  # one pass's grammar masks: filled, then applied

    def run_pass(self, reqs: list[Request]) -> list[RequestOutput]:
        """A plain pass: one forward over each request's uncomputed tokens (one, when decoding)
        and one sampled token each; the round when speculation is off."""

    def generator(self, req: Request) -> torch.Generator:
        """The random generator ``req`` samples with (its seed's, else the engine's)."""

    def emit(self, req: Request, tokens: list[int], logits: torch.Tensor) -> RequestOutput:
        """Appends ``tokens`` (chosen from ``logits`` [len(tokens), V]) to ``req`` up to its
        first stop condition; one output for them."""
