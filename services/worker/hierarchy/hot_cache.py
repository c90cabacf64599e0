"""The hot cache of one KV source: B device rows per slot with LRU replacement.

State per slot (on the device, shared by the torch reference and the Triton resolver):

- ``map[slot, row]``: the entry holding that row, or -1. A dense reverse map, so a lookup is
  one gather and hit detection never scans B (2 bytes per row of history while B <= 32767).
- ``rows[slot, e]``: the row held by entry e, or -1.
- ``lru[slot, :]``: the entries from least to most recently used (empty entries first).
- ``stamp[slot, e]``: the resolver call that last used entry e. Within a call, an entry stamped
  with the call's tick is protected: it holds a row selected in this call.
- ``clock``: resolver calls so far, a device scalar the resolvers read, so a captured decode
  pass (a CUDA graph) ticks it on every replay.

A call moves every entry it used to the most-recent end, keeping the relative order of the
entries it did not touch, so victims are always the least recently used unselected rows."""

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
        map_dtype = torch.int16 if entries <= 32767 else torch.int32
        self.map = torch.full((max_slots, max_rows), -1, dtype=map_dtype, device=device)
        self.rows = torch.full((max_slots, entries), -1, dtype=torch.int32, device=device)
        self.lru = torch.arange(entries, dtype=torch.int32, device=device).repeat(max_slots, 1)
        self.stamp = torch.full((max_slots, entries), -1, dtype=torch.int64, device=device)
        self.clock = torch.zeros((), dtype=torch.int64, device=device)

    def tick(self) -> torch.Tensor:
        """Advances the clock (on the device: no host value to bake into a graph)."""
        self.clock += 1
        return self.clock

    def reset(self, slot: int) -> None:
        self.map[slot].fill_(-1)
        self.rows[slot].fill_(-1)
        self.lru[slot] = torch.arange(self.entries, dtype=torch.int32, device=self.lru.device)
        self.stamp[slot].fill_(-1)

    @property
    def nbytes_per_slot(self) -> int:
        per_entry = self.rows.element_size() + self.lru.element_size() + self.stamp.element_size()
        return self.map.shape[1] * self.map.element_size() + self.entries * per_entry
