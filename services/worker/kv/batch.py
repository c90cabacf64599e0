"""What one forward pass computes: a chunk of new tokens for each request in the batch."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from services.worker.transfers import to_device


@dataclass(frozen=True)
class ForwardBatch:
    """Request i of the batch occupies engine slot ``slots[i]``, already has ``starts[i]`` tokens
    in its KV state and adds ``lens[i]`` tokens at positions ``starts[i] ..``. Prefill, decode
    (lens all 1) and speculative verification (lens = K_r) are all such chunks.

    ``prefill``: every chunk is a prefill chunk, rows of its request's imported history (its
    prompt, or a preempted request's recompute); one with ``starts[i] > 0`` continues a prefill
    whose earlier chunks ran in earlier passes.

    ``sources``: the KV sources this pass writes, when not every one (an MTP-only draft pass
    writes the MTP layer's source alone); the others' rows, and their tails, are left as
    they are."""

    slots: torch.Tensor  # [R] int64
    starts: tuple[int, ...]
    lens: tuple[int, ...]
    positions: torch.Tensor  # [N] int64, absolute position of each new token
    token_req: torch.Tensor  # [N] int64, batch index of each token's request
    token_slot: torch.Tensor  # [N] int64
    cu_lens: torch.Tensor  # [R + 1] int64
    starts_t: torch.Tensor  # [R] int64
    slot_ids: tuple[int, ...] = ()  # ``slots`` on the host: reading it never waits for the GPU
    prefill: bool = False
    sources: tuple[int, ...] | None = None  # the sources this pass writes (None: all)

    @staticmethod
    def build(
        slots: list[int],
        starts: list[int],
        lens: list[int],
        device: torch.device | str,
        prefill: bool = False,
        sources: tuple[int, ...] | None = None,
    ) -> ForwardBatch:
        if not (len(slots) == len(starts) == len(lens)) or not slots:
            raise ValueError("a batch needs one slot, start and length per request")
        if min(lens) < 1:
            raise ValueError("every request in a batch adds at least one token")
        r = len(lens)
        if max(lens) == 1:  # a decode step, every step: one copy, the fewest host ops
            d = to_device([*slots, *starts, *range(r + 1)], device)
            slots_d, starts_d, cu_d = d[:r], d[r : 2 * r], d[2 * r :]
            return ForwardBatch(
                slots=slots_d, starts=tuple(starts), lens=tuple(lens), positions=starts_d,
                token_req=cu_d[:r], token_slot=slots_d, cu_lens=cu_d, starts_t=starts_d,
                slot_ids=tuple(slots), prefill=prefill, sources=sources,
            )  # fmt: skip
        lens_t, starts_t = torch.tensor(lens), torch.tensor(starts)
        token_req = torch.repeat_interleave(torch.arange(r), lens_t)
        cu = torch.zeros(r + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lens_t, 0)
        n = int(cu[-1])
        positions = starts_t[token_req] + (torch.arange(n) - cu[token_req])
        slots_t = torch.tensor(slots, dtype=torch.int64)
        d = to_device(
            torch.cat([slots_t, starts_t, cu, positions, token_req, slots_t[token_req]]), device
        )
        parts = torch.split(d, [r, r, r + 1, n, n, n])
        return ForwardBatch(
            slots=parts[0], starts=tuple(starts), lens=tuple(lens), positions=parts[3],
            token_req=parts[4], token_slot=parts[5], cu_lens=parts[2], starts_t=parts[1],
            slot_ids=tuple(slots), prefill=prefill, sources=sources,
        )  # fmt: skip

    def imports(self, r: int) -> bool:
        """Whether request r's chunk is imported history: a prefill chunk, or any chunk that
        starts a request's rows (decode steps and verify rounds never do)."""
        return self.prefill or self.starts[r] == 0

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
