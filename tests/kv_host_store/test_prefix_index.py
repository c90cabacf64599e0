"""The prefix index: chained page hashes, salts, partial pages, collisions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.kv_host_store.prefix_index import Match, PrefixIndex, PrefixSalt, page_hashes

SALT = PrefixSalt("preset:tiny-glm:seed=0", "torch.float32|bf16", "auto", 4)


def test_each_complete_page_is_named_by_its_tokens_and_its_parent() -> None:
    a = page_hashes(SALT, list(range(12)))
    assert len(a) == 3 and len(set(a)) == 3
    assert page_hashes(SALT, list(range(8))) == a[:2]  # a prefix names the same pages
    # the same tokens as a second page are another page: the parent differs
    b = page_hashes(SALT, [9, 9, 9, 9, 0, 1, 2, 3])
    assert b[1] != a[0]
    # one token changed in page 0 changes every later page
    c = page_hashes(SALT, [0, 1, 2, 99, *range(4, 12)])
    assert all(x != y for x, y in zip(a, c, strict=True))


def test_a_partial_last_page_is_never_named() -> None:
    assert page_hashes(SALT, [1, 2, 3]) == []
    assert page_hashes(SALT, list(range(11))) == page_hashes(SALT, list(range(8)))
    index = PrefixIndex(4)
    with pytest.raises(ValueError, match="at least one page"):
        index.add("r", page_hashes(SALT, [1, 2, 3]), [1, 2, 3])


@pytest.mark.parametrize(
    "other",
    [
        replace(SALT, model="preset:tiny-glm:seed=1"),  # other weights
        replace(SALT, numerics="torch.bfloat16|bf16"),  # other numerics
        replace(SALT, kv_cache_dtype="fp8"),  # rows stored otherwise
        replace(SALT, page_size=8),  # pages cut otherwise
    ],
)
def test_a_salted_mismatch_never_shares(other: PrefixSalt) -> None:
    tokens = list(range(16))
    index = PrefixIndex(4)
    index.add("mine", page_hashes(SALT, tokens), tokens)
    theirs = page_hashes(other, tokens)
    assert set(theirs).isdisjoint(index.hashes("mine"))
    if other.page_size == index.page_size:
        assert index.longest_match(theirs, tokens) is None


def test_the_longest_match_and_records_that_repeat_each_other() -> None:
    index = PrefixIndex(4)
    short = list(range(8))
    long = [*short, 50, 51, 52, 53, 60, 61]  # two pages more and a partial page
    index.add("short", page_hashes(SALT, short), short)
    index.add("long", page_hashes(SALT, long), long)
    assert index.covered_by("long") == ["short"]
    assert index.covered_by("short") == []
    query = [*long[:12], 7, 7, 7, 7]  # three pages match, the fourth does not
    assert index.longest_match(page_hashes(SALT, query), query) == Match("long", 3)
    assert index.covers(page_hashes(SALT, short), short)
    index.remove("long")
    assert index.longest_match(page_hashes(SALT, query), query) == Match("short", 2)
    index.remove("short")
    assert len(index) == 0 and index.longest_match(page_hashes(SALT, query), query) is None
    assert "short" not in index


def test_a_whole_match_takes_only_a_record_that_ends_where_the_run_does() -> None:
    """A reader that takes a record's state at its end (token rings; a carry kept at the end
    only) asks for ``whole`` records: the longest one that is a prefix of its query, never a
    longer record's first pages."""
    index = PrefixIndex(4)
    short = list(range(8))
    long = [*short, 50, 51, 52, 53, 54, 55, 56, 57]
    index.add("long", page_hashes(SALT, long), long)
    query = [*long[:12], 7]  # three of long's four pages
    hashes = page_hashes(SALT, query)
    assert index.longest_match(hashes, query) == Match("long", 3)
    assert index.longest_match(hashes, query, whole=True) is None
    index.add("short", page_hashes(SALT, short), short)  # not dropped: nothing covers it yet
    assert index.longest_match(hashes, query, whole=True) == Match("short", 2)
    exact = long[:16]
    assert index.longest_match(page_hashes(SALT, exact), exact, whole=True) == Match("long", 4)


def test_a_hash_collision_never_shares_different_tokens() -> None:
    """With a digest that collides for every input, pages of other tokens have the same
    hashes; the index checks the tokens and finds only the record that holds them."""

    def collide(data: bytes) -> str:
        return "0" * 32

    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]
    ha, hb = page_hashes(SALT, a, collide), page_hashes(SALT, b, collide)
    assert ha == hb
    index = PrefixIndex(4)
    index.add("a", ha, a)
    assert index.longest_match(hb, b) == Match("a", 1)  # the first page is the same tokens
    assert index.longest_match(hb, [5, 5, 5, 5, *b[4:]]) is None
    index.add("b", hb, b)
    assert index.longest_match(hb, b) == Match("b", 2)
    assert index.longest_match(ha, a) == Match("a", 2)
    assert index.covered_by("b") == []  # "a" shares no second page with it


def test_a_record_is_indexed_once() -> None:
    index = PrefixIndex(4)
    index.add("r", page_hashes(SALT, list(range(4))), list(range(4)))
    with pytest.raises(ValueError, match="already indexed"):
        index.add("r", page_hashes(SALT, list(range(4))), list(range(4)))
    with pytest.raises(ValueError, match="page_size"):
        PrefixIndex(0)
