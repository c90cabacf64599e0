"""Whether an engine reuses cached prefixes (through the node's host store,
``serving.prefix_reuse``, or in resident mode by sharing device pages,
``serving.device_prefix``), and the salt that names its pages: what its rows depend on besides
their tokens."""

from __future__ import annotations

import logging

from dhisparse.family.presets import PRESETS
from dhisparse.paths import resolve_path
from services.kv_host_store.prefix_index import PrefixSalt
from services.worker.engine.config import EngineConfig
from services.worker.serving.cache import KVCache
from services.worker.serving.device_prefix import DevicePrefixReuse, unshareable
from services.worker.serving.prefix_reuse import HostRanks, PrefixReuse

log = logging.getLogger(__name__)

# the files of a checkpoint directory whose contents decide its rows
_WEIGHT_SUFFIXES = (".safetensors", ".json")


def model_identity(model: str, seed: int) -> str:
    """A preset's name and seed (its weights are drawn from it), or a checkpoint's weights and
    configuration files by name, size and modification time (two workers of a node loading the
    same files agree; a checkpoint replaced in place does not match its predecessor); a model
    handed to the engine built (tests, benchmarks), by the name it was given."""
    if model in PRESETS:
        return f"preset:{model}:seed={seed}"
    root = resolve_path(model)
    if not root.is_dir():  # a model handed to the engine in memory under this name
        return f"given:{model}:seed={seed}"
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return "checkpoint:" + ",".join(parts)


def prefix_salt(cfg: EngineConfig, kv: KVCache) -> PrefixSalt:
    """The salt of ``cfg``'s rows: its model, the numerics it computes rows with (serving
    dtype, weight format, attention kernels, top-k, parallel layout), its topology's sources
    (the MTP layer's is one more), KV dtype and page size."""
    numerics = "|".join((
        str(kv.cfg.dtype), cfg.served_weights(), cfg.fp8_mode,
        cfg.backend(cfg.attention_backend), f"topk={kv.model_cfg.index_topk}", cfg.parallel.name,
        f"sources={len(kv.model_cfg.sources)}",
    ))  # fmt: skip
    return PrefixSalt(
        model_identity(cfg.model, cfg.seed), numerics, kv.cfg.kv_cache_dtype, kv.cfg.page_size
    )


def off_reason(cfg: EngineConfig, kv: KVCache) -> str | None:
    """Why ``cfg``'s engine does not reuse prefixes, or None when it does."""
    if not cfg.prefix_cache:
        return "--no-prefix-cache"
    if cfg.mode == "resident":  # pages are shared on the device
        why = unshareable(kv.model_cfg, kv.cfg.page_size)
        return None if why is None else f"resident mode shares no page of {why}"
    if kv.sessions is None:
        return "durable sessions are off, or the host arena is private to this process"
    return None


def prefix_reuse(
    cfg: EngineConfig, kv: KVCache, context: int = 0, ranks: HostRanks | None = None
) -> PrefixReuse | DevicePrefixReuse | None:
    """The engine's prefix reuse — through the node's host store in the hierarchy modes, by
    sharing device pages in resident mode — or None (logged with the reason); ``context``:
    the positions its drafter keeps a context of its own over; ``ranks``: the worker's ranks
    sharing the host arena (``PrefixReuse``)."""
    why = off_reason(cfg, kv)
    if why is not None:
        log.info("prefix cache off: %s", why)
        return None
    salt = prefix_salt(cfg, kv)
    where = "device pages" if cfg.mode == "resident" else "the host store"
    log.info("prefix cache on (%s): pages of %d tokens, model %s", where, salt.page_size,
             salt.model)  # fmt: skip
    if cfg.mode == "resident":
        return DevicePrefixReuse(kv, salt, context)
    return PrefixReuse(kv, salt, context, ranks)
