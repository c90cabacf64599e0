"""One in-process engine per engine key, sized as the benchmark's ``Sizing`` says, with its
kernels warmed up before anything is timed."""

from __future__ import annotations

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.kv.workspace import workspace_bytes
from services.worker.request.request import SamplingParams
from services.worker.serving.hierarchy_build import hierarchy_fixed_bytes
from services.worker.speculative.config import SpeculationConfig

from .config import EngineKey
from .setup import Sizing, Target, drafter_source


def engine_config(
    target: Target,
    key: EngineKey,
    sizing: Sizing,
    device: str,
    drafter_dir: str,
    spec_width: int,
    pool_bytes: int | None = None,
    durable: bool | None = None,
    owner: str = "local",
) -> EngineConfig:
    return EngineConfig(
        model=target.spec, device=device, dtype=target.dtype, mode=key.mode,
        kv_pool_mib=(pool_bytes or sizing.budget_bytes) / 2**20,
        hot_cache_rows=sizing.hot_cache_rows, host_arena_mib=sizing.host_arena_bytes / 2**20,
        page_size=sizing.page_size, max_num_seqs=sizing.slots,
        max_model_len=sizing.max_model_len, max_prefill_tokens=sizing.max_prefill_tokens,
        speculation=SpeculationConfig(
            None if key.drafter == "off" else drafter_source(key.drafter, drafter_dir),
            spec_width, key.schedule,
        ),
        durable_sessions=durable, owner=owner,
    )  # fmt: skip


def pool_bytes(target: Target, cfg: EngineConfig, sizing: Sizing) -> tuple[int, int]:
    """(pool, fixed): every mode gets the budget plus its fixed allocations: the index-score
    workspace, and in a hierarchy mode prefill scratch, hot-cache metadata and staging for its
    verification block."""
    dtype = target.model.dtype
    kv_cfg = cfg.kv_config(dtype)
    fixed = workspace_bytes(target.model.cfg, kv_cfg)
    if cfg.mode != "resident":
        fixed += hierarchy_fixed_bytes(target.model.cfg, kv_cfg)
    return sizing.budget_bytes + fixed, fixed


def build_engine(
    target: Target,
    key: EngineKey,
    sizing: Sizing,
    device: str,
    drafter_dir: str,
    spec_width: int,
    warmup_prompts: list[list[int]],
    host: LocalHostStore | None = None,
    durable: bool | None = None,
) -> tuple[Engine, dict]:
    """The engine of ``key`` and what it was built with (for the JSON). ``host``: a host
    store shared by the benchmark's engines (each its own owner), as workers share a node's;
    hierarchy engines then keep durable sessions unless ``durable`` is False."""
    probe = engine_config(target, key, sizing, device, drafter_dir, spec_width)
    pool, fixed = pool_bytes(target, probe, sizing)
    owner = f"bench-{key.name}"
    cfg = engine_config(target, key, sizing, device, drafter_dir, spec_width, pool, durable, owner)
    link = None if host is None or cfg.mode == "resident" else (host, host.mapping)
    eng = Engine(cfg, model=target.model, tokenizer=target.tokenizer, host=link)
    # Warm-up: compile every kernel variant (prefill, decode, verify) before anything is timed.
    params = SamplingParams(temperature=0.0, max_tokens=2 * spec_width + 2, ignore_eos=True)
    eng.generate(warmup_prompts, params)
    info = {
        "engine": key.name,
        "pool_bytes": pool,
        "fixed_bytes": fixed,
        "drafter_source": cfg.speculation.drafter,
        "durable_sessions": eng.kv.sessions is not None,
        "kv_tokens_capacity": eng.kv.tokens_capacity,
        "kv_row_bytes": eng.kv.row_bytes,
        "layout": eng.kv.layout(),
    }
    return eng, info
