"""Worker settings from the environment (``DHISPARSE_WORKER_*``), overridable by flags."""

from __future__ import annotations

import socket

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dhisparse.devices import resolve_device
from dhisparse.family.parallel_layout import ParallelConfig
from services.worker.engine.config import EngineConfig
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.kv.config import ResidencyConfig
from services.worker.speculative.config import SpeculationConfig


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DHISPARSE_WORKER_")

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9101  # 0: no metrics endpoint
    worker_id: str = ""  # default: <hostname>:<port>
    served_model_name: str = ""  # default: the model config's name
    kv_store: str = ""  # host:port of the node's kv_host_store ("" = none)
    kv_store_timeout_s: float = 5.0  # every store call fails within this (a dead store never hangs)
    lease_ttl_s: float = 10.0  # the store's lease on this process, renewed every third
    # A session resumed from a dead predecessor is aborted if the gateway does not re-attach
    # its client within this long.
    attach_timeout_s: float = 60.0
    durable_sessions: bool | None = None  # None: on in hierarchy modes (see EngineConfig)
    prefix_cache: bool = True  # hierarchy modes: reuse cached prefixes (see EngineConfig)
    # Freeze the Python heap once the engine is built: later collections skip what start-up
    # made (``services/worker/engine/heap.py``).
    gc_freeze: bool = True
    # Before serving, run a short synthetic conversation so the kernels and CUDA graphs the
    # first requests meet are built at start-up (``engine/warm_up.py``); None: on a GPU.
    warmup: bool | None = None
    # Test-only fault injection (the adoption tests): a file path; while nothing is there, the
    # worker creates it and SIGKILLs itself right after the store moved a peer's session to it
    # in ``Adopt``, before streaming any of it — a kill inside the adoption, once across
    # restarts. "" (always, outside tests): never.
    test_kill_in_adopt: str = ""

    model: str = "models/glm-dsa-mini"  # the shipped trained target; a preset gives random weights
    device: str = "auto"  # auto: cuda when torch sees a CUDA device, else cpu
    dtype: str | None = None
    kv_cache_dtype: str = "auto"  # auto: the serving dtype; fp8: packed FP8 rows and keys
    weight_dtype: str = "auto"
    fp8_mode: str = "w8a16"
    seed: int = 0
    mode: str = "adaptive"  # the paper's system; resident: the baseline
    # None: sized at start-up (on a GPU from its free memory: ``engine.config.auto_kv_pool_mib``)
    kv_pool_mib: float | None = None
    hot_cache_rows: int | None = None
    host_arena_mib: float = 256.0
    resolver: str = "auto"
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    cuda_graphs_mtp: bool = True  # the MTP layer's passes too
    fused_kernels: bool = True
    graph_capture: str = "second"
    reserve_pages: int = 0
    populate_pages: int = 256
    populate_payback: float = 1.0
    overlap_refills: bool = False
    reclaim_order: str = "largest"
    drafter: str | None = None  # None (or "none"): plain decoding
    spec_width: int = 8
    width_policy: str = "fixed"
    # --drafter mtp: the hot vocabulary its draft steps score (``SpeculationConfig``)
    speculative_token_map: str | None = None
    draft_vocab_size: int | None = None
    page_size: int = 16
    max_num_seqs: int = 32
    max_model_len: int = 4096
    max_prefill_tokens: int = 8192  # prefill tokens per step (chunks of longer prompts)
    chunked_prefill: bool = True
    top_k_rows: int | None = None
    # the ranks one worker spans (``family.parallel_layout``; one process per rank, ``group``)
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    data_parallel_attention: bool = False

    def warms_up(self, device: str) -> bool:
        """Whether the worker warms its engine up before serving, on ``device`` (its engine's)."""
        return self.warmup if self.warmup is not None else device.startswith("cuda")

    @field_validator("drafter")
    @classmethod
    def _no_drafter(cls, v: str | None) -> str | None:
        return None if v in ("", "none") else v

    @field_validator("speculative_token_map")
    @classmethod
    def _no_token_map(cls, v: str | None) -> str | None:
        return v or None

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}:{self.port}"

    def engine_config(self, rank: int = 0) -> EngineConfig:
        """The engine's configuration; ``rank``: of a worker's group, on its own GPU (rank r
        on ``cuda:r`` when the device is ``cuda``)."""
        device = resolve_device(self.device)
        parallel = ParallelConfig(
            self.tensor_parallel_size, self.expert_parallel, self.data_parallel_attention
        )
        return EngineConfig(
            model=self.model,
            device=f"cuda:{rank}" if device == "cuda" and self.tensor_parallel_size > 1 else device,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            weight_dtype=self.weight_dtype,
            fp8_mode=self.fp8_mode,
            seed=self.seed,
            mode=self.mode,
            kv_pool_mib=self.kv_pool_mib,
            hot_cache_rows=self.hot_cache_rows,
            host_arena_mib=self.host_arena_mib,
            resolver=self.resolver,
            attention_backend=self.attention_backend,
            graphs=GraphConfig(self.cuda_graphs, self.graph_capture, self.cuda_graphs_mtp),
            fused_kernels=self.fused_kernels,
            residency=ResidencyConfig(
                reserve_pages=self.reserve_pages,
                populate_pages=self.populate_pages,
                populate_payback=self.populate_payback,
                overlap_refills=self.overlap_refills,
                reclaim_order=self.reclaim_order,
            ),
            speculation=SpeculationConfig(
                self.drafter,
                self.spec_width,
                self.width_policy,
                token_map=self.speculative_token_map,
                draft_vocab_size=self.draft_vocab_size,
            ),
            owner=parallel.store_owner(self.resolved_worker_id(), rank),
            page_size=self.page_size,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_prefill_tokens=self.max_prefill_tokens,
            chunked_prefill=self.chunked_prefill,
            top_k_rows=self.top_k_rows,
            durable_sessions=self.durable_sessions,
            prefix_cache=self.prefix_cache,
            parallel=parallel,
        )
