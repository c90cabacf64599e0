"""A GLM-5 model (``glm_moe_dsa`` with IndexShare and an MTP layer) trained from a config.json
by ``training.target``: the loss falls through both attention phases, the MTP layer and the
expert balance are logged, and the exported directory is a Hugging Face checkpoint that
transformers opens unmodified (only the MTP layer's keys unexpected) and whose logits equal
ours; the engine loads it with its MTP layer, the head tied to the target's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.worker.kv.config import KVCacheConfig
from services.worker.model.mla_decoder import MLADecoder
from services.worker.serving.cache import KVCache
from services.worker.weights.model_io import load_model
from tests import hf_tiny
from tests.training.helpers import open_in_transformers, small_corpus, tiny_run
from tests.worker.helpers import run_chunks
from training.target.loop import train


def micro_glm5(tmp: Path) -> Path:
    """GLM-5.2's IndexShare at 5 layers (full 0, 1, 2; 3 and 4 follow 2) with one MTP layer,
    as a config.json."""
    cfg = hf_tiny.glm_config(num_nextn_predict_layers=1)
    cfg.architectures = ["GlmMoeDsaForCausalLM"]
    cfg.save_pretrained(tmp / "micro-glm5")
    return tmp / "micro-glm5" / "config.json"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("mla-run")
    cfg = tiny_run(
        tmp / "run", small_corpus(tmp), preset=str(micro_glm5(tmp)), steps=16, seq_len=48,
        lr=1e-2, warmup=3, kl_queries=12,
    )  # fmt: skip
    return train(cfg)


def test_a_glm5_model_trains_with_its_mtp_layer_and_balanced_experts(trained) -> None:
    steps = [h for h in trained.history if "lm_loss" in h]
    assert len(steps) == 16
    assert abs(steps[0]["lm_loss"] - math.log(hf_tiny.VOCAB)) < 0.3  # near uniform at first
    assert sum(h["lm_loss"] for h in steps[-3:]) / 3 < steps[0]["lm_loss"] - 1.0, steps
    assert all(math.isfinite(h["mtp_loss"]) and h["idx_kl"] >= 0 for h in steps)
    assert all(0 <= h["expert_share_min"] <= h["expert_share_max"] <= 1 for h in steps)
    assert {h["mode"] for h in steps} == {"dense", "sparse"}
    final = [h for h in trained.history if "eval_bpb" in h][-1]
    assert final["eval_bpb"] > 0 and set(final["eval_bpb_by_position"]) == {"0-48"}


def test_the_export_opens_in_transformers_and_gives_our_logits(trained) -> None:
    path = Path(trained.out) / "model"
    drafting = load_model(path, mtp=True)
    assert isinstance(drafting, MLADecoder) and drafting.mtp is not None
    assert drafting.lm_head is not None
    assert drafting.mtp.shared_head.head.weight is drafting.lm_head.weight
    ours = load_model(path, dtype=torch.float32)
    theirs = open_in_transformers(path)
    ids = torch.randint(0, hf_tiny.VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    want = hf_tiny.reference_logits(theirs, ids)
    kv = KVCache(ours.cfg, KVCacheConfig(kv_pool_bytes=8 << 20, max_slots=1, max_model_len=64))
    with torch.no_grad():
        got = ours.logits(run_chunks(ours, kv, ids, [40]))
    kv.close()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
