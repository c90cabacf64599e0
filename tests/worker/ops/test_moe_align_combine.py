"""The MoE layer's kernels around its two expert GEMMs under the interpreter: the block
alignment (``moe_align_triton``) equal to ``align_blocks`` and the combine
(``moe_combine_triton``) equal to ``fp8_moe_triton``'s torch lines, both bit for bit, on fresh
random routings and values (including pairs of experts held elsewhere, whose rows are garbage)."""

from __future__ import annotations

import pytest
import torch

from services.worker.ops.moe_align import MoEBlocks, align_blocks
from services.worker.ops.moe_align_triton import FUSED_MAX_PAIRS, align, align_blocks_triton
from services.worker.ops.moe_combine_triton import combine_triton, fits
from services.worker.ops.moe_pairs import sum_choices


def _routing(seed: int, t: int, k: int, e: int, kind: str) -> torch.Tensor:
    """idx [T, k] in [0, E]: distinct experts per token ("random"), every pair on the last
    expert ("one_expert"), or ids with repeats and a third of them E, held elsewhere."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random" and k <= e:
        return torch.rand(t, e, generator=g).topk(k, dim=1).indices
    if kind == "one_expert":
        return torch.full((t, k), e - 1, dtype=torch.int64)
    idx = torch.randint(0, e, (t, k), generator=g)
    return torch.where(torch.rand(t, k, generator=g) < 1 / 3, e, idx)


def _assert_same(a: MoEBlocks, b: MoEBlocks) -> None:
    assert a.block_m == b.block_m and a.n_pairs == b.n_pairs
    assert a.sorted_ids.dtype == b.sorted_ids.dtype == torch.int32
    assert a.block_expert.dtype == b.block_expert.dtype == torch.int32
    assert torch.equal(a.sorted_ids, b.sorted_ids)
    assert torch.equal(a.block_expert, b.block_expert)


@pytest.mark.parametrize(
    ("t", "k", "e", "block_m"),
    [(1, 8, 256, 16), (7, 8, 64, 16), (33, 8, 64, 32), (9, 3, 5, 16), (40, 4, 16, 64),
     (3, 2, 1, 16), (130, 8, 64, 16)],
)  # fmt: skip
@pytest.mark.parametrize("kind", ["random", "one_expert", "elsewhere"])
def test_alignment_equals_align_blocks(t, k, e, block_m, kind) -> None:
    idx = _routing(t * 31 + e, t, k, e, kind)
    _assert_same(align_blocks_triton(idx, e, block_m), align_blocks(idx, e, block_m))


def test_alignment_at_every_pair_count() -> None:
    """Every pair count 0..40 (T tokens of top-2 over 5 experts, ids E among them), int32
    ids as well as int64."""
    for t in range(21):
        for dtype in (torch.int64, torch.int32):
            idx = _routing(t, t, 2, 5, "elsewhere").to(dtype)
            _assert_same(align_blocks_triton(idx, 5, 16), align_blocks(idx, 5, 16))


def test_alignment_past_the_kernel_threshold() -> None:
    """Past ``FUSED_MAX_PAIRS`` ``align`` takes the torch form; the kernels give the same
    blocks there too, so the shape rule never changes the output."""
    t = FUSED_MAX_PAIRS // 4 + 3
    idx = _routing(5, t, 4, 4, "elsewhere")
    assert idx.numel() > FUSED_MAX_PAIRS
    _assert_same(align_blocks_triton(idx, 4, 64), align_blocks(idx, 4, 64))
    _assert_same(align(idx, 4, 64), align_blocks(idx, 4, 64))  # on the CPU: the torch form


def _combine_ref(y: torch.Tensor, idx: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
    """``fp8_moe_triton``'s torch lines after its down GEMM."""
    t, k = idx.shape
    y = torch.where((idx.reshape(-1, 1) < e), y, 0)
    return sum_choices(y.view(t, k, -1)).to(dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize(("t", "k", "e", "d"), [(1, 8, 256, 300), (5, 8, 64, 512), (3, 4, 5, 513),
                                                (4, 2, 3, 64), (2, 1, 3, 100), (6, 16, 8, 260)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_combine_equals_the_torch_form(t, k, e, d, dtype) -> None:
    g = torch.Generator().manual_seed(t * k + d)
    # magnitudes apart by 2**10 between rows, so the order of the adds shows in the bits
    y = torch.randn(t * k, d, generator=g) * torch.exp2(
        torch.randint(-5, 6, (t * k, 1), generator=g)
    )
    idx = _routing(d, t, k, e, "elsewhere")
    y[(idx.reshape(-1) == e)] = float("nan")  # undefined rows of experts held elsewhere
    out = combine_triton(y, idx, e, dtype)
    assert out.dtype == dtype and out.shape == (t, d)
    assert torch.equal(_bits(out), _bits(_combine_ref(y, idx, e, dtype)))


def test_combine_rounds_to_nearest_even() -> None:
    """Sums halfway between two bf16 values round to the even one, as torch's cast; a carry
    into the exponent; near the largest finite value. (Not subnormals: the interpreter's own
    fp32 -> bf16 conversion flushes them.)"""
    half = 2.0**-8  # half a bf16 step at 1
    y = torch.tensor(
        [[1.0 + half], [1.0 + 3 * half], [-(1.0 + half)], [3e38], [2.0 - 2.0**-9], [-0.0]]
    )
    idx = torch.zeros(6, 1, dtype=torch.int64)
    out = combine_triton(y, idx, 1, torch.bfloat16)
    assert torch.equal(_bits(out), _bits(y.to(torch.bfloat16)))


def test_combine_takes_powers_of_two() -> None:
    assert [fits(k) for k in (1, 2, 3, 6, 8, 16)] == [True, True, False, False, True, True]
    with pytest.raises(ValueError):
        combine_triton(torch.zeros(12, 4), torch.zeros(2, 6, dtype=torch.int64), 3, torch.float32)
    out = combine_triton(torch.zeros(0, 4), torch.zeros(0, 8, dtype=torch.int64), 3, torch.float32)
    assert out.shape == (0, 4)
