"""How a cached object's rows are stored (``kv_cache_dtype``): in the serving dtype (``auto``),
or packed into FP8 rows (``fp8``: ``docs/fp8_kv.md``, the MLA row of 656 B and the index key of
132 B at the released dims). Everything that moves rows (hot cache, host backups, the resolver,
staging, session backups) moves *stored* rows: ``stored_width`` elements of ``storage`` each,
plain bytes in fp8. Only writers (``store``) and readers (``gather``) see the codec.

On CUDA the FP8 store and gather are the Triton kernels; elsewhere the torch references, which
write the same bytes and read the same values (``tests/worker/ops/test_fp8_kv.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhisparse.family.config import ModelConfig
from dhisparse.family.fp8_kv_format import Fp8RowFormat, index_key_format, mla_row_format
from services.worker.ops.fp8_kv import fp8_gather_ref, fp8_store_ref

KV_CACHE_DTYPES = ("auto", "fp8")
FP8_INPUTS = (torch.float32, torch.bfloat16)  # what the FP8 store quantizes from


@dataclass(frozen=True)
class RowCodec:
    """Rows of ``width`` elements in the serving ``dtype``, stored as they are (``fp8`` None)
    or packed by ``fp8``."""

    width: int
    dtype: torch.dtype
    fp8: Fp8RowFormat | None = None

    @property
    def storage(self) -> torch.dtype:
        """The element type of a stored row."""
        return self.dtype if self.fp8 is None else torch.uint8

    @property
    def stored_width(self) -> int:
        """Elements of ``storage`` per stored row."""
        return self.width if self.fp8 is None else self.fp8.row_bytes

    @property
    def row_bytes(self) -> int:
        return self.stored_width * torch.empty((), dtype=self.storage).element_size()

    def store(self, pool: torch.Tensor, locs: torch.Tensor, values: torch.Tensor) -> None:
        """values [N, width] into pool [S, stored_width] at rows locs [N] (distinct; in fp8
        ``-1`` skips a row)."""
        if self.fp8 is None:
            pool[locs] = values.to(pool.dtype)
        elif pool.is_cuda:
            from services.worker.ops.fp8_store_triton import fp8_store_triton

            fp8_store_triton(self.fp8, pool, values, locs)
        else:
            fp8_store_ref(self.fp8, pool, values, locs)

    def gather(
        self, pool: torch.Tensor, locs: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows locs [...] of pool (``-1``: zeros) -> [..., width] in ``dtype``; fp8 rows are
        dequantized (exact: e4m3 times a power of two). ``out``: [M >= locs.numel(), width]
        to write into (a fixed workspace); the result is then a view of its first rows."""
        if self.fp8 is None:
            rows = pool[locs.clamp(min=0)].masked_fill((locs < 0).unsqueeze(-1), 0)
            return rows if out is None else _into(out, rows.view(-1, self.width), locs.shape)
        flat = locs.reshape(-1)
        if pool.is_cuda:
            from services.worker.ops.fp8_gather_triton import fp8_gather_triton

            dst = None if out is None else out[: flat.numel()]
            rows = fp8_gather_triton(self.fp8, pool, flat, self.dtype, out=dst)
            return rows.view(*locs.shape, self.width)
        rows = fp8_gather_ref(self.fp8, pool, flat, self.dtype)
        if out is None:
            return rows.view(*locs.shape, self.width)
        return _into(out, rows, locs.shape)


def _into(out: torch.Tensor, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    dst = out[: len(rows)]
    dst.copy_(rows)
    return dst.view(*shape, rows.shape[-1])


@dataclass(frozen=True)
class KVCodecs:
    """The codecs of a worker's KV state: MLA rows of every source, and index keys."""

    rows: RowCodec
    keys: RowCodec

    @property
    def fp8(self) -> bool:
        return self.rows.fp8 is not None


def kv_codecs(cfg: ModelConfig, kv_cache_dtype: str, dtype: torch.dtype) -> KVCodecs:
    """The codecs ``kv_cache_dtype`` asks for over a model served in ``dtype``; raises a
    ValueError naming the field when the model's rows or keys have no FP8 format."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose from {KV_CACHE_DTYPES}"
        )
    if kv_cache_dtype == "auto":
        return KVCodecs(RowCodec(cfg.d_kv, dtype), RowCodec(cfg.d_index, dtype))
    if dtype not in FP8_INPUTS:
        raise ValueError(
            f"kv_cache_dtype='fp8' quantizes from float32 or bfloat16, not the serving dtype "
            f"{dtype}: serve in one of those or use kv_cache_dtype='auto'"
        )
    try:
        row = mla_row_format(cfg.d_latent, cfg.d_rope)
    except ValueError as e:
        raise ValueError(
            f"kv_cache_dtype='fp8': model {cfg.name!r} stores rows of d_latent={cfg.d_latent} + "
            f"d_rope={cfg.d_rope}, which have no FP8 row format ({e}); use kv_cache_dtype='auto'"
        ) from e
    try:
        key = index_key_format(cfg.d_index)
    except ValueError as e:
        raise ValueError(
            f"kv_cache_dtype='fp8': model {cfg.name!r} has index keys of d_index={cfg.d_index}, "
            f"which have no FP8 key format ({e}); use kv_cache_dtype='auto'"
        ) from e
    return KVCodecs(RowCodec(cfg.d_kv, dtype, row), RowCodec(cfg.d_index, dtype, key))
