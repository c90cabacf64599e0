"""The training loop: it learns (overfitting a tiny corpus), it is deterministic and resumes
bit-for-bit, its schedule is the documented one, and the CLI leaves a loadable model, a
history, a summary and a plot."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.worker.weights.model_io import load_model
from tests.training.helpers import micro_dsv4, micro_glm, small_corpus, tiny_run
from training.target.__main__ import main
from training.target.loop import train
from training.target.plot import plot
from training.target.schedule import Schedule, plan_steps


def test_overfitting_a_tiny_corpus_lowers_the_loss(tmp_path: Path) -> None:
    cfg = tiny_run(tmp_path / "run", small_corpus(tmp_path), steps=30, lr=1e-2, warmup=5)
    tr = train(cfg)
    losses = [h["lm_loss"] for h in tr.history if "lm_loss" in h]
    assert len(losses) == 30
    assert abs(losses[0] - math.log(264)) < 0.05  # the zero head predicts uniformly
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses
    kls = [h["idx_kl"] for h in tr.history if "idx_kl" in h]
    assert all(k >= 0 for k in kls)
    assert [h["mode"] for h in tr.history if "mode" in h] == ["dense"] * 15 + ["sparse"] * 15


def test_a_compressed_windowed_target_trains_too(tmp_path: Path) -> None:
    """The dsv4 topology (compressed source with a local window, Reuse, Reindex) trains
    through both phases: the loss falls and the indexer KL stays finite and >= 0."""
    preset_json = str(micro_dsv4(tmp_path))
    cfg = tiny_run(
        tmp_path / "run", small_corpus(tmp_path), preset=preset_json, steps=24, lr=1e-2,
        warmup=4,
    )  # fmt: skip
    tr = train(cfg)
    losses = [h["lm_loss"] for h in tr.history if "lm_loss" in h]
    assert len(losses) == 24 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < losses[0] - 1.5, losses
    kls = [h["idx_kl"] for h in tr.history if "idx_kl" in h]
    assert kls and all(math.isfinite(k) and k >= 0 for k in kls)
    assert {h["mode"] for h in tr.history if "mode" in h} == {"dense", "sparse"}


def test_resume_continues_bit_for_bit(tmp_path: Path) -> None:
    corpus = small_corpus(tmp_path)
    straight = train(tiny_run(tmp_path / "a", corpus, steps=6))
    half = tiny_run(tmp_path / "b", corpus, steps=6, stop_at=3)
    first = train(half)
    assert first.step == 3 and not (tmp_path / "b" / "model").exists()
    resumed = train(replace(half, stop_at=0, resume=True))
    assert resumed.step == 6
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = [
        {k: v for k, v in h.items() if k != "elapsed"} for h in straight.history if "loss" in h
    ]
    assert strip == [
        {k: v for k, v in h.items() if k != "elapsed"} for h in resumed.history if "loss" in h
    ]
    lines = [json.loads(x) for x in (tmp_path / "b" / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in lines if "loss" in h] == list(range(1, 7))
    with pytest.raises(ValueError, match="lr"):
        train(replace(half, lr=1e-4, stop_at=0, resume=True))


def test_schedule_warms_up_then_decays_over_the_planned_steps() -> None:
    s = Schedule(lr=1.0, warmup=10, total=110, dense_frac=0.8, min_lr_frac=0.1)
    assert s.lr_at(1) == pytest.approx(0.1) and s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(60) == pytest.approx(0.55) and s.lr_at(110) == pytest.approx(0.1)
    lrs = [s.lr_at(i) for i in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    assert s.dense_steps == 88 and s.mode_at(88) == "dense" and s.mode_at(89) == "sparse"


def test_planned_steps_fill_the_budget() -> None:
    kw = dict(dense_step_s=0.1, sparse_step_s=0.2, dense_frac=0.75, eval_s=2.0, eval_every=100)
    n = plan_steps(300.0, 20.0, 20, reserve_s=8.0, **kw)

    def needed(total: int) -> float:
        dense = round(0.75 * total) - 20
        evals = (total - 20) / 100
        return 20.0 + dense * 0.1 + (total - round(0.75 * total)) * 0.2 + evals * 2.0 + 8.0

    assert needed(n) <= 300.0 + 0.2 < needed(n + 2)
    assert plan_steps(10.0, 20.0, 20, **kw) == 20  # nothing left: stop where it is


def test_cli_trains_exports_and_plots(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    model_json = str(micro_glm(tmp_path))
    args = ["--out", str(out), "--preset", model_json, "--corpus", str(small_corpus(tmp_path))]
    args += ["--steps", "4", "--batch-size", "2", "--seq-len", "32", "--warmup", "2"]
    args += ["--eval-every", "2", "--ckpt-every", "2", "--eval-tokens", "512", "--no-progress"]
    args += ["--device", "cpu"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 4 and summary["eval_bpb"] > 0
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == 4 and info["tokens"] == 4 * 2 * 32 and info["stopped_by"] == "steps"
    assert info["heldout_bits_per_byte"] == pytest.approx(summary["eval_bpb"])
    assert (out / "ckpt.pt").exists()
    model = load_model(out / "model")
    assert model.cfg.name == "micro-glm"
    png = plot(out, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_budgeted_run_plans_its_steps_after_timing_warmup(tmp_path: Path) -> None:
    cfg = tiny_run(tmp_path / "run", small_corpus(tmp_path), steps=0, time_budget_s=6.0)
    tr = train(replace(cfg, warmup=20, log_every=5))
    assert tr.total is not None and tr.total > 20 and tr.step <= tr.total
    assert any(h["step"] == 20 and "eval_loss" in h for h in tr.history)  # timed evaluation
    info = json.loads((tmp_path / "run" / "training.json").read_text())
    assert info["planned_steps"] == tr.total and info["stopped_by"] in ("steps", "time_budget")
    with pytest.raises(ValueError, match="warmup"):
        train(replace(cfg, warmup=10))
