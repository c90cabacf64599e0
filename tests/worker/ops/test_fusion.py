"""The fusion switch: fused kernels on CUDA tensors only, never in a pass that records
gradients, and never inside ``unfused_kernels`` (which nests and restores the outer choice,
also when its block raises)."""

from __future__ import annotations

import pytest
import torch

from services.worker.ops.fusion import fused, unfused_kernels


def test_cpu_tensors_never_take_fused_kernels() -> None:
    t = torch.zeros(1)
    assert not fused(t)
    with unfused_kernels():
        assert not fused(t)


@pytest.mark.gpu
def test_unfused_block_turns_fusion_off_and_restores_it() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    t = torch.zeros(1, device="cuda")
    assert not fused(t)  # gradients are recorded
    with torch.no_grad():
        assert fused(t)
        with pytest.raises(RuntimeError), unfused_kernels():
            with unfused_kernels():
                assert not fused(t)
            assert not fused(t)
            raise RuntimeError
        assert fused(t)
