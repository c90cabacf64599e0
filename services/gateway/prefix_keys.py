"""Routing keys of a prompt's leading pages, for prefix-affinity routing (``affinity``).

A page's key is a 64-bit BLAKE2b digest of its parent's key and the page's token ids; the first
page's parent is a root that names the page size. So equal keys mean equal tokens from the first
one on, and every gateway replica computes the same keys for the same prompt. They are the
gateway's own names, not the host store's page hashes (``kv_host_store.prefix_index``, salted
with the model's weights and numerics, which the gateway does not know): a key only says which
worker *likely* holds a prefix; the worker's store still checks the tokens on admission. Only
complete pages have keys, at most ``max_pages`` of them: prompts that agree that far are
routed alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def root_key(page_size: int) -> int:
    """The parent of a prompt's first page, for pages of ``page_size`` tokens."""
    return _digest(f"dhisparse-affinity/1|{page_size}".encode())


def chain_keys(
    token_ids: Sequence[int], page_size: int, max_pages: int, parent: int | None = None
) -> tuple[int, ...]:
    """The keys of the complete pages of ``token_ids`` (at most ``max_pages``), each chained to
    the one before; the first to ``parent`` (default: ``root_key``), so that a continuation's
    keys extend those of the tokens before it."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    pages = min(len(token_ids) // page_size, max(0, max_pages))
    data = np.asarray(token_ids[: pages * page_size], dtype="<i4").tobytes()
    step = 4 * page_size
    key = root_key(page_size) if parent is None else parent
    out: list[int] = []
    for i in range(pages):
        key = _digest(key.to_bytes(8, "little") + data[i * step : (i + 1) * step])
        out.append(key)
    return tuple(out)


class PromptPrefix:
    """One prompt's token ids and, per page size asked for, its leading pages' keys (computed
    once). ``max_pages`` bounds the pages keyed."""

    def __init__(self, token_ids: Sequence[int], max_pages: int) -> None:
        self.token_ids = tuple(token_ids)
        self.max_pages = max_pages
        self._keys: dict[int, tuple[int, ...]] = {}
        # what the affinity index matched for this prompt, by (index version, page size) and
        # place (``PrefixAffinity.predict``: one admission asks for several rankings)
        self.matched: dict[tuple[int, int], dict] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def keys(self, page_size: int) -> tuple[int, ...]:
        keys = self._keys.get(page_size)
        if keys is None:
            keys = self._keys[page_size] = chain_keys(self.token_ids, page_size, self.max_pages)
        return keys

    def continued(self, page_size: int, output_ids: Sequence[int]) -> tuple[int, ...]:
        """The keys of the prompt followed by ``output_ids``: the prompt's, extended from its
        last complete page (the pages a finished request leaves behind)."""
        keys = self.keys(page_size)
        if len(keys) >= self.max_pages:
            return keys
        rest = [*self.token_ids[len(keys) * page_size :], *output_ids]
        parent = keys[-1] if keys else None
        return keys + chain_keys(rest, page_size, self.max_pages - len(keys), parent)
