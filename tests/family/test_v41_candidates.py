"""DeepSeek-V4.1's candidate blocks read from a V4 config.json: the source, its consumers (every
later index source), both spellings of the source's key, no mask without a source, and every
value the facts leave undefined refused by the field's name."""

from __future__ import annotations

import pytest

from dhisparse.family.hf_config import ConfigError
from dhisparse.family.v4_config import parse_v4_config
from dhisparse.family.v41_candidates import CandidateBlocks, parse_candidates
from dhisparse.family.v41_sources import parse_shared_sources
from tests.family.test_v41_sources import TEN

SOURCES = {"kv_source_layers": [2, 6], "index_source_layers": [2, 4, 6, 8]}
BLOCKS = {"candidate_block_size": 8, "candidate_topk_blocks": 2048}


@pytest.mark.parametrize("key", ["candidate_source_layer", "candidate_source_layer_id"])
def test_every_later_index_source_consumes_the_sources_blocks(key) -> None:
    """The published form at the scale of ten layers: the source an index source (4, Reindex),
    the consumers the index sources after it (6 a KV source, 8 Reindex), not the Reuse layers."""
    cfg = parse_v4_config(TEN | SOURCES | BLOCKS | {key: 4})
    assert cfg.candidates == CandidateBlocks(4, 8, 2048, consumers=(6, 8))
    assert [cfg.candidates.role(i) for i in range(10)] == [
        None, None, None, None, "source", None, "consumer", None, "consumer", None,
    ]  # fmt: skip


def test_both_spellings_agreeing_are_one_source() -> None:
    raw = TEN | SOURCES | BLOCKS | {"candidate_source_layer": 6, "candidate_source_layer_id": 6}
    assert parse_v4_config(raw).candidates.consumers == (8,)


@pytest.mark.parametrize("src", [None, -1])
def test_no_source_builds_no_mask(src) -> None:
    raw = TEN | SOURCES | BLOCKS | {"candidate_source_layer": src}
    assert parse_v4_config(raw).candidates is None


def test_without_shared_sources_every_later_csa_layer_consumes() -> None:
    """V4's own sources: every CSA layer an index source."""
    cfg = parse_v4_config(TEN | BLOCKS | {"candidate_source_layer": 7})
    assert cfg.candidates.consumers == (8, 9)


def test_the_least_blocks_that_hold_index_topk_are_enough() -> None:
    """index_topk 512: 65 blocks of 8 hold at least 64 * 8 + 1 = 513 positions."""
    raw = TEN | SOURCES | {"candidate_source_layer": 2, "candidate_block_size": 8}
    assert parse_v4_config(raw | {"candidate_topk_blocks": 65}).candidates.topk_blocks == 65
    with pytest.raises(ConfigError, match="candidate_topk_blocks=64 blocks"):
        parse_v4_config(raw | {"candidate_topk_blocks": 64})


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"candidate_source_layer": 5}, "candidate_source_layer=5 runs no indexer"),
        ({"candidate_source_layer": 0}, "candidate_source_layer=0 runs no indexer"),
        ({"candidate_source_layer": 10}, "candidate_source_layer=10 is not a layer"),
        ({"candidate_source_layer": "4"}, "candidate_source_layer='4' is not a layer index"),
        ({"candidate_source_layer_id": True}, "candidate_source_layer_id=True is not a layer"),
        ({"candidate_source_layer": 4, "candidate_source_layer_id": 6}, "disagree"),
        ({"candidate_source_layer": 4, "candidate_block_size": None}, "needs candidate_block_s"),
        ({"candidate_source_layer": 4, "candidate_topk_blocks": 0}, "candidate_topk_blocks=0 m"),
        ({"candidate_source_layer": 4, "candidate_block_size": 2.0}, "candidate_block_size=2.0"),
        ({"candidate_source_layer": 4, "candidate_topk_blocks": 2, "candidate_block_size": 2},
         "cannot|fewer than the index_topk=512"),
    ],
)  # fmt: skip
def test_what_the_facts_leave_undefined_is_refused_by_name(over, named) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_v4_config(TEN | SOURCES | BLOCKS | over)


def test_a_consumer_at_another_rate_is_refused_by_name() -> None:
    """V4's CSA layers share one rate; V4.1's flip from 2 to 1 at a source."""
    kinds, rates = ("sliding", "csa", "csa", "csa"), (0, 2, 2, 1)
    raw = {"kv_source_layers": [1, 3], "index_source_layers": [1, 2, 3]}
    sharing = parse_shared_sources(raw, kinds, rates)
    assert parse_candidates(raw | BLOCKS | {"candidate_source_layer": 3}, sharing, rates, 8)
    with pytest.raises(ConfigError, match="layer 3, an index source after it, by 1"):
        parse_candidates(raw | BLOCKS | {"candidate_source_layer": 1}, sharing, rates, 8)
