"""Small builders shared by the speculative-decoding tests."""

from __future__ import annotations

import functools

import torch

from dhisparse.family.presets import preset
from services.worker.model.decoder import SparseDecoder
from services.worker.speculative import Drafter, DrafterConfig, build_drafter
from services.worker.weights.model_io import build_model
from training.drafter.data import run_target

KINDS = ["dflash", "dspark", "dflash2"]
PRESETS = ["tiny-glm", "tiny-dsv4"]


@functools.cache
def target(name: str = "tiny-glm") -> SparseDecoder:
    return build_model(preset(name), seed=0)


def drafter(kind: str, name: str = "tiny-glm", seed: int = 1, **overrides) -> Drafter:
    overrides.setdefault("window", 16)
    t = target(name)
    return build_drafter(DrafterConfig.for_target(t.cfg, kind, **overrides), t, seed=seed).eval()


def with_context(d: Drafter, slots: list[int], lengths: list[int], seed: int = 0) -> Drafter:
    """Gives each slot a committed context of random tokens (target features from one
    prefill per slot)."""
    t = d.borrowed.target
    if d.ring is None:
        d.init_ring(max_slots=max(slots) + 1)
    g = torch.Generator().manual_seed(seed)
    for s, n in zip(slots, lengths, strict=True):
        d.begin(s)
        toks = torch.randint(0, 256, (1, n), generator=g)
        tp = run_target(t, toks, d.cfg.target_layers)
        d.append_context(
            torch.full((n,), s), torch.arange(n), {i: f[0] for i, f in tp.features.items()}
        )
    return d
