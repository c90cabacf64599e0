"""FP8 KV store and gather over a uint8 pool of packed rows, in plain torch: the references of
``fp8_store_triton`` and ``fp8_gather_triton`` (the codec is ``fp8_kv_codec.py``)."""

from __future__ import annotations

import torch

from dhisparse.family.fp8_kv_format import Fp8RowFormat
from services.worker.ops.fp8_kv_codec import pack, unpack


def fp8_store_ref(
    fmt: Fp8RowFormat, pool: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor
) -> None:
    """Pack rows [N, width] into pool (uint8 [S, row_bytes]) at rows dst [N] int; ``-1`` skips
    a row. Destinations are distinct."""
    keep = dst >= 0
    pool[dst[keep]] = pack(fmt, rows[keep])


def fp8_gather_ref(
    fmt: Fp8RowFormat, pool: torch.Tensor, src: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows src [M] int of pool, dequantized: [M, width] in ``dtype``; ``-1`` gives zeros."""
    out = unpack(fmt, pool[src.clamp(min=0)], dtype)
    return out.masked_fill((src < 0)[:, None], 0.0)
