"""The training run: steps until the planned total, the time budget or ``stop_at``; logging,
periodic evaluation and checkpoints; at the end a final evaluation, a checkpoint and the
exported weights.

With ``steps=0`` the total is planned from the budget: steps 1..``CALIBRATE[1]`` (all within
warm-up, whose learning rates do not depend on the total) are timed, then one sparse step and
one evaluation, and ``schedule.plan_steps`` fixes the total, which the checkpoint keeps (a
resumed run does not re-plan). The budget stays a hard stop in case the plan was optimistic."""

from __future__ import annotations

import json
import math
import time

import torch
from tqdm import tqdm

from training.target.config import TrainConfig
from training.target.data import sample_crops
from training.target.schedule import plan_steps
from training.target.trainer import Trainer

CALIBRATE = (5, 20)  # steps timed to plan a budgeted run: after step 5 .. step 20
_RESERVE_S = 2.0  # final checkpoint and export, beyond a final evaluation
_PLAN_FILL = 0.97  # plan for this share of the budget: step times drift


def train(cfg: TrainConfig) -> Trainer:
    """Runs (or resumes) ``cfg``; returns the trainer with its model and history.

    ``time_budget_s`` counts from the first step of this invocation and covers the final
    evaluation and export (estimated from the last evaluation's duration). With
    ``run_budget_s`` the steps are planned from that, and an invocation that reaches its own
    budget before the planned total checkpoints and returns (``stopped_by`` "time_budget",
    no export): resume it to go on."""
    if cfg.steps == 0 and cfg.warmup < CALIBRATE[1]:
        raise ValueError(f"a budgeted run needs warmup >= {CALIBRATE[1]} steps to plan in")
    tr = Trainer(cfg)
    start = time.perf_counter()

    def elapsed() -> float:
        return tr.elapsed_before + time.perf_counter() - start

    bar = tqdm(total=tr.total, initial=tr.step, disable=not cfg.progress, desc="train", unit="step")
    marks: dict[int, float] = {}
    stopped_by = "steps"
    while True:
        if tr.total is not None and tr.step >= tr.total:
            break
        if cfg.stop_at and tr.step >= cfg.stop_at:
            stopped_by = "stop_at"
            break
        run_s = time.perf_counter() - start
        if cfg.time_budget_s and run_s + tr.eval_s + _RESERVE_S >= cfg.time_budget_s:
            stopped_by = "time_budget"
            break
        losses, after, lr, mode = tr.train_step()
        step = tr.step
        bar.update(1)
        if tr.total is None and step >= CALIBRATE[0] and (not marks or step >= CALIBRATE[1]):
            # From the first step past CALIBRATE[0] (a resumed run may start later); a sync
            # only at the two ends, so that the steps between overlap host and device as usual.
            marks[step] = _synced_time(tr)
            if step >= CALIBRATE[1] and len(marks) > 1:
                tr.total, tr.eval_s, plan = _plan(tr, marks, start, elapsed())
                bar.total = tr.total
                bar.write(json.dumps(plan))
        last = step == tr.total
        switched = step > 1 and tr.schedule.mode_at(step - 1) != mode  # plot marks the switch
        if step % cfg.log_every == 0 or last or switched:
            record = {
                "step": step,
                "mode": mode,
                "loss": float(losses.loss),
                **{name: float(v) for name, v in losses.parts.items()},
                **after,
                "lr": lr,
                "tokens": step * tr.tokens_per_step,
                "elapsed": elapsed(),
            }
            if not math.isfinite(record["loss"]):
                tr.checkpoint(elapsed())
                raise FloatingPointError(f"loss is {record['loss']} at step {step}")
            tr.log(record)
            tok_s = (step * tr.tokens_per_step) / max(record["elapsed"], 1e-9)
            bar.set_postfix(
                loss=f"{record['lm_loss']:.3f}", kl=f"{record['idx_kl']:.3f}", tok_s=f"{tok_s:.3g}"
            )
        if cfg.eval_every and step % cfg.eval_every == 0 and not last:
            t0 = _synced_time(tr)
            _log_eval(tr, elapsed())
            tr.eval_s = _synced_time(tr) - t0
        if cfg.ckpt_every and step % cfg.ckpt_every == 0 and not last:
            tr.checkpoint(elapsed())
    bar.close()
    # a budget stop comes before the planned total: with a run budget, a later call goes on
    if stopped_by == "stop_at" or (stopped_by == "time_budget" and cfg.run_budget_s):
        tr.checkpoint(elapsed())
        return tr
    metrics = _log_eval(tr, elapsed())
    tr.checkpoint(elapsed())
    tr.export(metrics, elapsed(), stopped_by)
    return tr


def _log_eval(tr: Trainer, elapsed: float) -> dict[str, float]:
    metrics = tr.evaluate()
    tokens = tr.step * tr.tokens_per_step
    tr.log({"step": tr.step, "tokens": tokens, "elapsed": elapsed, **metrics})
    return metrics


def _plan(
    tr: Trainer, marks: dict[int, float], start: float, elapsed: float
) -> tuple[int, float, dict]:
    """Times one sparse step (twice: the first may compile or autotune) and one evaluation,
    then plans the total; returns it, the evaluation's duration and the measurements. Leaves
    the parameters, the optimizer and the training data stream untouched."""
    cfg = tr.cfg
    first, last = min(marks), max(marks)
    dense_s = (marks[last] - marks[first]) / max(1, last - first)
    crop = sample_crops(
        tr.stream, cfg.batch_size, cfg.seq_len + 1, torch.Generator().manual_seed(cfg.seed + 1)
    )
    times = []
    for _ in range(2):
        t0 = _synced_time(tr)
        tr.losses(crop, "sparse", torch.Generator().manual_seed(cfg.seed + 2))
        times.append(_synced_time(tr) - t0)
    tr.opt.zero_grad(set_to_none=True)
    t0 = _synced_time(tr)
    _log_eval(tr, elapsed)
    eval_s = _synced_time(tr) - t0
    total = plan_steps(
        (cfg.run_budget_s or cfg.time_budget_s) * _PLAN_FILL,
        tr.elapsed_before + time.perf_counter() - start,
        tr.step,
        dense_s,
        times[-1],
        cfg.dense_frac,
        eval_s,
        cfg.eval_every,
        reserve_s=eval_s + _RESERVE_S,
    )
    total = max(total, CALIBRATE[1] + 1)
    plan = {"planned_steps": total, "dense_step_s": dense_s, "sparse_step_s": times[-1]}
    return total, eval_s, {**plan, "eval_s": eval_s}


def _synced_time(tr: Trainer) -> float:
    if tr.device.type == "cuda":
        torch.cuda.synchronize(tr.device)
    return time.perf_counter()
