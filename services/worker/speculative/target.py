"""What speculative decoding needs of the engine that serves the target model: a narrow
interface, so the speculator neither reaches into the engine nor depends on its other parts."""

from __future__ import annotations

from typing import Protocol

import torch

from services.worker.kv.batch import ForwardBatch
from services.worker.request.request import Request, RequestOutput


class Target(Protocol):
    device: torch.device

    @property
    def max_model_len(self) -> int: ...

    eos_token_ids: frozenset[int]  # any of them ends a request

    def run_pass(self, reqs: list[Request]) -> list[RequestOutput]:
        """A plain pass: one forward over each request's uncomputed tokens (one, when decoding)
        and one sampled token each; the round when speculation is off."""

    def forward_logits(
        self, tokens: torch.Tensor, batch: ForwardBatch, features: dict | None = None
    ) -> torch.Tensor:
        """[N, V] fp32 logits of every new token of a decode or verify ``batch``; writes the
        pass's rows into the KV cache, uncommitted."""

    def ensure_room(self, slot: int, num_tokens: int) -> bool:
        """KV room for a slot's first ``num_tokens`` tokens; False changes nothing."""

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        """The first ``num_tokens[r]`` tokens of each request of ``batch`` are final."""

    def generator(self, req: Request) -> torch.Generator:
        """The random generator ``req`` samples with (its seed's, else the engine's)."""

    def emit(self, req: Request, tokens: list[int], logits: torch.Tensor) -> RequestOutput:
        """Appends ``tokens`` (chosen from ``logits`` [len(tokens), V]) to ``req`` up to its
        first stop condition; one output for them."""
