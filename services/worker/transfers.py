"""Small copies between host and device that never make the host wait for unrelated work.

A plain ``torch.tensor(data, device="cuda")`` copies from pageable memory and synchronises the
stream: the host stalls until every kernel queued so far has run, once per copy. A decode step
makes a few such copies before it launches its pass, so each one delays the launch. Here the
data goes into pinned memory from PyTorch's caching host allocator and crosses with one
asynchronous copy; the allocator keeps the pinned block until that copy has run.

The other way, ``readback`` starts copying a result to pinned memory and later waits for that
copy alone, so work queued after it (between-step maintenance) does not delay the result."""

from __future__ import annotations

from collections.abc import Callable

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


def readback(t: torch.Tensor) -> Callable[[], list]:
    """Starts copying ``t`` to the host; the returned function waits for that copy (and what
    was queued before it), not for anything queued after, and returns ``t`` as a list."""
    if t.device.type != "cuda":
        return t.tolist
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))

    def wait() -> list:
        copied.synchronize()
        return host.tolist()

    return wait
