"""Small host-to-device copies that never make the host wait.

A plain ``torch.tensor(data, device="cuda")`` copies from pageable memory and synchronises the
stream: the host stalls until every kernel queued so far has run, once per copy. A decode step
makes a few such copies before it launches its pass, so each one delays the launch. Here the
data goes into pinned memory from PyTorch's caching host allocator and crosses with one
asynchronous copy; the allocator keeps the pinned block until that copy has run."""

from __future__ import annotations

import torch


def to_device(
    data: list | torch.Tensor, device: torch.device | str, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """``data`` (a list, possibly nested, or a CPU tensor) as a tensor on ``device``, without a
    stream sync."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.as_tensor(data, dtype=dtype, device=device)
    if isinstance(data, torch.Tensor):
        host = data.to(dtype).pin_memory()
    else:
        host = torch.tensor(data, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)
