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
element is computed in a vector lane whatever the batch.

The broadcast products are formed a block of leading rows at a time (``_in_blocks``), a cache-
sized block each: a whole prefill's [rows, out, in] product would go through main memory. A row's
result is the same in any block, so the blocks change the speed only, never a bit."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

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
    aligned = []
    for spec, t in zip(specs, operands, strict=True):
        present = [c for c in order if c in spec]
        t = t.permute(*(spec.index(c) for c in present))
        sizes = iter(t.shape)
        aligned.append(t.reshape([next(sizes) if c in spec else 1 for c in order]))

    def contract(*ts: torch.Tensor) -> torch.Tensor:
        product = ts[0]
        for t in ts[1:]:
            product = product * t
        if not reduced:
            return product.contiguous()
        return product.contiguous().reshape(*product.shape[: len(out)], -1).sum(-1)

    if not out:
        return contract(*aligned)
    shape = torch.broadcast_shapes(*(t.shape for t in aligned))
    return _in_blocks(contract, aligned, shape[0], math.prod(shape[1:]))


_BLOCK_ELEMENTS = 1 << 16  # of a broadcast product: 256 KB of fp32, within a CPU core's L2


def _in_blocks(
    fn: Callable[..., torch.Tensor], operands: list[torch.Tensor], rows: int, row_elements: int
) -> torch.Tensor:
    """``fn(*operands)``, computed over blocks of the leading axis (``rows`` long, broadcast
    from 1 where an operand has one row) and joined; ``row_elements``: elements of the
    product ``fn`` forms per row."""
    step = max(1, _BLOCK_ELEMENTS // max(row_elements, 1))
    if rows <= step:
        return fn(*operands)
    blocks = [
        fn(*(t if t.shape[0] == 1 else t[a : a + step] for t in operands))
        for a in range(0, rows, step)
    ]
    return torch.cat(blocks)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] as a broadcast product summed over K."""

    def product(rows: torch.Tensor) -> torch.Tensor:  # a's rows, M leading
        a = rows.movedim(0, -2)
        ab = (a.unsqueeze(-1) * b.unsqueeze(-3)).transpose(-1, -2).contiguous().sum(-1)
        return ab.movedim(-2, 0)

    if a.dim() < 2:  # a vector: one row
        return product(a.unsqueeze(0))
    m, k = a.shape[-2:]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]).numel()
    return _in_blocks(product, [a.movedim(-2, 0)], m, batch * k * b.shape[-1]).movedim(0, -2)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K].T as a broadcast product summed over K."""

    def product(rows: torch.Tensor) -> torch.Tensor:
        return (rows.unsqueeze(-2) * w).sum(-1)

    rows = x.reshape(-1, x.shape[-1])
    y = _in_blocks(product, [rows], rows.shape[0], w.numel())
    return y.reshape(*x.shape[:-1], w.shape[0])


# torch's grouped GEMM (``moe.grouped_mm`` on the CPU), under either of its names
_GROUPED = {f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f}


def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of x [M, K] times w[e] [K, N], row by row."""
    rows = torch.arange(x.shape[0], dtype=offs.dtype)
    expert = torch.searchsorted(offs, rows, right=True).clamp(max=w.shape[0] - 1)

    def product(x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        return _product(x.unsqueeze(1), w[expert]).squeeze(1)

    return _in_blocks(product, [x, expert], x.shape[0], w.shape[1] * w.shape[2])


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
            y = _linear(x, w)
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
