"""The run's schedule as pure functions of the step: learning rate, attention phase, and the
number of steps a wall-clock budget affords.

The schedule is defined over the *planned* steps: linear warm-up for ``warmup`` steps, then
cosine decay to ``min_lr_frac * lr`` at the last planned step. Steps ``1 .. dense_steps`` train
with dense attention (the indexer learning by distillation alongside), the rest sparse. A run
stopped early by its time budget keeps that schedule: it ends where the budget ran out, with
the learning rate not fully decayed. Planning the steps from measured step times
(``plan_steps``) is how a budgeted run ends its schedule on time."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    lr: float
    warmup: int
    total: int  # planned optimizer steps
    dense_frac: float
    min_lr_frac: float = 0.1

    @property
    def dense_steps(self) -> int:
        return round(self.dense_frac * self.total)

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (1-based)."""
        if step <= self.warmup:
            return self.lr * step / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_frac + (1.0 - self.min_lr_frac) * cos)

    def mode_at(self, step: int) -> str:
        return "dense" if step <= self.dense_steps else "sparse"


def plan_steps(
    budget_s: float,
    elapsed_s: float,
    done: int,
    dense_step_s: float,
    sparse_step_s: float,
    dense_frac: float,
    eval_s: float = 0.0,
    eval_every: int = 0,
    reserve_s: float = 0.0,
) -> int:
    """The most planned steps N whose remaining dense and sparse steps and periodic evals fit
    in the budget, given ``done`` steps (all dense) after ``elapsed_s``; at least ``done``.

    Time left: (f·N − done)·t_dense + (1−f)·N·t_sparse + (N − done)/E·t_eval <= budget −
    elapsed − reserve, linear in N."""
    per_eval = eval_s / eval_every if eval_every > 0 else 0.0
    left = budget_s - elapsed_s - reserve_s
    per_step = dense_frac * dense_step_s + (1.0 - dense_frac) * sparse_step_s + per_eval
    n = math.floor((left + done * (dense_step_s + per_eval)) / per_step)
    return max(done, n)
