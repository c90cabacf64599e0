"""The engine's configuration: model, device, serving mode, scheduling limits, and the
settings of adaptive residency, CUDA graphs and speculative decoding, each a frozen dataclass
passed whole (the worker builds them from its settings)."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from dhisparse.family.parallel_layout import SINGLE, ParallelConfig
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.kv.config import FollowerPrefetch, KVCacheConfig, ResidencyConfig
from services.worker.speculative.config import SpeculationConfig

if TYPE_CHECKING:
    from services.worker.parallel.comm import Comm

log = logging.getLogger(__name__)


# The KV pool when none is given (``auto_kv_pool_mib``): on a CPU this much room for sessions
# beside the pool's fixed allocations (an in-process engine's default pool is this size); on a
# GPU this share of the device memory free once the model is loaded, the rest left to
# activations, CUDA graphs and the allocator.
CPU_KV_POOL_MIB = 256.0
GPU_KV_POOL_SHARE = 0.8


def mib_up(nbytes: int) -> float:
    """``nbytes`` in whole MiB, rounded up."""
    return float(-(-nbytes >> 20))


def auto_kv_pool_mib(free_bytes: int | None, fixed_bytes: int = 0) -> float:
    """The KV pool in MiB for a device with ``free_bytes`` free once the model is loaded (None:
    a CPU, whose memory the pool does not measure): ``GPU_KV_POOL_SHARE`` of them, whole
    MiB; on a CPU ``CPU_KV_POOL_MIB`` for sessions beside ``fixed_bytes`` (the allocations that
    do not grow with sessions: staging, scratch and metadata), whole MiB."""
    if free_bytes is None:
        return CPU_KV_POOL_MIB + mib_up(fixed_bytes)
    return float(int(GPU_KV_POOL_SHARE * free_bytes) >> 20)


def device_free_bytes(device: str) -> int | None:
    """Bytes free on ``device`` (a GPU's, as the driver reports them); None on a CPU."""
    d = torch.device(device)
    if d.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(d)
    return int(free)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny-glm"  # preset name or model directory
    device: str = "cpu"
    dtype: str | None = None  # default: ``serving_dtype``
    # how KV rows and index keys are stored (vLLM's --kv-cache-dtype): "auto" = the serving
    # dtype; "fp8" = packed FP8 rows (docs/fp8_kv.md)
    kv_cache_dtype: str = "auto"
    # real families: projections and experts in FP8 or the serving dtype (``served_weights``);
    # FP8's activation mode (services/worker/ops/fp8_linear.py)
    weight_dtype: str = "auto"
    fp8_mode: str = "w8a16"
    seed: int = 0  # random-init seed for presets, and the default sampling seed (``sampling_seed``)
    mode: str = "resident"  # resident | hisparse | adaptive
    kv_pool_mib: float | None = CPU_KV_POOL_MIB  # None: sized by the engine (auto_kv_pool_mib)
    hot_cache_rows: int | None = None  # B per request and source (hierarchy); default 2k
    host_arena_mib: float = 256.0  # private host arena when no kv_host_store is attached
    resolver: str = "auto"  # torch | triton | auto (triton on a GPU)
    attention_backend: str = "auto"  # torch | triton | auto (triton on a GPU)
    residency: ResidencyConfig = field(default_factory=ResidencyConfig)  # mode adaptive
    graphs: GraphConfig = field(default_factory=GraphConfig)  # on a GPU
    fused_kernels: bool = True  # on a GPU: passes run the fused kernels (``ops.fusion``)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    parallel: ParallelConfig = SINGLE  # the ranks one worker spans (``family.parallel_layout``)
    owner: str = "local"  # the store's owner of this engine's host regions (a worker id, or
    # a data-parallel rank's: ``ParallelConfig.store_owner``)
    page_size: int = 16
    max_num_seqs: int = 32
    max_model_len: int = 4096
    # Prefill tokens per step: a longer prompt, or a step's prompts together, run in chunks
    # of the budget between decode steps; unchunked, each prompt runs whole.
    max_prefill_tokens: int = 8192
    chunked_prefill: bool = True
    top_k_rows: int | None = None  # override the indexer's k
    # Hierarchy modes: back up what a successor needs to resume each session after this process
    # dies (manifests, index keys, write-through of imported history). None: on in hierarchy
    # modes; resident mode keeps no host backups, so it has nothing to resume from.
    durable_sessions: bool | None = None
    # hierarchy modes: requests leave their complete pages in the node's host store and
    # admissions import the longest cached prefix (``serving.prefix_reuse``; --no-prefix-cache)
    prefix_cache: bool = True
    # hierarchy modes: when an index producer's followers resolve (a policy, exact either way)
    followers: FollowerPrefetch = field(default_factory=FollowerPrefetch)

    @property
    def on_cpu(self) -> bool:
        return torch.device(self.device).type == "cpu"

    def serving_dtype(self) -> str | None:
        """The dtype the engine computes in: ``dtype``; else float32 on a CPU (bf16 GEMMs there
        run without bf16 units, converting every operand: several times slower); else None,
        the model config's."""
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.on_cpu else None

    def served_weights(self) -> str:
        """``weight_dtype`` as the engine loads it: "auto" on a CPU is "bf16", an FP8
        checkpoint dequantized once at load into the serving dtype (the CPU has no FP8 kernels:
        its reference matmul would dequantize every call; the values are the same); else as
        given ("auto": FP8 where the checkpoint stores it, ``weight_format.resolve``)."""
        return "bf16" if self.weight_dtype == "auto" and self.on_cpu else self.weight_dtype

    @property
    def durable(self) -> bool:
        if self.mode == "resident":
            return False
        return True if self.durable_sessions is None else self.durable_sessions

    def sampling_seed(self) -> int:
        """The seed of the default sampling generator, which unseeded requests draw from: ``seed``
        for an engine of no store owner (``"local"``: its runs repeat); a worker's mixes in its
        owner id and a nonce of its own, so that no two workers of a node, nor a worker and its
        successor, draw one random stream (an adopted or resumed session would otherwise reuse
        the uniforms its earlier tokens were drawn with)."""
        if self.owner == "local":
            return self.seed
        digest = hashlib.blake2b(
            f"{self.seed}/{self.owner}".encode() + os.urandom(16), digest_size=8
        ).digest()
        return int.from_bytes(digest, "little") >> 1

    @property
    def pass_prefill_tokens(self) -> int:
        """The most prompt tokens one pass computes for one request: a chunk, or unchunked a
        whole prompt (shorter than the context)."""
        if self.chunked_prefill:
            return self.max_prefill_tokens
        return max(self.max_prefill_tokens, self.max_model_len)

    def kv_config(self, dtype: torch.dtype) -> KVCacheConfig:
        if self.kv_pool_mib is None:
            raise ValueError("kv_pool_mib is sized by the engine before the KV cache is built")
        block = self.speculation.block
        return KVCacheConfig(
            mode=self.mode,
            kv_pool_bytes=int(self.kv_pool_mib * (1 << 20)),
            page_size=self.page_size,
            max_slots=self.max_num_seqs,
            max_model_len=self.max_model_len,
            hot_cache_rows=self.hot_cache_rows,
            max_prefill_tokens=self.pass_prefill_tokens,
            host_arena_bytes=int(self.host_arena_mib * (1 << 20)) // 4096 * 4096,
            owner=self.owner,
            resolver=self.backend(self.resolver),
            residency=self.residency,
            spec_block=block,
            ring_extra=max(8, block),
            durable=self.durable,
            dtype=dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            followers=self.followers,
            device=self.device,
        )

    def backend(self, choice: str) -> str:
        """The kernels behind ``choice`` (``resolver`` or ``attention_backend``) on this device."""
        if choice == "auto":
            return "triton" if self.device.startswith("cuda") else "torch"
        if choice not in ("torch", "triton"):
            raise ValueError(f"unknown backend {choice!r}; choose torch, triton or auto")
        return choice


def with_sized_pool(
    cfg: EngineConfig, comm: Comm, free: int | None, ceiling: int | None = None, fixed: int = 0
) -> EngineConfig:
    """``cfg`` with its KV pool sized (``auto_kv_pool_mib``) when it gives none, from ``free``
    bytes on its device once the model is loaded (``device_free_bytes``; None on a CPU) or,
    on a CPU, the pool's ``fixed`` bytes (``serving.pool_size.pool_fixed_bytes``), and at most
    ``ceiling`` bytes (what its seats can use: ``serving.cache.pool_ceiling``); the size is
    logged either way. A group's ranks (every one calls this at the same point) take
    the smallest free memory among them: they hold one batch's rows (or, data-parallel, seats
    the gateway counts alike)."""
    if cfg.kv_pool_mib is not None:
        log.info("KV pool: %.0f MiB (--kv-pool-mib)", cfg.kv_pool_mib)
        return cfg
    if free is not None and comm.size > 1:
        every = comm.gather_objects(free)
        free = comm.broadcast_object(min(every) if every else None)
    mib = auto_kv_pool_mib(free, fixed)
    most = mib_up(ceiling) if ceiling is not None else mib
    if free is None:
        mib = min(mib, most)
        log.info(
            "KV pool: %.0f MiB (auto: the CPU default, %.0f MiB for sessions beside %.0f MiB "
            "that does not grow with them; --kv-pool-mib sets it)",
            mib, CPU_KV_POOL_MIB, fixed / (1 << 20),
        )  # fmt: skip
    elif mib > most:
        mib = most
        log.info(
            "KV pool: %.0f MiB (auto: all that %d seats of %d tokens can use, below %.0f%% of "
            "the %.0f MiB free on %s; --kv-pool-mib sets it)",
            mib, cfg.max_num_seqs, cfg.max_model_len, 100 * GPU_KV_POOL_SHARE, free / (1 << 20),
            cfg.device,
        )  # fmt: skip
    else:
        log.info(
            "KV pool: %.0f MiB (auto: %.0f%% of the %.0f MiB free on %s once the model is "
            "loaded; --kv-pool-mib sets it)",
            mib, 100 * GPU_KV_POOL_SHARE, free / (1 << 20), cfg.device,
        )  # fmt: skip
    return replace(cfg, kv_pool_mib=mib)
