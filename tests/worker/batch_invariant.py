"""Batch-invariant numerics for exactness tests on the CPU.

A CPU GEMM rounds a row's result differently with the number of rows beside it (the BLAS picks
its kernel by shape), so a prompt computed in chunks differs from the same prompt computed
whole in the last bits, though every row sees the same inputs. Under ``batch_invariant()``
every matrix product the model runs (``F.linear``, ``einsum``, ``matmul``) is a broadcast
product summed over one contiguous axis, on one thread: each output element is then the same
function of its inputs whatever the batch, so any difference a test finds is a difference of
inputs, not of rounding. Slow; for tiny models only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _contract(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, *operands)`` as one broadcast product, reduced over the
    contracted letters flattened into the last axis."""
    inputs, out = equation.replace(" ", "").split("->")
    specs = inputs.split(",")
    reduced = sorted({c for spec in specs for c in spec} - set(out))
    order = [*out, *reduced]
    product = None
    for spec, t in zip(specs, operands, strict=True):
        present = [c for c in order if c in spec]
        t = t.permute(*(spec.index(c) for c in present))
        sizes = iter(t.shape)
        t = t.reshape([next(sizes) if c in spec else 1 for c in order])
        product = t if product is None else product * t
    assert product is not None
    if not reduced:
        return product.contiguous()
    lead = product.shape[: len(out)]
    return product.contiguous().reshape(*lead, -1).sum(-1)


class _Invariant(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = (x.unsqueeze(-2) * w).sum(-1)
            return y if bias is None else y + bias
        if func is torch.einsum:
            equation, *operands = args
            if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
                operands = list(operands[0])
            return _contract(equation, *operands)
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            a, b = args
            if b.dim() == 1:
                return (a * b).sum(-1)
            return (a.unsqueeze(-1) * b.unsqueeze(-3)).transpose(-1, -2).contiguous().sum(-1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a reduction split over threads would depend on the shape
    try:
        with _Invariant():
            yield
    finally:
        torch.set_num_threads(threads)
