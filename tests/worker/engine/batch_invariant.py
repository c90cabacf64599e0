"""Batch-invariant numerics for exactness tests on the CPU.

A CPU GEMM rounds a row's result differently with the number of rows beside it (the BLAS picks
its kernel by shape), so a prompt computed in chunks differs from the same prompt computed
whole in the last bits, though every row sees the same inputs. Under ``batch_invariant()``
every matrix product the model runs (``F.linear``, ``einsum``, ``matmul``, ``bmm``, the MoE's
grouped GEMM) is a broadcast product summed over one contiguous axis, on one thread: each output element is then the same
function of its inputs whatever the batch, so any difference a test finds is a difference of
inputs, not of rounding. Slow; for tiny models only.

Vectorized transcendental functions (``sigmoid``, ``exp``, ``silu``) round an element of a
tensor's scalar tail differently from one in a full SIMD vector, and which elements form the
tail depends on the element count: a MoE router's [tokens, experts] scores are such a tensor.
Under the mode they run with the last axis padded to a whole number of vectors, so each
element is computed in a vector lane whatever the batch."""

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


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] as a broadcast product summed over K."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).transpose(-1, -2).contiguous().sum(-1)


# torch's grouped GEMM (``moe.grouped_mm`` on the CPU), under either of its names
_GROUPED = {f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f}


def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of x [M, K] times w[e] [K, N], row by row."""
    rows = torch.arange(x.shape[0], dtype=offs.dtype)
    expert = torch.searchsorted(offs, rows, right=True).clamp(max=w.shape[0] - 1)
    return _product(x.unsqueeze(1), w[expert]).squeeze(1)


_LANES = 64  # a multiple of every CPU's SIMD width in fp32 elements
_ELEMENTWISE = {
    torch.sigmoid, torch.Tensor.sigmoid, torch.exp, torch.Tensor.exp, F.silu, torch.tanh,
    torch.Tensor.tanh,
}  # fmt: skip


def _in_lanes(func, t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``func(t)`` with t's last axis padded to a multiple of _LANES."""
    n = t.shape[-1] if t.dim() else 1
    pad = -n % _LANES
    if pad == 0:
        return func(t, *args, **kwargs)
    wide = F.pad(t.reshape(-1, n), (0, pad))
    return func(wide, *args, **kwargs)[:, :n].reshape(t.shape)


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
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm):
            a, b = args
            if b.dim() == 1:
                return (a * b).sum(-1)
            return _product(a, b)
        if func in _ELEMENTWISE and not kwargs.get("inplace") and not kwargs.get("out"):
            return _in_lanes(func, *args, **kwargs)
        if func in _GROUPED:
            x, w = args[0], args[1]
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            return _grouped(x, w, offs)
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
