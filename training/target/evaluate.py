"""Held-out evaluation: next-byte loss in nats/byte, bits/byte and perplexity, with the
attention the model serves with (sparse)."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F

from services.worker.model.model import DSAModel
from training.target.forward import Mode, train_forward


@torch.no_grad()
def heldout_metrics(
    model: DSAModel,
    windows: torch.Tensor,
    batch_size: int,
    mode: Mode = "sparse",
    autocast: AbstractContextManager | None = None,
) -> dict[str, float]:
    """windows: [N, T+1] token windows (inputs ``[:, :-1]``, targets ``[:, 1:]``)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for a in range(0, len(windows), batch_size):
        w = windows[a : a + batch_size]
        with autocast or nullcontext():
            out = train_forward(model, w[:, :-1], mode, index_loss=False)
        logits = out.logits.float().reshape(-1, out.logits.shape[-1])
        total += float(F.cross_entropy(logits, w[:, 1:].reshape(-1), reduction="sum"))
        count += w[:, 1:].numel()
    model.train(was_training)
    nats = total / count
    return {"eval_loss": nats, "eval_bpb": nats / math.log(2), "eval_ppl": math.exp(nats)}
