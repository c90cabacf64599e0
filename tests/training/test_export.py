"""Shipping weights: ``save_pretrained`` writes one file or HF-style shards with an index,
and ``load_model`` reads either layout back to the same values."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dhisparse.family.presets import preset
from services.worker.model.preset_decoder import DSAModel
from services.worker.weights.model_io import INDEX_FILE, WEIGHTS_FILE, load_model, save_pretrained
from training.target.weights import init_for_training

LIMIT = 15_000_000


def glm_10m() -> DSAModel:
    model = DSAModel(preset("glm-10m"))
    init_for_training(model, seed=0)
    with torch.no_grad():
        model.lm_head.weight.normal_()  # init leaves it zero: make the round trip see values
    return model


def assert_same_bf16(model: DSAModel, loaded: DSAModel) -> None:
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(want) == set(got)
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16
        assert torch.equal(got[k], v.to(torch.bfloat16)), k


def test_sharded_bf16_round_trip(tmp_path: Path) -> None:
    model = glm_10m()
    save_pretrained(model, tmp_path, dtype=torch.bfloat16, max_shard_bytes=LIMIT - (1 << 16))
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert [p.name for p in shards] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert all(p.stat().st_size <= LIMIT for p in shards)
    assert not (tmp_path / WEIGHTS_FILE).exists()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == 2 * sum(p.numel() for p in model.parameters())
    loaded = load_model(tmp_path)  # glm-10m's dtype is bfloat16
    assert_same_bf16(model, loaded)


def test_single_file_round_trip_replaces_earlier_shards(tmp_path: Path) -> None:
    model = glm_10m()
    save_pretrained(model, tmp_path, dtype=torch.bfloat16, max_shard_bytes=4_000_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    save_pretrained(model, tmp_path, dtype=torch.bfloat16)
    assert (tmp_path / WEIGHTS_FILE).exists() and not (tmp_path / INDEX_FILE).exists()
    assert not list(tmp_path.glob("model-*-of-*.safetensors"))
    assert_same_bf16(model, load_model(tmp_path))
    fp32 = load_model(tmp_path, dtype=torch.float32)
    assert next(fp32.parameters()).dtype == torch.float32
