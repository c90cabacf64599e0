"""Random rows for the FP8 format tests: every tile its own magnitude (log-uniform over 2^-12 ..
2^12), plus a tile whose amax is below the scale floor and one with large values."""

from __future__ import annotations

import torch

from dhisparse.family.fp8_kv_format import Fp8RowFormat


def random_rows(fmt: Fp8RowFormat, n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, width] in ``dtype``, never zeros or ones."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(n, fmt.n_tiles, 1).uniform_(-12, 12, generator=g))
    values = torch.randn(n, fmt.n_tiles, fmt.tile, generator=g) * mag
    if n >= 2:
        values[0, 0] *= 1e-6 / values[0, 0].abs().max()  # amax below the scale floor
        values[1, -1] *= 3e4 / values[1, -1].abs().max()  # large values
    tail = torch.randn(n, fmt.n_tail, generator=g) * 3
    return torch.cat([values.reshape(n, -1), tail], dim=1).to(dtype)
