"""The device page pool's free list (which pages are free; not what they hold)."""

from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int) -> None:
        self.total = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """n pages, lowest ids first; raises when fewer are free (callers check first)."""
        if n > len(self._free):
            raise RuntimeError(f"{n} pages asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
