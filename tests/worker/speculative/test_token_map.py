"""The MTP drafter's hot vocabulary as configured: ``--speculative-token-map`` files in each
format SGLang's loader and ours take, every problem a start-up error naming the file,
``--draft-vocab-size`` taking the map's first ids, the flags through the worker's settings into
the engine's, and the option refused with another drafter and under tensor parallelism."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch

from dhisparse.family.parallel_layout import ParallelConfig
from services.worker import cli
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.loading import serving_model
from services.worker.parallel.comm import LOCAL
from services.worker.settings import WorkerSettings
from services.worker.speculative.config import SpeculationConfig
from services.worker.speculative.token_map import hot_ids, read_token_map
from tests import hf_tiny
from tests.worker.mtp_fixture import mtp_checkpoint

RANKED = [7, 3, 250, 0, 42]


def _write(path: Path, ids: object) -> Path:
    if path.suffix in (".pt", ".pth"):
        torch.save(ids, path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(ids))
    else:
        path.write_text("".join(f"{i}\n" for i in ids))  # type: ignore[union-attr]
    return path


@pytest.mark.parametrize(
    ("name", "ids"),
    [
        ("map.json", RANKED),
        ("map.txt", RANKED),
        ("map", RANKED),
        ("map.pt", torch.tensor(RANKED)),
        ("map.pth", torch.tensor(RANKED, dtype=torch.int32)),
        ("list.pt", RANKED),
    ],
)
def test_a_token_map_is_read_in_every_format(tmp_path: Path, name: str, ids: object) -> None:
    assert read_token_map(_write(tmp_path / name, ids)) == RANKED


def test_a_text_map_skips_blank_lines_and_a_json_list_may_sit_in_any_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("\n7\n 3 \n\n250\n")
    assert read_token_map(tmp_path / "a.txt") == [7, 3, 250]
    (tmp_path / "b.txt").write_text(" [7, 3]\n")
    assert read_token_map(tmp_path / "b.txt") == [7, 3]


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("none.json", None, "no such file"),
        ("empty.json", [], "lists no token id"),
        ("empty.txt", "\n\n", "lists no token id"),
        ("twice.json", [4, 9, 4, 1, 9], "2 ids listed more than once"),
        ("float.json", [1, 2.5], "2.5 is not a token id"),
        ("bool.json", [1, True], "True is not a token id"),
        ("dict.json", {"ids": [1]}, "a list of token ids is needed, got dict"),
        ("broken.json", "[1, 2", "not a JSON list"),
        ("words.txt", "12\nthe\n", "line 2: 'the' is not a token id"),
        ("float.pt", torch.tensor([1.0, 2.0]), "a 1-D integer tensor is needed"),
        ("matrix.pt", torch.zeros(2, 2, dtype=torch.int64), "a 1-D integer tensor is needed"),
        ("garbage.pt", b"not a torch file", "not a torch file of token ids"),
        ("binary.bin", b"\x80\xff\x00", "neither a torch file"),
    ],
)
def test_a_bad_token_map_is_a_start_up_error_naming_the_file(
    tmp_path: Path, name: str, content: object, problem: str
) -> None:
    path = tmp_path / name
    if isinstance(content, str | bytes):
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    elif content is not None:
        _write(path, content)
    with pytest.raises(ValueError, match=problem) as e:
        read_token_map(path)
    assert f"--speculative-token-map {path}:" in str(e.value)


def test_hot_ids_are_the_maps_first_ids_sorted_and_checked_against_the_vocabulary() -> None:
    spec = SpeculationConfig("mtp", token_map="m.txt", draft_vocab_size=3)
    assert hot_ids(spec, 300, RANKED).tolist() == [3, 7, 250]
    whole = SpeculationConfig("mtp", token_map="m.txt")
    assert hot_ids(whole, 300, RANKED).tolist() == [0, 3, 7, 42, 250]
    assert hot_ids(SpeculationConfig("mtp", draft_vocab_size=4), 300, None).tolist() == [0, 1, 2, 3]
    assert hot_ids(SpeculationConfig("mtp"), 300, None) is None
    with pytest.raises(ValueError, match=r"m\.txt: 1 ids outside the vocabulary \[0, 100\)"):
        hot_ids(whole, 100, RANKED)
    with pytest.raises(ValueError, match=r"--draft-vocab-size 6: .* lists only 5 ids"):
        hot_ids(SpeculationConfig("mtp", token_map="m.txt", draft_vocab_size=6), 300, RANKED)
    with pytest.raises(ValueError, match="--draft-vocab-size 301: the vocabulary has 300"):
        hot_ids(SpeculationConfig("mtp", draft_vocab_size=301), 300, None)
    with pytest.raises(ValueError, match="--draft-vocab-size must be at least 1"):
        SpeculationConfig("mtp", draft_vocab_size=0)


@pytest.mark.parametrize("drafter", ["dflash2", "models/glm-dsa-mini/drafters/dflash2", None])
def test_another_drafter_refuses_a_hot_vocabulary(drafter: str | None) -> None:
    """With any drafter but the MTP layer, or none, either flag stops start-up, named."""
    for kw in ({"token_map": "m.txt"}, {"draft_vocab_size": 8}):
        with pytest.raises(ValueError, match="apply to the MTP drafter") as e:
            SpeculationConfig(drafter, **kw)
        assert "--speculative-token-map" in str(e.value)
    with pytest.raises(ValueError, match="--drafter mtp"):
        WorkerSettings(drafter=drafter or "none", draft_vocab_size=8).engine_config()


def test_the_worker_flags_reach_the_engines_speculation(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    path = str(_write(tmp_path / "hot.txt", RANKED))
    args = ["--drafter", "mtp", "--speculative-token-map", path, "--draft-vocab-size", "3"]
    spec = cli.settings_from_args(p.parse_args(args)).engine_config().speculation
    assert spec == SpeculationConfig("mtp", 8, "fixed", token_map=path, draft_vocab_size=3)
    assert WorkerSettings(speculative_token_map="").speculative_token_map is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return mtp_checkpoint("deepseek_v32", tmp_path_factory)[1]


def test_the_engine_loads_its_hot_head_once_or_stops_start_up(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A good map gives the engine's passes and its drafter one hot head, the MTP head's rows
    of the map's first ids; a map with an id past the vocabulary stops the engine's start-up,
    naming the file; so does a hot vocabulary under tensor parallelism, before any weight is
    read."""
    good = _write(tmp_path / "hot.json", RANKED)
    spec = SpeculationConfig("mtp", 4, token_map=str(good), draft_vocab_size=4)
    base = dict(model=str(checkpoint), max_num_seqs=2, max_model_len=256, kv_pool_mib=16)
    eng = Engine(EngineConfig(**base, speculation=spec))
    hot = eng.passes.hot_head
    assert hot is not None and hot.ids.tolist() == [0, 3, 7, 250]
    assert eng.speculator.drafter.hot is hot
    assert torch.equal(hot.weight, eng.model.mtp_head[hot.ids])
    eng.close()
    bad = _write(tmp_path / "big.txt", [*RANKED, hf_tiny.VOCAB])
    with pytest.raises(ValueError, match=re.escape(f"--speculative-token-map {bad}: 1 ids")):
        Engine(EngineConfig(**base, speculation=SpeculationConfig("mtp", token_map=str(bad))))
    split = EngineConfig(**base, speculation=spec, parallel=ParallelConfig(2))
    with pytest.raises(ValueError, match="not --tensor-parallel-size 2"):
        serving_model(split, None, LOCAL)
