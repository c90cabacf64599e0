"""Training tests run tiny models whose ops are too small to gain from intra-op threads; one
thread also keeps them fast when other processes load the CPU (spinning OpenMP workers then
slow every op down many times over)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
