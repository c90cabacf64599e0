"""The load benchmark's variants (a serving mode, with or without speculation under a width
schedule) and one engine per variant: every engine gets the same KV pool plus its own fixed
allocations (the capacity benchmark's rule), prepared histories seated by ``HistoryImport``,
and, speculating, the acceptance control over its MTP layer's proposals."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.core import UsageError
from dhisparse.tokenizer import ByteTokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.kv.workspace import workspace_bytes
from services.worker.serving.hierarchy_build import hierarchy_fixed_bytes
from services.worker.speculative.config import SpeculationConfig

MODES = ("resident", "hisparse", "adaptive")
SPEC = ("off", "fixed", "paper", "online")  # no speculation, or MTP under a width schedule


@dataclass(frozen=True)
class Variant:
    mode: str
    spec: str = "off"

    @property
    def name(self) -> str:
        return self.mode if self.spec == "off" else f"{self.mode}/mtp-{self.spec}"


@dataclass(frozen=True)
class EngineSizing:
    """What every engine of one context shares."""

    pool_bytes: int  # the KV budget (``bench/load/pool.py``), before each engine's fixed bytes
    slots: int  # max_num_seqs
    max_model_len: int
    max_prefill_tokens: int
    page_size: int
    hot_cache_rows: int
    kv_cache_dtype: str
    spec_width: int
    graphs: bool
    fused_kernels: bool  # passes run the fused kernels (``ops.fusion``; a GPU only)
    host_bytes: int  # the host store's arena, shared by the hierarchy engines


def _config(model, name: str, v: Variant, s: EngineSizing) -> tuple[EngineConfig, int]:
    """``v``'s engine configuration and the fixed bytes beside the KV budget in its pool."""
    device = next(model.parameters()).device.type
    dtype = model.dtype
    hierarchy = v.mode != "resident"
    common = dict(
        model=name, device=device, dtype=str(dtype).removeprefix("torch."), mode=v.mode,
        page_size=s.page_size, max_num_seqs=s.slots, max_model_len=s.max_model_len,
        max_prefill_tokens=s.max_prefill_tokens, hot_cache_rows=s.hot_cache_rows,
        kv_cache_dtype=s.kv_cache_dtype, graphs=GraphConfig(s.graphs),
        fused_kernels=s.fused_kernels,
        speculation=SpeculationConfig(None if v.spec == "off" else "mtp", s.spec_width,
                                      "fixed" if v.spec == "off" else v.spec),
        durable_sessions=hierarchy, owner=f"load-{v.name}",
        prefix_cache=False,  # every prompt is a prepared one: HistoryImport seats it
        host_arena_mib=s.host_bytes / 2**20,
    )  # fmt: skip
    kv_cfg = EngineConfig(kv_pool_mib=s.pool_bytes / 2**20, **common).kv_config(dtype)
    fixed = workspace_bytes(model.cfg, kv_cfg)
    if hierarchy:
        fixed += hierarchy_fixed_bytes(model.cfg, kv_cfg)
    return EngineConfig(kv_pool_mib=(s.pool_bytes + fixed) / 2**20, **common), fixed


def group_bytes(model, name: str, variants: list[Variant], s: EngineSizing) -> int:
    """Device bytes the engines of ``variants`` reserve at once (each its pool: the KV budget
    and its fixed allocations), beside the model's weights."""
    return sum(s.pool_bytes + _config(model, name, v, s)[1] for v in variants)


def check_fits(model, name: str, variants: list[Variant], s: EngineSizing) -> None:
    """Raises UsageError, before any engine is built, when the group's pools cannot fit in the
    device memory left beside the weights (with a tenth to spare for activations, graphs and
    the allocator): a run that would fail minutes in, at its last engine, fails at once."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    need = group_bytes(model, name, variants, s)
    if need > 0.9 * free:
        names = ", ".join(v.name for v in variants)
        raise UsageError(
            f"the engines {names} need {need / 2**30:.1f} GiB of KV pools together, and "
            f"{free / 2**30:.1f} of the device's {total / 2**30:.1f} GiB are free beside the "
            "weights: run them on a larger GPU (an H200) or with fewer --spec variants"
        )


def build(model, name: str, v: Variant, s: EngineSizing, store=None) -> tuple[Engine, dict]:
    """``v``'s engine on the model's device and what it was built with. ``store``: the host
    store hierarchy engines share (each its own owner, durable sessions on)."""
    cfg, fixed = _config(model, name, v, s)
    hierarchy = v.mode != "resident"
    link = (store, store.mapping) if hierarchy and store is not None else None
    eng = Engine(cfg, model=model, tokenizer=ByteTokenizer(), host=link)
    info = {
        "engine": v.name, "pool_bytes": s.pool_bytes + fixed, "fixed_bytes": fixed,
        "kv_row_bytes": eng.kv.row_bytes, "tokens_capacity": eng.kv.tokens_capacity,
        "durable_sessions": eng.kv.sessions is not None, "layout": eng.kv.layout(),
        "graphs_off_reason": eng.graphs_off_reason,
    }  # fmt: skip
    return eng, info


def close(engines: list[Engine]) -> None:
    for eng in engines:
        eng.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
