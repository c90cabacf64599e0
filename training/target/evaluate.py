"""Held-out evaluation with the attention the model serves with (sparse): loss in nats per
token, bits per byte (each target token weighs the UTF-8 bytes it stands for) and perplexity,
overall and by position in the window, so that a model that uses long context shows it as a
lower loss at later positions."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F

# Bucket edges of the positions (0-based, of the predicted token in its window).
POSITION_EDGES = (0, 256, 1024, 4096, 16384, 65536)


def position_buckets(length: int) -> list[tuple[int, int]]:
    """[(start, stop)] of the buckets that positions 0..length-1 fall in."""
    edges = [e for e in POSITION_EDGES if e < length] + [length]
    return list(itertools.pairwise(edges))


@torch.no_grad()
def heldout_metrics(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    windows: torch.Tensor,
    byte_lengths: torch.Tensor,
    batch_size: int,
    autocast: AbstractContextManager | None = None,
) -> dict[str, float | dict[str, float]]:
    """windows: [N, T+1] token windows (inputs ``[:, :-1]``, targets ``[:, 1:]``);
    ``logits_of``: inputs [B, T] -> logits [B, T, V]; byte_lengths: [V] the bytes each id
    stands for. Returns eval_loss (nats/token), eval_bpb (bits/byte), eval_ppl (per token)
    and ``eval_bpb_by_position`` {"a-b": bits/byte of the targets at positions a..b-1}."""
    t = windows.shape[1] - 1
    nats = torch.zeros(t, dtype=torch.float64)  # summed over windows, per position
    nbytes = torch.zeros(t, dtype=torch.float64)
    lengths = byte_lengths.to(windows.device)
    for a in range(0, len(windows), batch_size):
        w = windows[a : a + batch_size]
        with autocast or nullcontext():
            logits = logits_of(w[:, :-1])
        ce = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="none"
        ).view(len(w), t)
        nats += ce.sum(dim=0).double().cpu()
        nbytes += lengths[w[:, 1:]].sum(dim=0).double().cpu()
    count = len(windows) * t
    per_token = float(nats.sum()) / count
    total_bytes = float(nbytes.sum())
    by_position = {
        f"{lo}-{hi}": float(nats[lo:hi].sum()) / max(float(nbytes[lo:hi].sum()), 1.0) / math.log(2)
        for lo, hi in position_buckets(t)
    }
    return {
        "eval_loss": per_token,
        "eval_bpb": float(nats.sum()) / max(total_bytes, 1.0) / math.log(2),
        "eval_ppl": math.exp(per_token),
        "eval_bytes_per_token": total_bytes / count,
        "eval_bpb_by_position": by_position,
    }
