"""The device a worker runs on when asked for ``auto``: the GPU when CUDA is available."""

from __future__ import annotations

AUTO = "auto"


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` when torch sees a CUDA device, else ``cpu``; any other name as
    given (``cpu``, ``cuda``, ``cuda:1``)."""
    if device != AUTO:
        return device
    import torch  # here: `dhisparse up --device cpu` needs no torch import to plan

    return "cuda" if torch.cuda.is_available() else "cpu"
