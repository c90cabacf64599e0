"""The shipped model's training as one resumable command (``python -m training run``): stages
run in order, each skipped once done, and an invocation runs them until its time budget is
spent, so that a run of many minutes goes through commands of a few minutes each on a machine
that keeps ``out`` between them.

Stages (``out`` holds each one's directory):

- ``corpus``: ``training.corpus`` over this machine's Python (stdlib and site-packages);
- one per phase of the recipe (``target-4k``, ``target-16k``): ``training.target`` on the
  recipe's config.json, steps planned from the phase's share of the recipe's training time,
  resumed across invocations; a later phase starts from the previous phase's weights;
- ``release``: ``release/<name>``, the model directory that ships (``release``);
- one per drafter of the recipe (``dflash2``): ``training.drafter.train`` against the released
  target on the corpus's training tokens, in one invocation of the drafter's seconds, into
  ``release/<name>/drafters/<kind>``.

``pipeline.json`` in ``out`` records the stages done and the seconds each invocation spent."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from training.corpus.bpe import eos_id
from training.corpus.build import build as build_corpus
from training.corpus.tokens import TOKENIZER_DIR
from training.drafter.train import TrainConfig as DrafterTrainConfig
from training.drafter.train import train as train_drafter
from training.recipe import Phase, Recipe
from training.release import write_release
from training.target.checkpoint import CKPT_FILE, MODEL_DIR
from training.target.config import TrainConfig
from training.target.loop import train

RECORD = "pipeline.json"
CONFIG = "config.json"
CORPUS = "corpus"
RELEASE = "release"
DRAFTERS = "drafters"  # in the release: one directory per drafter kind
_MARGIN_S = 5.0  # kept free of an invocation's budget: start-up of a stage, the record


@dataclass(frozen=True)
class PipelineConfig:
    out: str
    recipe: Recipe
    budget_s: float  # this invocation's wall time
    device: str = "cpu"
    progress: bool = True
    corpus_roots: tuple[str, ...] | None = None  # default: this Python's stdlib and packages
    min_stage_s: float = 45.0  # a training stage left less than this waits for the next call
    target_s: float | None = None  # the target's training time; default: the recipe's
    drafter_s: float | None = None  # each drafter's training time; default: the recipe's

    def effective_recipe(self) -> Recipe:
        """The recipe with this run's training times."""
        r = self.recipe
        if self.target_s is not None:
            r = replace(r, target_s=self.target_s)
        if self.drafter_s is not None:
            r = replace(r, drafters=tuple(replace(d, seconds=self.drafter_s) for d in r.drafters))
        return r


def run(cfg: PipelineConfig) -> dict[str, Any]:
    """Runs the next stages within ``cfg.budget_s``; returns (and records) where the pipeline
    stands: the stages done, the one it stopped in, and the seconds spent."""
    began = time.monotonic()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    record = _read(out)
    record.setdefault("recipe", cfg.recipe.name)
    if record["recipe"] != cfg.recipe.name:
        raise ValueError(f"{out} holds recipe {record['recipe']!r}, not {cfg.recipe.name!r}")
    recipe = cfg.effective_recipe()
    times = {"target_s": recipe.target_s, "drafter_s": [d.seconds for d in recipe.drafters]}
    cfg = replace(cfg, recipe=recipe, target_s=None, drafter_s=None)
    done: list[str] = record.setdefault("done", [])

    def left() -> float:
        return cfg.budget_s - (time.monotonic() - began) - _MARGIN_S

    stopped_in = None
    for stage in stages(cfg.recipe):
        if stage in done:
            continue
        if stage != CORPUS and left() < max(cfg.min_stage_s, _needs(cfg.recipe, stage)):
            stopped_in = stage
            break
        if stage != CORPUS and record.setdefault("times", times) != times:
            # fixed by the first training stage: the phases' steps are planned from them
            raise ValueError(f"{out} was planned with {record['times']}, not {times}")
        if _run_stage(cfg, out, stage, left()):
            done.append(stage)
            _write(out, record)
        else:
            stopped_in = stage
            break
    record.setdefault("invocations", []).append(round(time.monotonic() - began, 1))
    record["next"] = stopped_in
    _write(out, record)
    return {"out": str(out), "done": list(done), "next": stopped_in,
            "seconds": record["invocations"][-1]}  # fmt: skip


def stages(recipe: Recipe) -> list[str]:
    return [CORPUS, *(p.name for p in recipe.phases), RELEASE, *(d.kind for d in recipe.drafters)]


def _run_stage(cfg: PipelineConfig, out: Path, stage: str, budget_s: float) -> bool:
    """Runs one stage; whether it is done (a training phase may need more invocations)."""
    recipe = cfg.recipe
    if stage == CORPUS:
        build_corpus(
            out / CORPUS, roots=cfg.corpus_roots, vocab_size=recipe.tokenizer_vocab,
            progress=cfg.progress,
        )  # fmt: skip
        tokenizer = out / CORPUS / TOKENIZER_DIR
        eos = eos_id(tokenizer)
        (out / CONFIG).write_text(json.dumps(recipe.config(eos, eos), indent=2) + "\n")
        return True
    phases = {p.name: i for i, p in enumerate(recipe.phases)}
    if stage in phases:
        i = phases[stage]
        before = recipe.phases[i - 1].name if i else None
        tr = train(_phase_config(cfg, out, recipe.phases[i], budget_s, before))
        return tr.total is not None and tr.step >= tr.total
    release = out / RELEASE / recipe.name
    if stage == RELEASE:
        runs = [out / p.name for p in recipe.phases]
        write_release(
            release, runs[-1] / MODEL_DIR, out / CORPUS, runs, recipe.name, recipe.max_shard_mb
        )
        return True
    (d,) = [d for d in recipe.drafters if d.kind == stage]
    train_drafter(
        DrafterTrainConfig(
            target=str(release),
            drafter=d.kind,
            steps=1 << 40,
            time_budget_s=d.seconds,
            batch_size=d.batch_size,
            seq_len=d.seq_len,
            blocks_per_seq=d.blocks_per_seq,
            lr=d.lr,
            device=cfg.device,
            corpus=str(out / CORPUS),
            window=d.window,
            out=str(release / DRAFTERS / d.kind),
            progress=cfg.progress,
        )
    )
    return True


def _needs(recipe: Recipe, stage: str) -> float:
    """The seconds a stage must be left to start: a drafter trains in one invocation."""
    return next((d.seconds for d in recipe.drafters if d.kind == stage), 0.0)


def _phase_config(
    cfg: PipelineConfig, out: Path, phase: Phase, budget_s: float, before: str | None
) -> TrainConfig:
    recipe = cfg.recipe
    run_dir = out / phase.name
    phase_s = recipe.target_s * phase.share
    return TrainConfig(
        out=str(run_dir),
        preset=str(out / CONFIG),
        corpus=str(out / CORPUS),
        steps=0,
        time_budget_s=budget_s,
        run_budget_s=phase_s,
        batch_size=phase.batch_size,
        seq_len=phase.seq_len,
        lr=phase.lr,
        warmup=phase.warmup,
        dense_frac=phase.dense_frac,
        kl_queries=phase.kl_queries,
        eval_every=recipe.eval_every,
        eval_tokens=recipe.eval_tokens,
        ckpt_every=recipe.eval_every,
        device=cfg.device,
        resume=(run_dir / CKPT_FILE).exists(),
        init_from=str(out / before) if before else None,
        progress=cfg.progress,
        max_shard_mb=recipe.max_shard_mb,
    )


def _read(out: Path) -> dict[str, Any]:
    path = out / RECORD
    return json.loads(path.read_text()) if path.exists() else {}


def _write(out: Path, record: dict[str, Any]) -> None:
    tmp = out / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(out / RECORD)
