"""load_into: copies by the caller's mapping, refuses missing and unexpected names before
copying anything, and reports ignored names in one warning."""

from __future__ import annotations

import logging

import pytest
import torch

from services.worker.weights.checkpoint import Checkpoint, CheckpointError
from services.worker.weights.loader import load_into
from tests.worker.checkpoint_files import FP8_QUANT, quantized, write

MTP = r"model\.layers\.2\."


def checkpoint(tmp_path) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """Two layers and an MTP layer (layer 2), FP8 projections, in two shards."""
    g = torch.Generator().manual_seed(0)
    src = {"model.embed_tokens.weight": torch.randn(32, 16, generator=g)}
    for layer in range(3):
        p = f"model.layers.{layer}."
        src[p + "self_attn.kv_a_proj_with_mqa.weight"] = torch.randn(144, 200, generator=g)
        src[p + "input_layernorm.weight"] = torch.rand(16, generator=g)
    src["model.layers.2.eh_proj.weight"] = torch.randn(16, 32, generator=g)
    fp8 = {n for n in src if "proj" in n}
    stored = quantized(src, fp8=fp8)
    return Checkpoint(write(tmp_path, stored, shards=2), FP8_QUANT), stored


def targets(ckpt: Checkpoint, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    return {
        n: torch.zeros(ckpt.shape(n), dtype=dtype)
        for n in ckpt.names()
        if not n.startswith("model.layers.2.")
    }


def test_every_target_receives_its_weight_and_ignored_names_warn_once(tmp_path, caplog) -> None:
    ckpt, _ = checkpoint(tmp_path)
    params = targets(ckpt)
    with caplog.at_level(logging.WARNING):
        load_into(ckpt, params, ignore={MTP: "MTP layer; no drafter asked for"})
    for name, t in params.items():
        assert torch.equal(t, ckpt.get(name, torch.bfloat16)), name
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "ignored 3 checkpoint tensors" in message
    assert f"3 matching '{MTP}' (MTP layer; no drafter asked for)" in message


def test_ignore_patterns_may_come_without_reasons(tmp_path, caplog) -> None:
    ckpt, _ = checkpoint(tmp_path)
    params = targets(ckpt, torch.float32)
    del params["model.embed_tokens.weight"]
    with caplog.at_level(logging.WARNING):
        load_into(ckpt, params, ignore=[MTP, r".*embed_tokens"])
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "ignored 4 checkpoint tensors" in record.getMessage()
    assert "1 matching '.*embed_tokens'" in record.getMessage()


def test_nothing_ignored_means_no_warning(tmp_path, caplog) -> None:
    ckpt, _ = checkpoint(tmp_path)
    params = {n: torch.zeros(ckpt.shape(n)) for n in ckpt.names()}
    with caplog.at_level(logging.WARNING):
        load_into(ckpt, params, ignore={MTP: "unused"})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_missing_names_are_listed_and_nothing_is_copied(tmp_path) -> None:
    ckpt, _ = checkpoint(tmp_path)
    params = targets(ckpt)
    params["model.layers.0.mlp.gate.weight"] = torch.zeros(4, 16)
    params["model.norm.weight"] = torch.zeros(16)
    with pytest.raises(CheckpointError, match="2 weights missing") as e:
        load_into(ckpt, params, ignore=[MTP])
    assert "model.layers.0.mlp.gate.weight, model.norm.weight" in str(e.value)
    assert all(not t.any() for t in params.values())


def test_unexpected_names_are_listed_and_nothing_is_copied(tmp_path) -> None:
    ckpt, _ = checkpoint(tmp_path)
    params = targets(ckpt)
    with pytest.raises(CheckpointError, match="3 unexpected weights") as e:
        load_into(ckpt, params)
    assert "model.layers.2.eh_proj.weight" in str(e.value)
    assert all(not t.any() for t in params.values())


def test_a_target_of_another_shape_is_refused(tmp_path) -> None:
    ckpt, _ = checkpoint(tmp_path)
    params = targets(ckpt)
    params["model.layers.1.input_layernorm.weight"] = torch.zeros(17)
    with pytest.raises(CheckpointError, match=r"input_layernorm\.weight \[16\] into \[17\]"):
        load_into(ckpt, params, ignore=[MTP])
    assert all(not t.any() for t in params.values())


def test_a_module_loads_through_its_parameters(tmp_path) -> None:
    ckpt, stored = checkpoint(tmp_path)
    module = torch.nn.Linear(200, 144, bias=False)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    others = [n for n in ckpt.names() if n != name]
    load_into(ckpt, {name: module.weight}, ignore=[f"^{n}$".replace(".", r"\.") for n in others])
    assert module.weight.requires_grad
    assert torch.equal(module.weight.detach(), ckpt.get(name, torch.float32))
    assert not torch.equal(module.weight.detach(), stored[name].float())  # dequantized
