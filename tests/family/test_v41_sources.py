"""DeepSeek-V4.1's ``kv_source_layers`` / ``index_source_layers`` read from a V4 config.json:
the published schedule's roles (a layer reads the most recent source at or below it), V4's
own sources where none are named, and every combination the facts leave undefined refused by
the field's name."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

from dhisparse.family.hf_config import ConfigError
from dhisparse.family.v4_config import parse_v4_config, v4_topology
from dhisparse.family.v41_sources import parse_shared_sources
from tests.fixtures import CONFIGS

HUB = json.loads((CONFIGS / "deepseek-v4-flash" / "config.json").read_text())
# 10 layers: two sliding-only, then CSA (the published form's ratios are 2 and 1; a V4
# checkpoint's CSA rate stands in)
TEN = HUB | {"num_hidden_layers": 10, "compress_ratios": [0, 0, *[4] * 8, 0]}


def test_the_published_schedule_reads_the_most_recent_source() -> None:
    cfg = parse_v4_config(TEN | {"kv_source_layers": [2, 6], "index_source_layers": [2, 4, 6, 8]})
    share = cfg.sharing
    assert share.kv_source == (-1, -1, 2, 2, 2, 2, 6, 6, 6, 6)
    assert share.index_source == (-1, -1, 2, 2, 4, 4, 6, 6, 8, 8)
    assert [share.role(i) for i in range(10)] == [
        "sliding", "sliding", "full", "reuse", "reindex", "reuse", "full", "reuse", "reindex",
        "reuse",
    ]  # fmt: skip
    assert share.shared


def test_without_the_keys_every_layer_is_its_own_source() -> None:
    share = parse_v4_config(HUB).sharing
    kinds = parse_v4_config(HUB).attention
    assert not share.shared
    for i, kind in enumerate(kinds):
        assert share.kv_source[i] == (-1 if kind == "sliding" else i)
        assert share.index_source[i] == (i if kind == "csa" else -1)


def test_no_candidate_source_builds_no_mask_and_its_keys_are_named(caplog) -> None:
    keys = {"candidate_source_layer": -1, "candidate_block_size": 8, "candidate_topk_blocks": 2048}
    with caplog.at_level(logging.INFO):
        cfg = parse_v4_config(TEN | {"kv_source_layers": [2], "index_source_layers": [2]} | keys)
    assert cfg.sharing.kv_source[9] == 2
    assert "candidate_block_size" in caplog.text


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"kv_source_layers": [2]}, "kv_source_layers needs index_source_layers"),
        ({"index_source_layers": [2]}, "index_source_layers needs kv_source_layers"),
        ({"kv_source_layers": [3], "index_source_layers": [2, 3]}, "kv_source_layers has no layer"),
        ({"kv_source_layers": [2], "index_source_layers": [3]}, "kv_source_layers has layer 2, not"),
        ({"kv_source_layers": [1, 2], "index_source_layers": [1, 2]}, "layer 1, a sliding-only"),
        ({"kv_source_layers": [6, 2], "index_source_layers": [2, 6]}, "kv_source_layers .* ascend"),
        ({"kv_source_layers": [2, 10], "index_source_layers": [2]}, "kv_source_layers .* ascend"),
        ({"kv_source_layers": [], "index_source_layers": [2]}, "kv_source_layers must be a non"),
        ({"kv_source_layers": [2], "index_source_layers": ["2"]}, "index_source_layers must be"),
        ({"kv_source_layers": [2], "index_source_layers": [2], "candidate_source_layer": 5},
         "candidate_source_layer=5 runs no indexer"),
        ({"kv_source_layers": [2], "index_source_layers": [2], "kv_source_layer_ids": [2]},
         r"unsupported field\(s\) \['kv_source_layer_ids'\]"),
    ],
)  # fmt: skip
def test_what_the_facts_leave_undefined_is_refused_by_name(over, named) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_v4_config(TEN | over)


def test_hca_layers_with_shared_sources_are_refused_by_name() -> None:
    """V4's HCA layers have no indexer: ``index_source_layers`` has no meaning for them."""
    with pytest.raises(ConfigError, match="layer 3 heavily_compressed_attention"):
        parse_v4_config(HUB | {"kv_source_layers": [2], "index_source_layers": [2]})


def test_a_consumer_of_a_source_at_another_rate_is_refused_by_name() -> None:
    """V4's CSA layers share one rate; the rule is V4.1's (ratios 2 then 1 flip at a source)."""
    raw = {"kv_source_layers": [1], "index_source_layers": [1]}
    with pytest.raises(ConfigError, match="layer 2 compresses by 2 but reads layer 1's rows"):
        parse_shared_sources(raw, ("sliding", "csa", "csa"), (0, 4, 2))


def test_a_reindex_layer_scores_its_sources_keys_stored_once() -> None:
    """The topology: a Reindex layer is a producer over its KV source's source scoring that
    layer's keys (``keys_from``); anything else naming ``keys_from`` is refused."""
    raw = TEN | {"kv_source_layers": [2, 6], "index_source_layers": [2, 4, 6, 8]}
    cfg = v4_topology(parse_v4_config(raw), "v41")
    cfg.validate()
    assert [spec.source for spec in cfg.layers] == [-1, -1, 0, 0, 0, 0, 1, 1, 1, 1]
    assert cfg.key_layer(4) == 2 and cfg.key_layer(8) == 6
    assert cfg.key_producers == (2, 6)  # the sliding layers 0 and 1: no source, no keys
    for layer, keys_from in ((4, 6), (4, 3), (4, 0), (5, 2)):
        layers = list(cfg.layers)
        layers[layer] = replace(layers[layer], keys_from=keys_from)
        with pytest.raises(ValueError, match=f"layer {layer}: keys_from {keys_from}"):
            replace(cfg, layers=tuple(layers)).validate()
