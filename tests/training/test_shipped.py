"""The shipped model pair (models/glm-10m, trained by python -m bench train-pair): the files load, have
the documented sizes (models/glm-10m/README.md), every file fits the 16 MB limit, and
speculative greedy decoding with each shipped drafter gives exactly plain greedy's tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from dhisparse.paths import ROOT
from dhisparse.tokenizer import ByteTokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.request import SamplingParams
from services.worker.model import load_model
from services.worker.speculative.config import SpeculationConfig

MODEL = ROOT / "models" / "glm-10m"
DRAFTERS = ("dflash", "dspark", "dflash2")
TARGET_PARAMS = 9_826_560  # documented in models/glm-10m/README.md
MAX_FILE_BYTES = 16_000_000


def _params(path) -> int:
    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def test_every_shipped_file_fits_the_limit() -> None:
    files = [p for p in MODEL.rglob("*") if p.is_file()]
    assert len([p for p in files if p.suffix == ".safetensors"]) == 2 + len(DRAFTERS)
    too_big = {str(p): p.stat().st_size for p in files if p.stat().st_size > MAX_FILE_BYTES}
    assert not too_big


def test_target_loads_with_the_documented_size() -> None:
    model = load_model(MODEL)
    assert sum(p.numel() for p in model.parameters()) == TARGET_PARAMS
    assert model.cfg.name == "glm-10m" and model.embed.weight.dtype == torch.bfloat16
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert sum(_params(MODEL / s) for s in shards) == TARGET_PARAMS
    assert "glm-10m" in (MODEL / "README.md").read_text()
    assert f"{TARGET_PARAMS:,}" in (MODEL / "README.md").read_text()


@pytest.mark.parametrize("kind", DRAFTERS)
def test_drafter_loads_with_the_documented_size(kind: str) -> None:
    d = MODEL / "drafters" / kind
    cfg = json.loads((d / "drafter.json").read_text())
    assert cfg["kind"] == kind and cfg["target"] == "glm-10m"
    params = _params(d / "drafter.safetensors")
    assert f"{params:,}" in (MODEL / "README.md").read_text()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = ByteTokenizer()
    texts = [
        "import os\nimport sys\n\n\ndef main(argv):\n",
        "class Stack:\n    def push(self, x):\n",
    ]
    return [tok.encode(t) for t in texts]


def _generate(prompts, drafter: str | None) -> list[list[int]]:
    cfg = EngineConfig(
        model=str(MODEL), mode="resident", kv_pool_mib=64, max_num_seqs=2, max_model_len=512,
        speculation=SpeculationConfig(drafter, width=4),
    )  # fmt: skip
    eng = Engine(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = [r.output_ids for r in eng.generate(prompts, params)]
    eng.close()
    return out


@pytest.fixture(scope="module")
def plain(prompts) -> list[list[int]]:
    return _generate(prompts, None)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_shipped_drafter_greedy_equals_plain_greedy(prompts, plain, kind: str) -> None:
    assert _generate(prompts, str(MODEL / "drafters" / kind)) == plain
    assert all(len(o) == 24 for o in plain)
