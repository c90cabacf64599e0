"""A progress bar over a benchmark's cases when tqdm is installed; the plain items if not."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str) -> Iterable[T]:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return items
    return tqdm(items, desc=desc)
