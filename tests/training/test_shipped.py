"""The shipped model (models/glm-dsa-mini, trained by ``python -m training run``): every file fits
the 16 MB limit and the sizes are those its README documents; transformers 5.17 opens the
directory unmodified and its greedy tokens equal ours (``--dtype float32``) for 32 tokens on
three held-out prompts; the projections the FP8 release keeps in bf16 are served as stored; and
speculative greedy decoding with the shipped DFlash2 drafter and with the MTP layer gives plain
greedy's tokens.

The held-out prompts are the opening tokens of held-out standard-library modules (difflib,
textwrap, fractions: kept out of training, corpus.json) as this machine's Python ships them,
through the release's tokenizer."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from dhisparse.paths import ROOT
from dhisparse.tokenizer import load_tokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from services.worker.weights.model_io import load_model
from tests.training.helpers import open_in_transformers

MODEL = ROOT / "models" / "glm-dsa-mini"
DFLASH2 = MODEL / "drafters" / "dflash2"
MAX_FILE_BYTES = 16_000_000
MAX_WEIGHT_BYTES = 32 << 20  # target and drafters
HELDOUT = ("difflib", "textwrap", "fractions")
PROMPT, NEW = 160, 32


def _params(path: Path) -> dict[str, int]:
    """Elements per kind in one safetensors file: the target's, the MTP layer's, FP8 scales."""
    layers = json.loads((MODEL / "config.json").read_text())["num_hidden_layers"]
    out = {"target": 0, "mtp": 0, "scales": 0}
    with safe_open(str(path), "pt") as f:
        for k in f.keys():  # noqa: SIM118
            n = math.prod(f.get_slice(k).get_shape())
            kind = "scales" if k.endswith("_scale_inv") else "target"
            if kind == "target" and k.startswith(f"model.layers.{layers}."):
                kind = "mtp"
            out[kind] += n
    return out


def test_every_shipped_file_fits_the_limits() -> None:
    files = [p for p in MODEL.rglob("*") if p.is_file()]
    too_big = {str(p): p.stat().st_size for p in files if p.stat().st_size > MAX_FILE_BYTES}
    assert not too_big
    weights = [p for p in files if p.suffix == ".safetensors"]
    assert sum(p.stat().st_size for p in weights) <= MAX_WEIGHT_BYTES


def test_the_documented_sizes() -> None:
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())
    totals = {"target": 0, "mtp": 0, "scales": 0}
    for shard in sorted(set(index["weight_map"].values())):
        for k, n in _params(MODEL / shard).items():
            totals[k] += n
    with safe_open(str(DFLASH2 / "drafter.safetensors"), "pt") as f:
        drafter = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    card = (MODEL / "README.md").read_text()
    for n in (totals["target"], totals["mtp"], drafter):
        assert f"{n:,}" in card
    assert json.loads((DFLASH2 / "drafter.json").read_text())["target"] == "glm-dsa-mini"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = load_tokenizer(MODEL)
    out = []
    for name in HELDOUT:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        out.append(tok.encode(Path(spec.origin).read_text())[:PROMPT])
    assert all(len(p) == PROMPT for p in out)
    return out


def _generate(prompts: list[list[int]], drafter: str | None) -> list[list[int]]:
    cfg = EngineConfig(
        model=str(MODEL), dtype="float32", mode="resident", kv_pool_mib=64,
        max_num_seqs=len(prompts), max_model_len=512,
        speculation=SpeculationConfig(drafter, width=4),
    )  # fmt: skip
    eng = Engine(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    out = [r.output_ids for r in eng.generate(prompts, params)]
    eng.close()
    return out


@pytest.fixture(scope="module")
def plain(prompts) -> list[list[int]]:
    out = _generate(prompts, None)
    assert all(len(o) == NEW for o in out)
    return out


def test_transformers_greedy_equals_ours(prompts, plain) -> None:
    hf = open_in_transformers(MODEL)
    with torch.no_grad():
        for p, ours in zip(prompts, plain, strict=True):
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)
            assert out[0, len(p) :].tolist() == ours


def test_projections_the_release_keeps_in_bf16_are_served_as_stored() -> None:
    """``modules_to_not_convert`` (the projections whose dimensions are not whole FP8 blocks)
    are dense layers holding the stored bf16 values, not FP8 requantized at load."""
    config = json.loads((MODEL / "config.json").read_text())
    kept = config["quantization_config"]["modules_to_not_convert"]
    model = load_model(MODEL, dtype=torch.float32)
    layers = config["num_hidden_layers"]
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())["weight_map"]
    for name in kept:
        layer = int(name.split(".")[2])
        if layer >= layers:
            continue  # the MTP layer, not loaded without the MTP drafter
        assert name.startswith(f"model.layers.{layer}.self_attn.")
        ours = model.get_submodule(f"layers.{layer}.attn.{name.rsplit('.', 1)[1]}")
        assert isinstance(ours, nn.Linear)
        with safe_open(str(MODEL / index[f"{name}.weight"]), "pt") as f:
            stored = f.get_tensor(f"{name}.weight")
        assert stored.dtype == torch.bfloat16
        assert torch.equal(ours.weight, stored.float())


@pytest.mark.parametrize("drafter", ["mtp", "dflash2"])
def test_shipped_drafter_greedy_equals_plain_greedy(prompts, plain, drafter: str) -> None:
    assert _generate(prompts, "mtp" if drafter == "mtp" else str(DFLASH2)) == plain
