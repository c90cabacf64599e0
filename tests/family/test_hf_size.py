"""The pure-Python parameter count against transformers 5.17.0's models instantiated on the meta
device: tiny configs of both families (GLM with IndexShare) and the three released configs."""

from __future__ import annotations

import json

import pytest
import torch

from dhisparse.family.hf_config import parse_config
from dhisparse.family.hf_size import param_count
from tests import hf_tiny
from tests.fixtures import CONFIGS, RELEASED


def _counted(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, router-bias buffer elements) of a transformers model."""
    params = sum(p.numel() for p in model.parameters())
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("correction_bias"))
    return params, biases


def _on_meta(config) -> torch.nn.Module:
    cls = (
        hf_tiny.DeepseekV32ForCausalLM
        if config.model_type == "deepseek_v32"
        else hf_tiny.GlmMoeDsaForCausalLM
    )
    with torch.device("meta"):
        return cls(config)


@pytest.mark.parametrize(
    "config",
    [
        hf_tiny.v32_config(),
        hf_tiny.v32_config(tie_word_embeddings=True, first_k_dense_replace=2),
        hf_tiny.glm_config(),  # IndexShare: full 0, 1, 2, 6 of 8 layers
        hf_tiny.glm_config(n_shared_experts=2, num_hidden_layers=5),
    ],
    ids=["v32", "v32-tied", "glm-index-share", "glm-2-shared"],
)
def test_tiny_configs(config, tmp_path) -> None:
    model = _on_meta(config)
    hf_tiny.save_hub_style(hf_tiny.build(config), tmp_path)
    cfg = parse_config(json.loads((tmp_path / "config.json").read_text()))
    got = param_count(cfg)
    assert (got.total, got.router_bias) == _counted(model)
    if cfg.family == "glm_moe_dsa":
        producers = sum(layer.self_attn.indexer is not None for layer in model.model.layers)
        assert producers == cfg.indexer_types.count("full") < cfg.num_layers


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_configs(name: str) -> None:
    raw = json.loads((CONFIGS / name / "config.json").read_text())
    cfg = parse_config(raw)
    config_cls = (
        hf_tiny.DeepseekV32Config if cfg.family == "deepseek_v32" else hf_tiny.GlmMoeDsaConfig
    )
    config = config_cls(**{k: v for k, v in raw.items() if k != "quantization_config"})
    got = param_count(cfg)
    assert (got.total, got.router_bias) == _counted(_on_meta(config))
    assert got.total == RELEASED[name][0]
