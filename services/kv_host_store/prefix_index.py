"""The prefix index: complete pages of token ids named by chained hashes (DESIGN §9).

A page's hash is ``H(parent's hash, the page's token ids)``; the first page's parent is the
*salt*, a hash of everything that makes two workers' KV rows for the same tokens differ — the
model and its weights' identity, the numerics it serves with, the KV dtype and the page size.
So equal hashes mean equal tokens from the first one on, served the same way, and a salted
mismatch never shares. Only complete pages are named: a partial last page has no hash.

Hashes are 128-bit BLAKE2b digests as hex strings (they cross gRPC as strings). A collision
is still never trusted: the index keeps each record's token ids and a match checks them, so
two different prefixes never share whatever their hashes say.

Pure Python: the store names records by it, the worker computes the hashes of its requests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

Digest = Callable[[bytes], str]


def blake2b_128(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True)
class PrefixSalt:
    """What a page's rows depend on besides its tokens. ``model``: the model's identity (a
    checkpoint's path with its files' sizes and times, or a preset with its seed);
    ``numerics``: how the engine computes rows (serving dtype, weight format, attention
    backend, top-k, parallel layout); ``kv_cache_dtype`` and ``page_size`` as served."""

    model: str
    numerics: str
    kv_cache_dtype: str
    page_size: int

    def root(self, digest: Digest = blake2b_128) -> str:
        text = f"dhisparse-prefix/1|{self.model}|{self.numerics}|{self.kv_cache_dtype}"
        return digest(f"{text}|{self.page_size}".encode())


def page_hashes(
    salt: PrefixSalt, token_ids: Sequence[int], digest: Digest = blake2b_128
) -> list[str]:
    """The chained hash of each complete page of ``token_ids`` (``salt.page_size`` tokens a
    page); a partial last page is left out."""
    page = salt.page_size
    ids = np.asarray(token_ids[: len(token_ids) // page * page], dtype="<i4")
    out: list[str] = []
    parent = salt.root(digest)
    for i in range(len(ids) // page):
        parent = digest(parent.encode() + ids[i * page : (i + 1) * page].tobytes())
        out.append(parent)
    return out


@dataclass(frozen=True)
class Match:
    """The longest indexed prefix of a query: ``pages`` complete pages, all held by
    ``record`` (a record holding page i of a chain holds pages 0..i)."""

    record: Hashable
    pages: int


class PrefixIndex:
    """Records (any hashable id) by the chained hashes of their pages. A hash may name pages
    of several records (a longer conversation repeats a shorter one's pages); removing one
    record leaves the others findable by every page they hold."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._by_hash: dict[str, dict[Hashable, None]] = {}  # hash -> records (ordered set)
        self._hashes: dict[Hashable, tuple[str, ...]] = {}
        self._tokens: dict[Hashable, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, record: Hashable) -> bool:
        return record in self._hashes

    def hashes(self, record: Hashable) -> tuple[str, ...]:
        return self._hashes[record]

    def add(self, record: Hashable, hashes: Sequence[str], token_ids: Sequence[int]) -> None:
        """Indexes ``record`` holding ``len(hashes)`` complete pages of ``token_ids`` (at least
        as many tokens; the rest are ignored)."""
        n = len(hashes) * self.page_size
        if not hashes or len(token_ids) < n:
            raise ValueError(
                f"a record needs at least one page and its tokens: {len(hashes)} pages, "
                f"{len(token_ids)} tokens"
            )
        if record in self._hashes:
            raise ValueError(f"record {record!r} is already indexed")
        self._hashes[record] = tuple(hashes)
        self._tokens[record] = np.asarray(token_ids[:n], dtype=np.int64)
        for h in hashes:
            self._by_hash.setdefault(h, {})[record] = None

    def remove(self, record: Hashable) -> None:
        for h in self._hashes.pop(record):
            holders = self._by_hash[h]
            del holders[record]
            if not holders:
                del self._by_hash[h]
        del self._tokens[record]

    def longest_match(
        self, hashes: Sequence[str], token_ids: Sequence[int], whole: bool = False
    ) -> Match | None:
        """The longest run of leading pages of a query (its page ``hashes`` and ``token_ids``)
        that one record holds with the same tokens; None when not even the first page is.
        A record whose hash matches but whose tokens differ (a collision) is passed over.
        ``whole``: only a record that ends where the run does (a reader that takes a record's
        state at its end: token rings, a carry kept at the end only)."""
        p = self.page_size
        query = np.asarray(token_ids[: len(hashes) * p], dtype=np.int64)
        for i in range(len(hashes) - 1, -1, -1):  # longest first: few probes on a hit
            for record in self._by_hash.get(hashes[i], ()):
                n = (i + 1) * p
                held = self._tokens[record]
                fits = len(held) == n if whole else len(held) >= n
                if fits and np.array_equal(held[:n], query[:n]):
                    return Match(record, i + 1)
        return None

    def covers(self, hashes: Sequence[str], token_ids: Sequence[int]) -> bool:
        """Whether one record already holds every page of the query."""
        m = self.longest_match(hashes, token_ids)
        return m is not None and m.pages == len(hashes)

    def covered_by(self, record: Hashable) -> list[Hashable]:
        """Other records whose every page ``record`` holds (with the same tokens): redundant
        once ``record`` is indexed."""
        mine = self._hashes[record]
        out: list[Hashable] = []
        for h in mine:
            for r in self._by_hash[h]:
                if r == record or r in out:
                    continue
                theirs = self._hashes[r]
                n = len(theirs) * self.page_size
                if theirs[-1] == h and np.array_equal(self._tokens[r], self._tokens[record][:n]):
                    out.append(r)
        return out
