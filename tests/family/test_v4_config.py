"""DeepSeek-V4's config.json read as the hub ships it and as transformers 5.17.0 writes it, both
folded the way ``DeepseekV4Config`` folds them (the oracle); keys without effect on the math are
named in one log line, values that change it are refused by name."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch
from transformers import DeepseekV4Config

from dhisparse.family.config import SourceSpec
from dhisparse.family.hf_config import ConfigError
from dhisparse.family.v4_config import V4Config, parse_v4_config, v4_state_rings, v4_topology
from services.worker.model.v4_decoder import V4Decoder
from tests.fixtures import CONFIGS

HUB = CONFIGS / "deepseek-v4-flash" / "config.json"
SAVED = CONFIGS / "transformers-5.17" / "deepseek-v4-flash" / "config.json"
_KIND = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
         "hca": "heavily_compressed_attention"}  # fmt: skip


def _read(path) -> dict:
    return json.loads(path.read_text())


def _agrees_with_transformers(raw: dict, cfg: V4Config) -> None:
    """Our fold of ``raw`` is transformers' fold of it."""
    ref = DeepseekV4Config(**raw)
    assert [_KIND[k] for k in cfg.attention] == ref.layer_types
    rates = [0 if k == "sliding" else ref.compress_rates[_KIND[k]] for k in cfg.attention]
    assert list(cfg.compress) == rates
    assert [{"hash": "hash_moe", "moe": "moe"}[k] for k in cfg.mlp] == ref.mlp_layer_types
    assert cfg.rope_dim == ref.qk_rope_head_dim
    for spec, params in ((cfg.main_rope, ref.rope_parameters["main"]),
                         (cfg.compress_rope, ref.rope_parameters["compress"])):  # fmt: skip
        assert spec.kind == params["rope_type"]
        assert spec.theta == params["rope_theta"]
        if spec.kind == "yarn":
            assert spec.factor == params["factor"]
            assert spec.original_max_position == params["original_max_position_embeddings"]
            assert spec.attention_factor == params["attention_factor"]


def test_the_hub_form_and_the_form_transformers_writes_are_the_same_model() -> None:
    hub, saved = _read(HUB), _read(SAVED)
    cfg = parse_v4_config(hub)
    assert parse_v4_config(saved) == cfg
    _agrees_with_transformers(hub, cfg)
    _agrees_with_transformers(saved, cfg)
    assert cfg.num_layers == 43 and len(cfg.attention) == 43
    assert (cfg.attention.count("sliding"), cfg.attention.count("csa"),
            cfg.attention.count("hca")) == (2, 21, 20)  # fmt: skip
    assert cfg.compress[:4] == (0, 0, 4, 128)
    assert cfg.mlp[:4] == ("hash", "hash", "hash", "moe")
    assert (cfg.num_heads, cfg.head_dim, cfg.rope_dim) == (64, 512, 64)
    assert (cfg.n_routed, cfg.top_k, cfg.routed_scaling) == (256, 6, 1.5)
    assert cfg.main_rope.kind == "default" and cfg.main_rope.theta == 10000
    assert cfg.compress_rope.kind == "yarn" and cfg.compress_rope.theta == 160000
    assert cfg.compress_rope.table_factor == 1.0
    assert cfg.softmax_scale == pytest.approx(512**-0.5)
    assert cfg.expert_dtype == "fp4" and cfg.mtp_layers == 1


def test_the_pro_config_is_read_with_its_figures() -> None:
    """DeepSeek-V4-Pro's config.json (``tests/fixtures/configs/deepseek-v4-pro``): folded as
    transformers folds it, with the figures of notes §3.1 / §3.4 (30 CSA and 31 HCA layers, no
    sliding one; 128 heads; top-1024; 384 experts) and, built on ``meta``, transformers'
    parameter count (§3.5) plus the 58 learned-routing layers' correction biases."""
    raw = _read(CONFIGS / "deepseek-v4-pro" / "config.json")
    cfg = parse_v4_config(raw)
    _agrees_with_transformers(raw, cfg)
    assert cfg.num_layers == 61 and cfg.compress[:3] == (128, 128, 4)
    assert [cfg.attention.count(k) for k in ("sliding", "csa", "hca")] == [0, 30, 31]
    assert (cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.index_topk) == (128, 512, 7168, 1024)
    assert (cfg.n_routed, cfg.top_k, cfg.routed_scaling) == (384, 6, 2.5)
    assert cfg.mlp.count("hash") == 3 and cfg.mtp_layers == 1 and cfg.expert_dtype == "fp4"
    with torch.device("meta"):
        net = V4Decoder(cfg, None)
    assert sum(p.numel() for p in net.parameters()) == 1_572_997_179_491 + 58 * 384


@pytest.mark.parametrize(
    "over",
    [
        {},  # transformers' defaults: 2 HCA, then CSA / HCA alternating, 3 hash layers
        {"num_hidden_layers": 5, "compress_ratios": [0, 4, 128, 4, 0, 0], "num_hash_layers": 1},
        {"num_hidden_layers": 3, "compress_ratios": [4, 128, 0], "compress_rate_hca": 16},
        {"num_hidden_layers": 2, "qk_rope_head_dim": 32, "head_dim": 128,
         "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 4096}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e4}},
    ],
)  # fmt: skip
def test_legacy_and_default_keys_fold_as_transformers_folds_them(over: dict) -> None:
    raw = {"model_type": "deepseek_v4"} | over
    _agrees_with_transformers(raw, parse_v4_config(raw))


def test_a_key_without_effect_on_the_math_is_named_in_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = _read(SAVED) | {"output_router_logits": True}
    with caplog.at_level(logging.INFO, logger="dhisparse.family.v4_config"):
        parse_v4_config(raw)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "output_router_logits" in line and "no effect" in line


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"compress_ratios": [0, 16]}, "compress_ratios"),
        ({"layer_types": ["full_attention"] * 43}, "layer_types"),
        ({"mlp_layer_types": ["dense"] * 43}, "mlp_layer_types"),
        ({"o_groups": 7}, "o_groups"),
        ({"kv_lora_rank": 512}, "kv_lora_rank"),
        ({"expert_dtype": "int4"}, "expert_dtype"),
    ],
)
def test_a_value_that_changes_the_math_is_refused_by_name(over: dict, named: str) -> None:
    raw = _read(HUB)
    if "layer_types" in over or "mlp_layer_types" in over:
        raw = _read(SAVED)
    if named == "compress_ratios":
        raw.pop("compress_ratios")
    with pytest.raises(ConfigError, match=named):
        parse_v4_config(raw | over)


def test_rope_that_changes_the_math_is_refused() -> None:
    raw = _read(HUB)
    with pytest.raises(ConfigError, match="llama3"):
        parse_v4_config(raw | {"rope_scaling": {"type": "llama3", "factor": 8}})
    with pytest.raises(ConfigError, match="mscale"):
        parse_v4_config(raw | {"rope_scaling": raw["rope_scaling"] | {"mscale": 1.0}})


def test_the_released_mtp_layer_is_a_sliding_layer_lagging_by_one() -> None:
    """The hub config's trailing ``compress_ratios`` entry (the MTP layer's) is 0 in the Flash
    release, so the MTP topology adds a sliding source of the window's width that lags by one
    and keeps no history (its rows only in its window's ring) — valid — while a lag on a
    compressed source is not; the config transformers writes has no such entry and gives the
    same."""
    hub, saved = parse_v4_config(_read(HUB)), parse_v4_config(_read(SAVED))
    assert hub.mtp_compress == saved.mtp_compress == 0
    topo = v4_topology(hub, "flash", mtp=True)
    topo.validate()
    n, mtp = hub.num_layers, len(topo.sources) - 1  # the sliding layers have no source
    assert topo.draft_layers == (n,) and topo.layers[n].source == mtp == 41
    assert topo.sources[mtp] == SourceSpec(
        compress=1, window=hub.sliding_window, lag=1, stored=False
    )
    assert topo.stored_sources == range(mtp) and topo.rows_for_tokens(mtp, 1000) == 0
    assert topo.extra["carry_width"] == hub.hc_mult * hub.hidden_size
    lagged = replace(topo, sources=(*topo.sources[:mtp], SourceSpec(compress=4, window=128, lag=1)))
    with pytest.raises(ValueError, match="a lag is >= 0, on an uncompressed source"):
        lagged.validate()


def test_a_source_that_keeps_no_history_is_a_window_one_keyless_layer_reads_last() -> None:
    """``stored=False`` (the MTP layer's source) is refused on a source without a window, on
    one a producer reads, and before a stored source."""
    topo = v4_topology(parse_v4_config(_read(HUB)), "flash", mtp=True)
    mtp, layer = len(topo.sources) - 1, len(topo.layers) - 1
    unstored = topo.sources[mtp]
    layers = list(topo.layers)
    for bad, why in (
        (replace(topo, sources=(*topo.sources[:mtp], replace(unstored, window=0))), "windowed"),
        (
            replace(topo, layers=(*layers[:layer], replace(layers[layer], index="producer"))),
            'index "none"',
        ),
        (replace(topo, sources=(*topo.sources, SourceSpec())), "follows every stored one"),
    ):
        with pytest.raises(ValueError, match=why):
            bad.validate()


def test_a_sliding_layer_has_no_source_and_keyless_layers_no_keys() -> None:
    """The released Flash topology: its two sliding layers have no source (their windows are
    rings of their own, ``v4_state_rings``), its HCA layers and the MTP layer hold no index
    keys; a layer without a source must be keyless and no draft layer."""
    hub = parse_v4_config(_read(HUB))
    topo = v4_topology(hub, "flash", mtp=True)
    assert [topo.layers[i].source for i in (0, 1)] == [-1, -1]
    assert len(topo.sources) == 21 + 20 + 1  # CSA, HCA, the MTP layer's
    csa = tuple(i for i, kind in enumerate(hub.attention) if kind == "csa")
    assert topo.key_producers == csa
    windows = [layer for layer, part, _, _ in v4_state_rings(hub) if part == "window"]
    assert windows == [0, 1]
    layers = list(topo.layers)
    for i, bad, why in (
        (0, replace(layers[0], index="producer"), "unknown source -1"),
        (0, replace(layers[0], draft=True), "must follow every target layer"),
        (2, replace(layers[2], source=-1, index="none"), "source 0 is read by no layer"),
    ):
        with pytest.raises(ValueError, match=why):
            replace(topo, layers=(*layers[:i], bad, *layers[i + 1 :])).validate()
