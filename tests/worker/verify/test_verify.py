"""``dhisparse verify`` on tiny random checkpoints of both families saved by transformers in
bf16, and FP8 copies of them on a ragged ceil-div scale grid: it passes on faithful copies,
reads only the first N layers' tensors, and fails when our copy of one weight is perturbed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dhisparse.cli import main
from services.worker.verify import compare
from services.worker.weights.checkpoint import Checkpoint
from services.worker.weights.fp8_writer import write_fp8_checkpoint
from tests import hf_tiny

FAMILIES = {"deepseek_v32": hf_tiny.v32_config, "glm_moe_dsa": hf_tiny.glm_config}
# (32, 32) blocks leave kv_a_proj_with_mqa's 48 rows a ragged second block, as the released
# 576-row projection in 128-row blocks: transformers' own CPU dequantization refuses that grid.
FP8_BLOCK = (32, 32)
TOKENS = "96"  # six times index_topk: truly sparse selections


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> bf16 checkpoint saved hub-style, and family-fp8 -> its FP8 copy (E8M0 scales
    for GLM, float32 for V3.2); GLM sharded."""
    out = {}
    for name, config in FAMILIES.items():
        path = tmp_path_factory.mktemp(name)
        shard = "40KB" if name == "glm_moe_dsa" else None
        model = hf_tiny.build(config(), seed=3).to(torch.bfloat16)
        hf_tiny.save_hub_style(model, path, max_shard_size=shard)
        fp8 = tmp_path_factory.mktemp(f"{name}-fp8")
        scale = "F8_E8M0" if name == "glm_moe_dsa" else "F32"
        write_fp8_checkpoint(path, fp8, block=FP8_BLOCK, scale_dtype=scale)
        out[name], out[f"{name}-fp8"] = path, fp8
    return out


def verify(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict]:
    rc = main(["verify", "--model", str(path), "--tokens", TOKENS, "--json", *extra])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out else {}


@pytest.mark.parametrize("name", [*FAMILIES, *(f"{n}-fp8" for n in FAMILIES)])
def test_a_faithful_checkpoint_passes(name: str, checkpoints, capsys) -> None:
    glm = name.startswith("glm")
    layers = 5 if glm else 2  # GLM: all of IndexShare's producers and followers
    rc, report = verify(checkpoints[name], capsys, "--layers", str(layers))
    assert rc == 0, report
    assert report["passed"] and report["tokens"] == int(TOKENS)
    checks = report["layers"]
    assert [c["layer"] for c in checks] == list(range(layers))
    producers = [c for c in checks if c["index"] == "producer"]
    assert all(c["agreement"] == 1.0 for c in producers)
    assert all(c["logit_error"] < 1e-5 and c["top1"] == 1.0 for c in checks)
    if glm:
        followers = [(c["layer"], c["leader"]) for c in checks if c["index"] == "follower"]
        assert followers == [(3, 2), (4, 2)]
        assert all(c["agreement"] is None for c in checks if c["index"] == "follower")


def test_only_the_first_layers_are_read(checkpoints, capsys, monkeypatch) -> None:
    read: list[str] = []
    get = Checkpoint.get

    def recording(self, name, *args, **kwargs):
        read.append(name)
        return get(self, name, *args, **kwargs)

    monkeypatch.setattr(Checkpoint, "get", recording)
    rc, _ = verify(checkpoints["glm_moe_dsa-fp8"], capsys, "--layers", "2")
    assert rc == 0
    layers = {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")}
    assert layers == {0, 1}
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(read)


@pytest.mark.parametrize(
    ("weight", "failing"),
    [
        ("layers.0.indexer.wk.weight", "agreement"),  # keys: the selections move first
        ("layers.1.attn.o_proj.weight", "logit_error"),  # the output only: layer 0 still passes
    ],
)
def test_a_perturbed_copy_fails(
    weight: str, failing: str, checkpoints, capsys, monkeypatch
) -> None:
    load = compare.load_hf_model

    def perturbed(*args, **kwargs):
        model = load(*args, **kwargs)
        w = dict(model.named_parameters())[weight]
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            w.add_(0.5 * w.std() * torch.randn(w.shape, generator=g))
        return model

    monkeypatch.setattr(compare, "load_hf_model", perturbed)
    rc, report = verify(checkpoints["deepseek_v32"], capsys, "--layers", "2")
    assert rc == 1 and not report["passed"]
    first, second = report["layers"]
    if failing == "agreement":
        assert first["agreement"] < 0.99
    else:
        assert first["agreement"] == 1.0 and first["logit_error"] < 1e-5
        assert second["logit_error"] > 1e-3


def test_prompt_file_and_table(checkpoints, capsys, tmp_path: Path) -> None:
    """A prompt file is encoded with the model's tokenizer (the byte tokenizer here: the tiny
    checkpoint ships no tokenizer.json) and cut to --tokens; the table names every layer."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The index producer announces positions for its followers. " * 3)
    argv = ["verify", "--model", str(checkpoints["glm_moe_dsa"]), "--layers", "4"]
    assert main([*argv, "--prompt-file", str(prompt), "--tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "layers 0-3 of 5, 64 tokens, float32 on cpu" in out
    assert "follows 2" in out and out.rstrip().endswith("on every layer")
    assert out.splitlines()[-1].startswith("pass:")


def test_what_cannot_be_verified(checkpoints, capsys, tmp_path: Path) -> None:
    raw = json.loads((checkpoints["deepseek_v32"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"some_new_field": 1}))
    assert main(["verify", "--model", str(tmp_path)]) == 2
    assert "some_new_field" in capsys.readouterr().err
    assert main(["verify", "--model", str(checkpoints["deepseek_v32"]), "--layers", "0"]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(raw))
    assert main(["verify", "--model", str(empty)]) == 2
    assert "neither model.safetensors" in capsys.readouterr().err
