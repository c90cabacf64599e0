"""Paged row storage: a pool of fixed-size pages and per-slot page tables.

A pool either owns its memory and free list, or *borrows* both (``SharedPages``): the index keys
of the hierarchy modes live in pages of the payload's device page pool, so they come out of the
same budget as hot caches, tails and optional history (eq. 3), instead of a reservation sized
for every slot at full length."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.ops.fusion import fused
from services.worker.ops.page_locations import page_locations, page_locations_ref
from services.worker.transfers import to_device


class PagePool:
    """A free list of page ids (which pages are free; not what they hold). A page is held by
    slots (``take``, then ``share`` for each further slot) and by cached prefixes (``cache``,
    ``serving.device_prefix``, ``serving.key_records``), each counted; it is free again when
    nothing holds it.

    With a ``reclaim`` hook (it drops one cached prefix, False when there is none), pages only
    cached prefixes hold count as ``available`` and ``take`` drops prefixes until it has its
    pages: cached prefixes give way to every other use of the pool."""

    def __init__(self, num_pages: int) -> None:
        self.total = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._slots = [0] * num_pages  # slots holding each page
        self._cached = [0] * num_pages  # cached prefixes holding each page
        self.cached_only = 0  # pages that only cached prefixes hold (reclaimable)
        self.reclaim: Callable[[], bool] | None = None

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def reclaimable(self) -> int:
        """Pages a ``take`` may have from cached prefixes: with a ``reclaim`` hook, those only
        they hold."""
        return self.cached_only if self.reclaim is not None else 0

    @property
    def available(self) -> int:
        """Pages a ``take`` can have: the free ones and the ``reclaimable``."""
        return len(self._free) + self.reclaimable

    def take(self, n: int) -> list[int]:
        """n pages, lowest free ids first, held by one slot; drops cached prefixes (``reclaim``)
        while fewer are free; raises when fewer are ``available`` (callers check first)."""
        while n > len(self._free) and self.reclaim is not None and self.reclaim():
            pass
        if n > len(self._free):
            raise RuntimeError(f"{n} pages asked, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._slots[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more slot holds each of ``pages`` (held already: by a slot or a prefix)."""
        for p in pages:
            if self._slots[p] == 0:
                if self._cached[p] == 0:
                    raise RuntimeError(f"page {p} is free: nothing to share")
                self.cached_only -= 1
            self._slots[p] += 1

    def give(self, pages: list[int]) -> None:
        """A slot lets go of ``pages``; those nothing else holds are free again."""
        freed = []
        for p in pages:
            self._slots[p] -= 1
            if self._slots[p] == 0:
                if self._cached[p]:
                    self.cached_only += 1
                else:
                    freed.append(p)
        self._free.extend(reversed(freed))

    def cache(self, pages: list[int]) -> None:
        """A cached prefix holds ``pages`` (a slot holds them now) until ``uncache``."""
        for p in pages:
            if self._slots[p] == 0:
                raise RuntimeError(f"page {p} is held by no slot: nothing to cache")
            self._cached[p] += 1

    def uncache(self, pages: list[int]) -> None:
        """A cached prefix lets go of ``pages``; those nothing else holds are free again."""
        freed = []
        for p in pages:
            self._cached[p] -= 1
            if self._cached[p] == 0 and self._slots[p] == 0:
                self.cached_only -= 1
                freed.append(p)
        self._free.extend(reversed(freed))


@dataclass(frozen=True)
class SharedPages:
    """Pages lent by another pool: ``memory`` is the lender's page storage, contiguous,
    ``pool.total`` pages of equal size; ``pages`` hands them out."""

    memory: torch.Tensor
    pages: PagePool

    def view(self, width: int) -> tuple[torch.Tensor, int]:
        """(the memory as rows of ``width`` elements, rows per page)."""
        per_page = self.memory.numel() // self.pages.total
        if per_page % width:
            raise ValueError(
                f"a page of {per_page} elements does not hold whole rows of {width}: choose a "
                f"page size that makes page_size * d_kv a multiple of {width}"
            )
        return self.memory.view(-1).view(-1, width), per_page // width

    def fit(self, width: int) -> int:
        """The narrowest row of at least ``width`` elements that whole pages hold (rows of
        another width than the lender's, e.g. FP8 index keys in pages of FP8 rows: padded)."""
        per_page = self.memory.numel() // self.pages.total
        return next(w for w in range(width, per_page + 1) if per_page % w == 0)


class PagedRows:
    """Pages of ``page_size`` rows of ``width`` elements, handed to engine slots: its own
    ``num_pages`` pages, or those of ``shared``.

    A slot's row ``i`` lives at location ``page_table[slot, i // p] * p + i % p`` of ``data``.
    Allocation is all-or-nothing (``ensure`` either covers the rows or changes nothing).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        width: int,
        max_slots: int,
        max_rows_per_slot: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shared: SharedPages | None = None,
    ) -> None:
        self.width = width
        if shared is None:
            self.data = torch.zeros(num_pages * page_size, width, dtype=dtype, device=device)
            self.free_list = PagePool(num_pages)
            self.owns_memory = True
        else:
            self.data, page_size = shared.view(width)
            self.free_list = shared.pages
            self.owns_memory = False
        self.page_size = page_size
        self.num_pages = self.free_list.total
        self.max_pages_per_slot = max(1, math.ceil(max_rows_per_slot / page_size))
        self.page_table = torch.full(
            (max_slots, self.max_pages_per_slot), -1, dtype=torch.int64, device=device
        )
        self._pages: list[list[int]] = [[] for _ in range(max_slots)]
        self._held = 0

    @property
    def num_free_pages(self) -> int:
        return self.free_list.available

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages slots hold (a page several slots share, once)."""
        if not self.owns_memory:  # a lender's pages: this pool's own, never shared
            return self._held * self.page_size * self.row_bytes
        held = self.num_pages - self.free_list.free - self.free_list.cached_only
        return held * self.page_size * self.row_bytes

    @property
    def cached_bytes(self) -> int:
        """Bytes of the pages only cached prefixes hold: reclaimed before a slot waits."""
        return self.free_list.cached_only * self.page_size * self.row_bytes

    @property
    def nbytes(self) -> int:
        """Device bytes this pool allocated (none when its pages are borrowed)."""
        return self.data.numel() * self.data.element_size() if self.owns_memory else 0

    @property
    def row_bytes(self) -> int:
        return self.width * self.data.element_size()

    def pages_needed(self, slot: int, num_rows: int) -> int:
        return max(0, math.ceil(num_rows / self.page_size) - len(self._pages[slot]))

    def rows_room(self, slot: int) -> int:
        """Rows of ``slot`` its pages hold."""
        return len(self._pages[slot]) * self.page_size

    def ensure(self, slot: int, num_rows: int) -> bool:
        """Makes rows ``0 .. num_rows-1`` of ``slot`` addressable; False if pages ran out."""
        need = self.pages_needed(slot, num_rows)
        if need == 0:
            return True
        held = len(self._pages[slot])
        if need > self.free_list.available or held + need > self.max_pages_per_slot:
            return False
        new = self.free_list.take(need)
        self._pages[slot].extend(new)
        self._held += need
        self.page_table[slot, held : held + need] = to_device(new, self.page_table.device)
        return True

    def seat(self, slot: int, pages: list[int]) -> None:
        """Makes ``pages`` (held by a cached prefix) the first pages of empty ``slot``, shared:
        their rows are read, never written (a slot writes past its shared pages)."""
        if self._pages[slot]:
            raise RuntimeError(f"slot {slot} holds pages already")
        if len(pages) > self.max_pages_per_slot:
            raise ValueError(f"{len(pages)} pages exceed a slot's {self.max_pages_per_slot}")
        self.free_list.share(pages)
        self._pages[slot] = list(pages)
        self._held += len(pages)
        if pages:
            self.page_table[slot, : len(pages)] = to_device(pages, self.page_table.device)

    def copy_pages(self, slot: int, pages: list[int], at: int) -> None:
        """Copies the rows of ``pages`` into ``slot``'s pages ``at``, ``at + 1``, ..."""
        p = self.page_size
        for i, src in enumerate(pages):
            dst = self._pages[slot][at + i]
            self.data[dst * p : (dst + 1) * p] = self.data[src * p : (src + 1) * p]

    def slot_pages(self, slot: int, n: int) -> list[int]:
        """The first ``n`` pages of ``slot`` (fewer when it holds fewer)."""
        return self._pages[slot][:n]

    def release(self, slot: int) -> int:
        pages = self._pages[slot]
        self.free_list.give(pages)
        n = len(pages)
        self._held -= n
        self._pages[slot] = []
        self.page_table[slot].fill_(-1)
        return n

    def locations(self, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """slots [N] (or rows' shape), rows [N, ...]: the rows' locations in ``data``, of rows'
        shape; ``-1`` rows map to ``-1``. Fused, one kernel."""
        if fused(rows, "page_locations"):
            return page_locations(self.page_table, self.page_size, slots, rows)
        return page_locations_ref(self.page_table, self.page_size, slots, rows)

    def write(self, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.data[self.locations(slots, rows)] = values.to(self.data.dtype)

    def gather_padded(
        self, slots: torch.Tensor, num_rows: torch.Tensor, max_rows: int | None = None
    ) -> torch.Tensor:
        """Rows ``0 .. num_rows[i]-1`` of each slot, zero-padded: [R, max(num_rows), width].
        ``max_rows``: max(num_rows) if the caller knows it (else read back: a device sync)."""
        locs = self.padded_locations(slots, num_rows, max_rows)
        out = self.data[locs.clamp(min=0)]
        return out.masked_fill((locs < 0).unsqueeze(-1), 0)

    def padded_locations(
        self, slots: torch.Tensor, num_rows: torch.Tensor, max_rows: int | None = None
    ) -> torch.Tensor:
        """[R, max(num_rows)] locations of rows ``0 .. num_rows[i]-1`` of each slot, ``-1``
        beyond (see ``gather_padded``)."""
        if max_rows is not None:
            lmax = max_rows
        else:
            lmax = int(num_rows.max()) if num_rows.numel() else 0
        rows = torch.arange(lmax, device=slots.device).unsqueeze(0).expand(len(slots), lmax)
        rows = torch.where(rows < num_rows.unsqueeze(1), rows, torch.full_like(rows, -1))
        return self.locations(slots, rows)


class PagedGroup:
    """Several ``PagedRows`` pools that grow together, one per key (a source, or an index
    producer), each holding ``tokens // compress[key]`` rows for a slot's tokens. Growth is
    all-or-nothing across the group. With ``shared``, every pool borrows pages from it (and
    ``tokens_capacity`` and ``page_size`` are unused: the lender sets both)."""

    def __init__(
        self,
        compress: dict[int, int],
        width: int,
        tokens_capacity: int,
        page_size: int,
        max_slots: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shared: SharedPages | None = None,
    ) -> None:
        self.compress = compress
        self.shared = shared
        self.pools: dict[int, PagedRows] = {
            key: PagedRows(
                -(-tokens_capacity // m // page_size) + max_slots,
                page_size,
                width,
                max_slots,
                max_model_len // m,
                dtype,
                device,
                shared,
            )
            for key, m in compress.items()
        }

    def rows(self, key: int, num_tokens: int) -> int:
        return num_tokens // self.compress[key]

    def pages_needed(self, slot: int, num_tokens: int) -> int:
        """Pages the slot's first ``num_tokens`` tokens still need, over all pools."""
        return sum(
            p.pages_needed(slot, self.rows(key, num_tokens)) for key, p in self.pools.items()
        )

    def tokens_room(self, slot: int) -> int:
        """The most tokens ``slot`` holds without a new page in any pool."""
        return min(
            (p.rows_room(slot) + 1) * self.compress[key] - 1 for key, p in self.pools.items()
        )

    def pages_for(self, num_tokens: int) -> int:
        """Pages a fresh slot needs for ``num_tokens`` tokens, over all pools."""
        return sum(-(-self.rows(key, num_tokens) // p.page_size) for key, p in self.pools.items())

    def can_ensure(self, slot: int, num_tokens: int) -> bool:
        if self.shared is not None:
            return self.pages_needed(slot, num_tokens) <= self.shared.pages.available
        return all(
            p.pages_needed(slot, self.rows(key, num_tokens)) <= p.num_free_pages
            for key, p in self.pools.items()
        )

    def ensure(self, slot: int, num_tokens: int) -> bool:
        """Room for a slot's first ``num_tokens`` tokens in every pool, or no change at all."""
        if not self.can_ensure(slot, num_tokens):
            return False
        for key, p in self.pools.items():
            ok = p.ensure(slot, self.rows(key, num_tokens))
            assert ok
        return True

    def release(self, slot: int) -> None:
        for p in self.pools.values():
            p.release(slot)

    # ---- sharing whole pages of a prefix (``serving.device_prefix``) ------------------------
    def prefix_pages(self, slot: int, num_tokens: int) -> dict[int, list[int]]:
        """By pool, the pages holding the rows of ``slot``'s first ``num_tokens`` tokens (a
        multiple of the page size of every pool's rows)."""
        return {
            key: p.slot_pages(slot, self.rows(key, num_tokens) // p.page_size)
            for key, p in self.pools.items()
        }

    def seat(self, slot: int, pages: dict[int, list[int]]) -> None:
        """``pages`` (``prefix_pages`` of a cached prefix) as the first pages of empty
        ``slot``, shared."""
        for key, p in self.pools.items():
            p.seat(slot, pages[key])

    def copy_pages(
        self, slot: int, pages: dict[int, list[int]], after: dict[int, list[int]]
    ) -> None:
        """Copies ``pages`` into ``slot``'s pages that follow its ``after`` pages, by pool."""
        for key, p in self.pools.items():
            p.copy_pages(slot, pages[key], len(after[key]))

    def cache(self, pages: dict[int, list[int]]) -> None:
        for key, p in self.pools.items():
            p.free_list.cache(pages[key])

    def uncache(self, pages: dict[int, list[int]]) -> None:
        for key, p in self.pools.items():
            p.free_list.uncache(pages[key])

    @property
    def cached_bytes(self) -> int:
        return sum(p.cached_bytes for p in self.pools.values())

    @property
    def used_bytes(self) -> int:
        return sum(p.used_bytes for p in self.pools.values())

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())
