"""Small builders shared by worker tests."""

from __future__ import annotations

from dataclasses import replace

import torch

from dhisparse.family.config import ModelConfig
from dhisparse.family.presets import preset
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig
from services.worker.kv.workspace import workspace_bytes
from services.worker.model.decoder import LayerTrace, SparseDecoder
from services.worker.serving.cache import KVCache
from services.worker.weights.model_io import build_model


def make(name: str, seed: int = 0, **kv_kwargs) -> tuple[SparseDecoder, KVCache]:
    model = build_model(preset(name), seed=seed)
    kv_kwargs.setdefault("max_slots", 4)
    kv_kwargs.setdefault("max_model_len", 1024)
    return model, KVCache(model.cfg, KVCacheConfig(**kv_kwargs))


def with_workspace(model_cfg: ModelConfig, cfg: KVCacheConfig) -> KVCacheConfig:
    """``cfg`` with its pool grown by the index-score workspace it holds (on a GPU; nothing on
    the CPU): a test's pool sized for its sessions holds the same sessions on either."""
    return replace(cfg, kv_pool_bytes=cfg.kv_pool_bytes + workspace_bytes(model_cfg, cfg))


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def run_chunks(
    model: SparseDecoder,
    kv: KVCache,
    tokens: torch.Tensor,
    chunks: list[int],
    slot: int = 0,
    trace: list[LayerTrace] | None = None,
) -> torch.Tensor:
    """Feeds ``tokens`` to one slot in chunks of the given sizes, on the tokens' device;
    returns all hidden states."""
    assert sum(chunks) == len(tokens)
    assert kv.admit(slot, f"req-{slot}", len(tokens), len(tokens))
    out, start = [], 0
    for n in chunks:
        batch = ForwardBatch.build([slot], [start], [n], tokens.device)
        out.append(model(tokens[start : start + n], batch, kv, trace=trace))
        start += n
        kv.commit(batch, [start])
    return torch.cat(out)
