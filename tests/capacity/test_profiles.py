"""Built-in profiles, and profiles derived from the engine's model config."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dhisparse.capacity import (
    dsv4_flash,
    get_profile,
    glm53,
    profile_from_model_config,
    profile_from_model_dir,
    profile_names,
    session_bytes,
)
from dhisparse.capacity.builtin import selection_group_width
from dhisparse.family.config import LayerSpec, ModelConfig, SourceSpec
from dhisparse.family.presets import PRESETS, preset_topology


def glm53_model_config() -> ModelConfig:
    """GLM-5.3's topology as an engine config: 21 producers, each leading 3 or 4 layers."""
    layers: list[LayerSpec] = []
    for group in range(21):
        leader = len(layers)
        size = 4 if group < 78 - 3 * 21 else 3  # 15 groups of 4, 6 of 3
        layers.append(LayerSpec(source=leader))
        followers = range(leader + 1, leader + size)
        layers += [LayerSpec(source=s, index="follower", leader=leader) for s in followers]
    return ModelConfig(
        name="glm-5.3-topology",
        vocab_size=1000,
        d_model=64,
        n_heads=4,
        d_latent=512,
        d_rope=64,
        d_ff=128,
        n_index_heads=4,
        d_index=128,
        index_topk=2048,
        sources=tuple(SourceSpec() for _ in range(78)),
        layers=tuple(layers),
    )


def test_glm53_profile() -> None:
    p = glm53()
    assert (p.payload_sources, p.index_producers, p.d_kv, p.chi) == (78, 21, 576, 4)
    assert (p.top_k, p.hot_cache_rows, p.tail_pages, p.page_size) == (2048, 4096, 1, 64)
    d = p.drafter("dflash2")
    assert (d.window, d.k_max, d.row_bytes) == (2048, 8, 12_288)
    assert not p.estimated


def test_glm53_agrees_with_its_model_config_derivation() -> None:
    """The built-in profile and the engine-config path give the same bytes: 576 B rows are
    576 fp8 elements; 132 B keys are 128 fp8 elements and one fp32 scale."""
    cfg = glm53_model_config()
    assert len(cfg.layers) == 78 and len(cfg.index_producers) == 21
    assert selection_group_width(cfg) == 4
    derived = profile_from_model_config(
        cfg, kv_dtype_bytes=1, index_scale_bytes=4, hot_cache_rows=4096
    )
    for mode in ("resident", "hierarchy"):
        assert session_bytes(derived, 100_000, mode) == session_bytes(glm53(), 100_000, mode)
    assert derived.chi == glm53().chi


def test_dsv4_flash_profile_is_marked_estimated() -> None:
    p = dsv4_flash()
    assert p.estimated
    assert p.top_k * 4 == glm53().top_k  # "a k four times smaller"
    kinds = {s.kind for s in p.sources}
    assert kinds == {"sparse", "dense", "window"}
    assert any(s.compress > 1 for s in p.sources)
    assert p.index_producers == 8  # "eight resolver calls"
    res = session_bytes(p, 100_000, "resident")
    hier = session_bytes(p, 100_000, "hierarchy")
    assert hier.total < res.total
    assert hier.history > 0  # dense C128 sources stay on the GPU


def test_every_preset_has_a_derived_profile() -> None:
    names = profile_names()
    assert {"glm-5.3", "dsv4-flash"} <= set(names)
    for name in PRESETS:
        assert name in names
        assert get_profile(name) == profile_from_model_config(preset_topology(name))


def test_tiny_glm_derivation() -> None:
    p = get_profile("tiny-glm")
    cfg = preset_topology("tiny-glm")
    assert len(p.sources) == 1
    assert p.sources[0].count == len(cfg.sources)
    assert p.sources[0].row_bytes == cfg.d_kv * 4  # float32
    assert p.index_producers == len(cfg.index_producers)
    assert p.indexers[0].key_bytes == cfg.d_index * 4
    assert p.top_k == cfg.index_topk and p.hot_cache_rows == 2 * cfg.index_topk
    assert p.chi == 3  # one producer and two followers with their own sources


def test_tiny_dsv4_derivation() -> None:
    cfg = preset_topology("tiny-dsv4")
    p = get_profile("tiny-dsv4")
    assert sum(s.count for s in p.sources) == len(cfg.sources)
    assert {(s.compress, s.window) for s in p.sources} == {
        (s.compress, s.window) for s in cfg.sources
    }
    # producers (Reindex consumers included) index rows of their own source's compression
    by_m = {g.compress: g.count for g in p.indexers}
    assert sum(by_m.values()) == len(cfg.index_producers)
    assert p.chi == 1  # Reuse consumers share their producer's source


def test_derivation_follows_the_config() -> None:
    cfg = preset_topology("tiny-glm")
    wider = replace(cfg, d_latent=cfg.d_latent * 2)
    assert profile_from_model_config(wider).sources[0].row_bytes == (cfg.d_kv + cfg.d_latent) * 4
    assert profile_from_model_config(cfg, kv_dtype_bytes=2).sources[0].row_bytes == cfg.d_kv * 2
    assert get_profile("tiny-glm", kv_dtype_bytes=1).sources[0].row_bytes == cfg.d_kv


def test_builtin_profiles_reject_dtype_override() -> None:
    with pytest.raises(ValueError):
        get_profile("glm-5.3", kv_dtype_bytes=2)
    with pytest.raises(ValueError):
        get_profile("no-such-profile")


def test_profile_from_model_dir(tmp_path: Path) -> None:
    cfg = preset_topology("tiny-dsv4")
    cfg.save(tmp_path / "config.json")
    assert profile_from_model_dir(tmp_path) == profile_from_model_config(cfg)
