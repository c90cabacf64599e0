"""End-of-sequence ids from every place a checkpoint names them (GLM-5 lists three), and the
generation defaults of generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dhisparse.family.generation import GenerationDefaults, eos_token_ids, token_ids
from dhisparse.family.presets import preset
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import FinishReason, SamplingParams
from services.worker.weights.model_io import build_model, save_pretrained

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def test_token_ids_take_one_id_or_a_list() -> None:
    assert token_ids(None) == ()
    assert token_ids(1) == (1,)
    assert token_ids([154820, 154827, 154829, 154820]) == (154820, 154827, 154829)
    for bad in ("1", [1.5], [-1], True):
        with pytest.raises(ValueError):
            token_ids(bad)


def test_generation_defaults_from_the_file(tmp_path: Path) -> None:
    assert GenerationDefaults.read(tmp_path) == GenerationDefaults()
    assert GenerationDefaults.read(None) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "_from_model_config": True,
                "bos_token_id": 0,
                "eos_token_id": [154820, 154827, 154829],
                "do_sample": True,
                "temperature": 1.0,
                "top_p": 0.95,
                "top_k": 40,
                "max_new_tokens": 512,
                "transformers_version": "4.46.3",
            }
        )
    )
    d = GenerationDefaults.read(tmp_path)
    assert d == GenerationDefaults(
        eos_token_ids=(154820, 154827, 154829),
        temperature=1.0,
        top_p=0.95,
        top_k=40,
        do_sample=True,
        max_new_tokens=512,
    )
    assert d.default_temperature == 1.0
    # do_sample false is greedy, whatever the temperature (transformers' rule).
    assert (
        GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.6}).default_temperature
        == 0.0
    )
    for bad in ({"top_p": 0}, {"temperature": -1}, {"do_sample": "yes"}, {"top_k": "x"}):
        with pytest.raises(ValueError):
            GenerationDefaults.from_dict(bad)


def test_eos_ids_of_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_token_ids(tmp_path) == (5, 7, 9)
    assert eos_token_ids(None) == ()


def _model_dir(path: Path, config_eos: list[int], generation_eos: list[int]) -> Path:
    save_pretrained(build_model(preset("tiny-indexshare"), seed=0), path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = config_eos  # a checkpoint's config.json may list several
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


def test_the_engine_stops_on_any_eos_id(tmp_path: Path) -> None:
    free_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = Engine(EngineConfig(model="tiny-indexshare", kv_pool_mib=8)).generate(
        [PROMPT], free_params
    )
    out = free[0].output_ids
    firsts = [t for i, t in enumerate(out) if t not in out[:i] and t != 257]
    assert len(firsts) >= 4, out
    early, late = firsts[2], firsts[3]  # neither appears before its first position
    for config_eos, generation_eos in (([257], [late, early]), ([early, 257], [late])):
        path = _model_dir(tmp_path / f"m{config_eos[0]}", config_eos, generation_eos)
        engine = Engine(EngineConfig(model=str(path), kv_pool_mib=8))
        assert engine.eos_token_ids == {257, early, late}  # the byte tokenizer's EOS is 257
        req = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24))[0]
        assert req.output_ids == out[: out.index(early) + 1]
        assert req.finish_reason is FinishReason.STOP and req.stop_reason is None
        # Before min_tokens no EOS id can be sampled, nor ends the request.
        held = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=out.index(late) + 1)
        req = engine.generate([PROMPT], held)[0]
        assert not {early, late} & set(req.output_ids[: held.min_tokens])
        # ignore_eos runs past all of them.
        assert engine.generate([PROMPT], free_params)[0].output_ids == out
