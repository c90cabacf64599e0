"""config.json of DeepSeek-V3.2 and GLM-5 as the hub ships it and as every transformers release
from 5.17 to the newest writes it (``tests/fixtures/configs/transformers-5.25``, SOURCES.md there)
reads as the same model; a key with no effect on the math is accepted and named in one log line;
layer types that change the math are refused with a short message naming them."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from dhisparse.family.hf_config import ConfigError, parse_config
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from tests import hf_tiny
from tests.fixtures import CONFIGS, SAVED_BY_NEWEST

NAMES = ("deepseek-v3.2", "glm-5.1", "glm-5.2")


def _read(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def as_written_by(version: str, newest: dict) -> dict:
    """``newest`` (as 5.19 to 5.25 write it) as an older release writes it (SOURCES.md):
    5.18 has no ``output_router_logits``; 5.17 also names its layers
    ``deepseek_sparse_attention``."""
    raw = dict(newest)
    if version in ("5.17", "5.18"):
        raw.pop("output_router_logits")
    if version == "5.17":
        raw["layer_types"] = ["deepseek_sparse_attention"] * len(raw["layer_types"])
    return raw


@pytest.mark.parametrize("name", NAMES)
def test_every_release_writes_the_model_the_hub_ships(name: str) -> None:
    hub = parse_config(_read(CONFIGS / name))
    newest = _read(SAVED_BY_NEWEST / name)
    assert newest["layer_types"] == ["indexed_attention"] * newest["num_hidden_layers"]
    assert newest["output_router_logits"] is False
    for version in ("5.17", "5.18", "5.25"):
        assert parse_config(as_written_by(version, newest)) == hub, version


def test_a_key_without_effect_on_the_math_is_named_in_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = _read(SAVED_BY_NEWEST / "glm-5.1") | {"output_router_logits": True}
    with caplog.at_level(logging.INFO, logger="dhisparse.family.hf_config"):
        parse_config(raw)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "output_router_logits" in line and "no effect" in line


def test_layer_types_that_change_the_math_are_refused_by_name() -> None:
    raw = _read(SAVED_BY_NEWEST / "deepseek-v3.2")
    n = raw["num_hidden_layers"]
    mixed = ["indexed_attention"] * n
    mixed[5] = mixed[9] = "sliding_attention"
    with pytest.raises(ConfigError, match=r"'sliding_attention' at layers \[5, 9\]") as e:
        parse_config(raw | {"layer_types": mixed})
    assert len(str(e.value)) < 300  # names the odd layers, not all 61
    with pytest.raises(ConfigError, match=f"layer_types has 3 entries for {n} layers"):
        parse_config(raw | {"layer_types": ["indexed_attention"] * 3})
    with pytest.raises(ConfigError, match=r"unsupported field.*'sliding_window'"):
        parse_config(raw | {"sliding_window": 4096})  # unknown keys stay refused


def test_a_checkpoint_saved_by_the_newest_release_serves_the_same_tokens(tmp_path: Path) -> None:
    """A tiny GLM checkpoint hub-style, and the same with config.json as 5.19 to 5.25 write
    it: the engine starts on both and gives the same greedy tokens."""
    ref = hf_tiny.build(hf_tiny.glm_config(), seed=3)
    hub = hf_tiny.save_hub_style(ref, tmp_path / "hub")
    newest = tmp_path / "newest"
    shutil.copytree(hub, newest)
    ref.config.save_pretrained(newest)  # derived keys written, as every 5.x writes them
    raw = _read(newest)
    raw["layer_types"] = ["indexed_attention"] * raw["num_hidden_layers"]
    raw["output_router_logits"] = False
    (newest / "config.json").write_text(json.dumps(raw, indent=2))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(2, 40)), list(range(50, 70))]

    def tokens(path: Path) -> list[list[int]]:
        engine = Engine(EngineConfig(model=str(path), kv_pool_mib=16, max_model_len=256))
        try:
            return [r.output_ids for r in engine.generate(prompts, params)]
        finally:
            engine.close()

    assert tokens(newest) == tokens(hub)
