"""The hot cache of one KV source: B device rows per slot with LRU replacement.

State per slot (all on the device, shared by the torch reference and the Triton resolver):
``map[slot, row]`` -> hot-cache entry holding that row or -1 (a dense reverse map, so a lookup
is one gather and hit detection never scans B); ``rows[slot, e]`` -> the row in entry e or -1;
``stamp[slot, e]`` -> the resolver call that last used entry e (-1: empty). Entries with the
smallest stamp are the least recently used; empty entries are used first."""

from __future__ import annotations

import torch


class HotCache:
    def __init__(
        self, max_slots: int, entries: int, max_rows: int, device: torch.device | str
    ) -> None:
        if entries >= 2**31:
            raise ValueError("hot cache too large")
        self.entries = entries
        self.max_rows = max_rows
        # int16 halves the reverse map when entries fit (B <= 32767), as they do in practice.
        map_dtype = torch.int16 if entries <= 32767 else torch.int32
        self.map = torch.full((max_slots, max_rows), -1, dtype=map_dtype, device=device)
        self.rows = torch.full((max_slots, entries), -1, dtype=torch.int32, device=device)
        self.stamp = torch.full((max_slots, entries), -1, dtype=torch.int64, device=device)
        self.clock = 0  # resolver calls so far; a call stamps what it uses with its own tick

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def reset(self, slot: int) -> None:
        self.map[slot].fill_(-1)
        self.rows[slot].fill_(-1)
        self.stamp[slot].fill_(-1)

    @property
    def nbytes_per_slot(self) -> int:
        return self.map.shape[1] * self.map.element_size() + self.entries * (
            self.rows.element_size() + self.stamp.element_size()
        )
