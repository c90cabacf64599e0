"""The order a step's host reads are issued in (``kv.config.HostReadOrder``): a policy, apart
from the copy kernel.

The resolver queues a step's misses request by request, in whatever order the requests'
programs ran, and the copy kernel's persistent grid walks that queue a window of entries at a
time. Sorted by host address, each window covers a narrow range of the arena: the reads of a
window span a small footprint, which is what sets the rate of scattered host reads. Any order is exact: every queued copy carries its own destination row and no two share
one, so the pool ends up with the same bytes, and attention with the same inputs."""

from __future__ import annotations

import torch

# Larger than any host element offset: unused queue entries sort behind the live ones.
_PAST_END = torch.iinfo(torch.int64).max


def sort_queued(src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor, n: int) -> None:
    """Sorts the first ``count[0]`` (a device scalar) entries of ``src`` ([>= n] int64 host
    element offsets) by value, permuting ``dst`` alike, in place; ``n`` bounds the count (the
    call's selected entries). Entries from ``count[0]`` to ``n`` are left past the live ones,
    unread. No synchronisation: safe inside a captured CUDA graph."""
    if n == 0:
        return
    keys = src[:n]
    live = torch.arange(n, device=src.device) < count
    keys.masked_fill_(~live, _PAST_END)
    ordered, perm = torch.sort(keys)
    keys.copy_(ordered)
    dst[:n].copy_(dst[:n][perm])
