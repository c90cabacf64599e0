"""The engine's configuration: model, device, serving mode and its knobs, scheduling limits and
speculative decoding, in one frozen dataclass (the worker builds it from its settings)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.kv.cache import KVCacheConfig


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny-glm"  # preset name or model directory
    device: str = "cpu"
    dtype: str | None = None  # default: the model config's
    seed: int = 0  # random-init seed for presets, and the engine's default sampling seed
    mode: str = "resident"  # resident | hisparse | adaptive
    kv_pool_mib: float = 256.0
    hot_cache_rows: int | None = None  # B per request and source (hierarchy); default 2k
    host_arena_mib: float = 256.0  # private host arena when no kv_host_store is attached
    resolver: str = "auto"  # torch | triton | auto (triton on a GPU)
    reserve_pages: int = 0  # adaptive: admission reserve, in pages
    populate_pages: int = 256  # adaptive: optional pages refilled per attempt
    populate_payback: float = 1.0  # adaptive: refill only with >= this x V/k steps left
    overlap_refills: bool = False  # adaptive, GPU: refill copies beside the decode passes
    reclaim_order: str = "largest"
    attention_backend: str = "auto"  # torch | triton | auto (triton on a GPU)
    cuda_graphs: bool = True  # on a GPU: decode passes replayed as captured CUDA graphs
    # when a graph key is captured: at its "second" sighting, or when "consecutive" passes
    # meet it (a batch that changes every step, as in ramps and drains, is never captured)
    graph_capture: str = "second"
    owner: str = "local"  # worker id that owns this engine's host regions
    page_size: int = 16
    max_num_seqs: int = 32
    max_model_len: int = 4096
    max_prefill_tokens: int = 16384
    top_k_rows: int | None = None  # override the indexer's k
    drafter: str | None = None  # dflash | dspark | dflash2 (random weights) or a checkpoint dir
    spec_width: int = 8  # K_max: target queries per verify round, anchor included
    width_policy: str = "fixed"  # fixed | paper | online
    # Hierarchy modes: back up what a successor needs to resume each session after this process
    # dies (manifests, index keys, write-through of imported history). None: on in hierarchy
    # modes; resident mode keeps no host backups, so it has nothing to resume from.
    durable_sessions: bool | None = None

    @property
    def durable(self) -> bool:
        if self.mode == "resident":
            return False
        return True if self.durable_sessions is None else self.durable_sessions

    def kv_config(self, dtype: torch.dtype) -> KVCacheConfig:
        return KVCacheConfig(
            mode=self.mode,
            kv_pool_bytes=int(self.kv_pool_mib * (1 << 20)),
            page_size=self.page_size,
            max_slots=self.max_num_seqs,
            max_model_len=self.max_model_len,
            hot_cache_rows=self.hot_cache_rows,
            max_prefill_tokens=self.max_prefill_tokens,
            host_arena_bytes=int(self.host_arena_mib * (1 << 20)) // 4096 * 4096,
            owner=self.owner,
            resolver=self._backend(self.resolver),
            reserve_pages=self.reserve_pages,
            populate_pages=self.populate_pages,
            populate_payback=self.populate_payback,
            overlap_refills=self.overlap_refills,
            reclaim_order=self.reclaim_order,
            spec_block=self.spec_width if self.drafter else 1,
            ring_extra=max(8, self.spec_width if self.drafter else 1),
            durable=self.durable,
            dtype=dtype,
            device=self.device,
        )

    def _backend(self, choice: str) -> str:
        if choice == "auto":
            return "triton" if self.device.startswith("cuda") else "torch"
        if choice not in ("torch", "triton"):
            raise ValueError(f"unknown backend {choice!r}; choose torch, triton or auto")
        return choice
