"""What one forward pass computes: a chunk of new tokens for each request in the batch."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    """Request i of the batch occupies engine slot ``slots[i]``, already has ``starts[i]`` tokens
    in its KV state and adds ``lens[i]`` tokens at positions ``starts[i] ..``. Prefill, decode
    (lens all 1) and speculative verification (lens = K_r) are all such chunks."""

    slots: torch.Tensor  # [R] int64
    starts: tuple[int, ...]
    lens: tuple[int, ...]
    positions: torch.Tensor  # [N] int64, absolute position of each new token
    token_req: torch.Tensor  # [N] int64, batch index of each token's request
    token_slot: torch.Tensor  # [N] int64
    cu_lens: torch.Tensor  # [R + 1] int64
    starts_t: torch.Tensor  # [R] int64
    slot_ids: tuple[int, ...] = ()  # ``slots`` on the host: reading it never waits for the GPU

    @staticmethod
    def build(
        slots: list[int], starts: list[int], lens: list[int], device: torch.device | str
    ) -> ForwardBatch:
        if not (len(slots) == len(starts) == len(lens)) or not slots:
            raise ValueError("a batch needs one slot, start and length per request")
        if min(lens) < 1:
            raise ValueError("every request in a batch adds at least one token")
        starts_t = torch.tensor(starts, dtype=torch.int64)
        if max(lens) == 1:  # a decode step, every step: the fewest host ops
            token_req = torch.arange(len(lens))
            cu = torch.arange(len(lens) + 1)
            positions = starts_t.clone()
        else:
            lens_t = torch.tensor(lens, dtype=torch.int64)
            token_req = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
            cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(lens_t, 0)
            positions = starts_t[token_req] + (torch.arange(int(cu[-1])) - cu[token_req])
        slots_t = torch.tensor(slots, dtype=torch.int64)
        return ForwardBatch(
            slots=slots_t.to(device),
            starts=tuple(starts),
            lens=tuple(lens),
            positions=positions.to(device),
            token_req=token_req.to(device),
            token_slot=slots_t[token_req].to(device),
            cu_lens=cu.to(device),
            starts_t=starts_t.to(device),
            slot_ids=tuple(slots),
        )

    @property
    def num_requests(self) -> int:
        return len(self.lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lens))

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.lens)

    @property
    def last_token_index(self) -> torch.Tensor:
        """[R] index of each request's last new token."""
        return self.cu_lens[1:] - 1

    @functools.cached_property
    def cu(self) -> tuple[int, ...]:
        """``cu_lens`` on the host (read per request in loops: computed once)."""
        return (0, *itertools.accumulate(self.lens))

    def ends(self) -> list[int]:
        return [s + n for s, n in zip(self.starts, self.lens, strict=True)]
