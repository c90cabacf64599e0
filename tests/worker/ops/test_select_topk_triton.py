"""The one-kernel top-k selection gives ``select_topk``'s positions exactly (interpreter on the
CPU, @gpu on the device; ``select_topk`` is the torch form on the CPU): ties (equal scores, +0.0 beside -0.0) by the lower position, -inf
scores, fewer visible rows than k, widths below k and not powers of two."""

from __future__ import annotations

import pytest
import torch

from services.worker.ops.fusion import kernel_fusion
from services.worker.ops.indexer import select_topk, select_topk_ref
from services.worker.ops.select_topk_triton import KERNEL_WIDTH, select_topk_triton


def case(seed: int, t: int, s: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(t, s, generator=g)
    scores[0, 1::7] = 2.5  # a run of equal scores
    scores[t - 1, : s // 3 : 2] = 0.0
    scores[t - 1, 1 : s // 3 : 2] = -0.0
    scores[t // 2, s // 2] = float("-inf")
    visible = torch.randint(0, s + 1, (t,), generator=g)
    visible[0] = s
    return scores.to(device), visible.to(device)


@pytest.mark.parametrize(
    ("seed", "t", "s", "k"), [(0, 3, 40, 16), (1, 2, 100, 8), (2, 4, 16, 32), (3, 3, 50, 12)]
)
def test_kernel_equals_torch_selection(seed, t, s, k) -> None:
    scores, visible = case(seed, t, s, "cpu")
    assert torch.equal(select_topk_triton(scores, visible, k), select_topk(scores, visible, k))


def test_rejects_a_row_wider_than_one_program_sorts() -> None:
    scores = torch.zeros(1, KERNEL_WIDTH + 1)
    with pytest.raises(ValueError, match="at most"):
        select_topk_triton(scores, torch.ones(1, dtype=torch.int64), 4)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "s"), [(1, 8192), (16, 2048), (64, 16384), (5, 1500), (16, 40000)])
def test_kernel_equals_torch_selection_on_gpu(t, s) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    scores, visible = case(t + s, t, s, "cuda")
    want = select_topk_ref(scores, visible, 2048)
    assert torch.equal(select_topk_triton(scores, visible, 2048), want)
    with torch.no_grad(), kernel_fusion():  # fused: the kernel the shape takes
        assert torch.equal(select_topk(scores, visible, 2048), want)
