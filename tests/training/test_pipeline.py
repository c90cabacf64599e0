"""``python -m training run`` end to end on the micro recipe (the shipped recipe's structure at
a size the CPU trains in seconds): invocations of a small budget each go on where the last
stopped until every stage is done; the release directory is FP8 where the blocks are whole
(the rest bf16 and named in ``modules_to_not_convert``), transformers opens it unmodified with
only the MTP layer's keys unexpected, and the engine's greedy tokens on prompts of held-out
files are transformers' argmax (up to rounding), the same speculating with the trained DFlash2
drafter."""

from __future__ import annotations

import json
import math
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import transformers

from dhisparse.tokenizer import load_tokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from services.worker.weights.checkpoint import Checkpoint
from tests import hf_tiny
from tests.training.helpers import open_in_transformers
from training.__main__ import main
from training.corpus.documents import HELDOUT_MODULES
from training.pipeline import RECORD, stages
from training.recipe import MICRO, SHIPPED
from training.release import ragged, release_bytes

EXTRA = ("json", "argparse.py")  # trained on, beside what is held out


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = tmp_path_factory.mktemp("root")
    for name in (*HELDOUT_MODULES, *EXTRA):
        src = stdlib / name if (stdlib / name).exists() else stdlib / f"{name}.py"
        copy = shutil.copytree if src.is_dir() else shutil.copy2
        copy(src, root / src.name)
    out = tmp_path_factory.mktemp("pipeline")
    argv = ["run", "--out", str(out), "--recipe", MICRO.name, "--min-stage-s", "5",
            "--root", str(root), "--no-progress", "--device", "cpu"]  # fmt: skip
    main([*argv, "--budget-s", "8"])  # the corpus, then too little left for a training stage
    first = json.loads((out / RECORD).read_text())
    assert first["done"] == ["corpus"] and first["next"] == MICRO.phases[0].name
    for _ in range(8):
        main([*argv, "--budget-s", "25"])
        if json.loads((out / RECORD).read_text())["next"] is None:
            break
    return out


def test_invocations_go_on_until_every_stage_is_done(pipeline: Path) -> None:
    record = json.loads((pipeline / RECORD).read_text())
    assert record["done"] == stages(MICRO) and record["next"] is None
    assert len(record["invocations"]) >= 2
    release = pipeline / "release" / MICRO.name
    summary = json.loads((release / "training.json").read_text())
    assert [p["phase"] for p in summary["phases"]] == [p.name for p in MICRO.phases]
    for phase in MICRO.phases:
        history = (release / f"history-{phase.name}.jsonl").read_text().splitlines()
        steps = [json.loads(h) for h in history if '"lm_loss"' in h]
        assert steps and all("mtp_loss" in h and "expert_share_min" in h for h in steps)
        assert (release / f"training-{phase.name}.png").stat().st_size > 0
    evals = [p["heldout_nats_per_token"] for p in summary["phases"]]
    assert evals[-1] < math.log(MICRO.vocab_size) - 0.5  # it learned: far from uniform


def test_the_release_is_fp8_where_blocks_are_whole(pipeline: Path) -> None:
    release = pipeline / "release" / MICRO.name
    config = json.loads((release / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["weight_block_size"] == [128, 128]
    ckpt = Checkpoint(release, quant)
    names = ckpt.names()
    fp8 = [n for n in names if ckpt.is_fp8(n)]
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in fp8
    assert all(not ragged(tuple(ckpt.shape(n))) for n in fp8)
    kept = set(quant["modules_to_not_convert"])
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa" in kept
    assert all(not ckpt.is_fp8(f"{m}.weight") for m in kept)
    ckpt.close()
    drafter = json.loads((release / "drafters" / "dflash2" / "drafter.json").read_text())
    assert drafter["kind"] == "dflash2" and drafter["vocab_size"] == config["vocab_size"]
    generation = json.loads((release / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == config["eos_token_id"]


def test_transformers_opens_it_and_its_greedy_tokens_are_the_engines(pipeline: Path) -> None:
    release = pipeline / "release" / MICRO.name
    transformers.logging.set_verbosity_error()
    theirs = open_in_transformers(release)
    corpus = json.loads((release / "corpus.json").read_text())
    tokenizer = load_tokenizer(release)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    drafter = SpeculationConfig(drafter=str(release / "drafters" / "dflash2"), width=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [
        tokenizer.encode((stdlib / name).read_text()[:300]) for name in corpus["heldout_files"][:3]
    ]
    outputs = {}
    for spec in (None, drafter):
        engine = Engine(
            EngineConfig(model=str(release), dtype="float32", kv_pool_mib=64,
                         speculation=spec or SpeculationConfig())
        )  # fmt: skip
        try:
            outputs[spec is None] = [engine.generate([p], params)[0].output_ids for p in prompts]
        finally:
            engine.close()
    assert outputs[True] == outputs[False]  # speculative greedy is plain greedy, exactly
    for prompt, out in zip(prompts, outputs[True], strict=True):
        # each token transformers' argmax, up to fp32 rounding: a barely trained model has
        # near-ties, which FP8 matmuls in another order may break the other way
        logits = hf_tiny.reference_logits(theirs, torch.tensor(prompt + out[:-1]))
        logits = logits[len(prompt) - 1 :]
        chosen = logits.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)
        gap = logits.max(dim=-1).values - chosen
        assert float(gap.max()) <= 1e-3 * float(logits.abs().max()), gap


def test_the_shipped_recipe_leaves_room_for_its_drafters() -> None:
    """Target plus drafters within 32 MiB: the target and its MTP layer take at most 25 MiB."""
    size = release_bytes(SHIPPED.config(eos_id=SHIPPED.tokenizer_vocab - 7, pad_id=0))
    assert size["mtp"] > 0
    assert size["target"] + size["mtp"] <= 25 << 20, size
