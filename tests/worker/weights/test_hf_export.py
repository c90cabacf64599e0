"""``save_hf_checkpoint``: a model written in the released Hugging Face layout loads back bit
for bit (FP8 bytes and block scales included, experts one tensor per expert and projection):
at tiny scale on the CPU, and on the GPU at DeepSeek-V3.2's real dimensions (the first 4 layers
of ``v32-scaled``, built in place in FP8: the scaled FP8 load from disk)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dhisparse.family.presets import FamilyPreset, preset
from dhisparse.family.scaled import SCALED
from services.worker.kv.config import KVCacheConfig
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.weight_format import WeightFormat
from services.worker.serving.cache import KVCache
from services.worker.weights.checkpoint import Checkpoint
from services.worker.weights.hf_export import save_hf_checkpoint
from services.worker.weights.model_io import build_model, load_model
from tests.worker.helpers import run_chunks
from tests.worker.mtp_fixture import mtp_checkpoint

FP8 = WeightFormat(fp8=True)


def _same(a: MLADecoder, b: MLADecoder) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k, t in sa.items():
        u = sb[k]
        assert t.dtype == u.dtype and t.shape == u.shape, k
        if t.dtype == torch.float8_e4m3fn:
            t, u = t.view(torch.uint8), u.view(torch.uint8)
        assert torch.equal(t, u), k


@pytest.mark.parametrize("fp8", [False, True])
def test_a_written_checkpoint_loads_back_bit_for_bit(tmp_path: Path, fp8: bool) -> None:
    d = preset("tiny-glm")
    assert isinstance(d, FamilyPreset)
    model = build_model(d, seed=5, weights=FP8 if fp8 else WeightFormat())
    path = save_hf_checkpoint(model, tmp_path / "ckpt", d.config, max_shard_bytes=200_000)
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    raw = json.loads((path / "config.json").read_text())
    assert ("quantization_config" in raw) == fp8
    ckpt = Checkpoint(path, raw.get("quantization_config"))
    names = ckpt.names()
    assert "model.layers.3.mlp.experts.2.up_proj.weight" in names
    assert ckpt.is_fp8("model.layers.3.mlp.experts.2.up_proj.weight") == fp8
    assert not ckpt.is_fp8("model.layers.3.self_attn.kv_b_proj.weight")  # absorbed: dense
    ckpt.close()
    loaded = load_model(path)
    assert isinstance(loaded, MLADecoder) and loaded.weight_format.fp8 == fp8
    _same(model, loaded)


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_with_its_mtp_layer_round_trips(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, tied: bool
) -> None:
    """The MTP layer is written as layer N under the released names, without the copy of the
    embedding; its head is written when it is its own and left out when it is the target's
    (``tied``), and the loader ties it back: the same tensors, the same head object."""
    _, source = mtp_checkpoint("glm_moe_dsa", tmp_path_factory)
    model = load_model(source, mtp=True)
    assert isinstance(model, MLADecoder)
    if tied:
        model.tie_mtp_head()
    config = json.loads((source / "config.json").read_text())
    path = save_hf_checkpoint(model, tmp_path / "ckpt", config)
    ckpt = Checkpoint(path, None)
    names = set(ckpt.names())
    ckpt.close()
    n = config["num_hidden_layers"]
    assert f"model.layers.{n}.eh_proj.weight" in names
    assert f"model.layers.{n}.mlp.experts.1.down_proj.weight" in names
    assert f"model.layers.{n}.embed_tokens.weight" not in names
    assert (f"model.layers.{n}.shared_head.head.weight" in names) == (not tied)
    loaded = load_model(path, mtp=True)
    assert isinstance(loaded, MLADecoder) and loaded.mtp is not None and loaded.lm_head is not None
    assert (loaded.mtp.shared_head.head.weight is loaded.lm_head.weight) == tied
    _same(model, loaded)


@pytest.mark.gpu
def test_scaled_fp8_checkpoint_round_trips_through_disk(tmp_path: Path) -> None:
    """DeepSeek-V3.2's first 4 layers at real dimensions (3 dense, 1 MoE of 64 experts; 4.8 B
    parameters), built in place in FP8 on the GPU, written (FP8 bytes, fp32 block scales,
    4 GB shards), read back by the loader onto the GPU: the same bytes, the same logits."""
    base = SCALED["v32-scaled"]
    d = FamilyPreset("v32-scaled-4", {**base.config, "num_hidden_layers": 4}, base.mask_token_id)
    model = build_model(d, seed=1, device="cuda", dtype=torch.bfloat16, weights=FP8,
                        in_place=True)  # fmt: skip
    path = save_hf_checkpoint(model, tmp_path / "v32-4", d.config)
    loaded = load_model(path, device="cuda", dtype=torch.bfloat16)
    assert isinstance(loaded, MLADecoder) and loaded.weight_format.fp8
    _same(model, loaded)
    ids = torch.randint(
        0, d.config["vocab_size"], (96,), generator=torch.Generator().manual_seed(2)
    )
    outs = []
    for m in (model, loaded):
        kv = KVCache(m.cfg, KVCacheConfig(max_slots=1, max_model_len=128, dtype=torch.bfloat16,
                                          device="cuda", kv_pool_bytes=1 << 30))  # fmt: skip
        outs.append(m.logits(run_chunks(m, kv, ids.cuda(), [64, 32])))
        kv.close()
    assert torch.equal(outs[0], outs[1])
