"""DeepSeek-V4's tail RoPE as one kernel (``ops/rope_tail.py``) against its torch form: bit for
bit under the Triton interpreter on the CPU and on the GPU (``gpu``), every dtype, forward and
inverse, heads or none, V4's widths (head 512 with 64 rotated, the indexer's 128 with 64, a
rope-only row, a ragged one), tables of the real ropes (plain and YaRN) at random positions; and
on the GPU a V4 layer's rotations through ``v4_rope.rope_tail`` fused and unfused."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.rope_spec import RopeSpec
from services.worker.model.v4_rope import PassRope, rope_tables, rope_tail
from services.worker.ops.fusion import kernel_fusion
from services.worker.ops.rope_tail import rope_tail_ref, rope_tail_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (heads or None, D, rope_dim)
SHAPES = [(8, 512, 64), (None, 512, 64), (4, 128, 64), (None, 64, 64), (3, 72, 40)]
YARN = RopeSpec(
    theta=160000.0, kind="yarn", factor=16.0, original_max_position=65536, beta_fast=32.0,
    beta_slow=1.0,
)  # fmt: skip
ROPES = (RopeSpec(theta=10000.0), YARN)


def _case(n: int, heads: int | None, d: int, rope_dim: int, rope: RopeSpec, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    shape = (n, d) if heads is None else (n, heads, d)
    x = (torch.randn(shape, generator=g) * 3).to(device)
    positions = torch.randint(0, 200_000, (n,), generator=g).to(device)
    return x, rope_tables(positions, rope, rope_dim)


def _check(device: str) -> None:
    for i, (heads, d, rope_dim) in enumerate(SHAPES):
        for j, rope in enumerate(ROPES):
            for dtype in DTYPES:
                x, (cos, sin) = _case(5, heads, d, rope_dim, rope, 10 * i + j, device)
                x = x.to(dtype)
                for inverse in (False, True):
                    want = rope_tail_ref(x, cos, sin, inverse)
                    got = rope_tail_triton(x, cos, sin, inverse)
                    assert got.dtype == dtype and got.shape == x.shape
                    assert torch.equal(got, want), (heads, d, rope_dim, rope.kind, dtype, inverse)


def test_the_kernel_is_the_torch_form_bit_for_bit() -> None:
    _check("cpu")


def test_a_strided_head_view_and_an_empty_batch() -> None:
    x, (cos, sin) = _case(4, 6, 128, 64, YARN, 7, "cpu")
    view = x[:, ::2]  # every other head: a head stride of two rows
    assert torch.equal(rope_tail_triton(view, cos, sin), rope_tail_ref(view, cos, sin))
    empty = torch.empty(0, 4, 128)
    assert rope_tail_triton(empty, cos[:0], sin[:0]).shape == (0, 4, 128)
    with pytest.raises(ValueError, match="do not fit"):
        rope_tail_triton(x, cos[:3], sin[:3])


@pytest.mark.gpu
def test_on_the_gpu_the_kernel_and_the_model_path_are_the_torch_form() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check("cuda")
    x, _ = _case(7, 8, 512, 64, YARN, 3, "cuda")
    x = x.to(torch.bfloat16)
    at = PassRope(torch.randint(0, 9000, (7,), device="cuda"))
    with kernel_fusion(True):
        fused_out = [rope_tail(x, at, YARN, 64, inverse) for inverse in (False, True)]
    with kernel_fusion(False):
        plain = [rope_tail(x, at, YARN, 64, inverse) for inverse in (False, True)]
    for f, p in zip(fused_out, plain, strict=True):
        assert torch.equal(f, p)
