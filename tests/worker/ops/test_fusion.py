"""The fusion switch: fused kernels on CUDA tensors only, inside ``kernel_fusion()`` (off by
default), never in a pass that records gradients, never inside ``unfused_kernels()``, and not
for the ops ``fused_without`` names; blocks nest and restore the outer choice, also when they
raise."""

from __future__ import annotations

import pytest
import torch

from services.worker.ops.fusion import (
    FUSED_OPS,
    NOT_YET_ON_GPU,
    fused,
    fused_without,
    kernel_fusion,
    unfused_kernels,
)


def test_cpu_tensors_never_take_fused_kernels() -> None:
    t = torch.zeros(1)
    with torch.no_grad(), kernel_fusion():
        assert not fused(t, "rms_norm")


@pytest.mark.gpu
def test_fusion_is_on_only_inside_its_block_and_without_gradients() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    t = torch.zeros(1, device="cuda")
    with torch.no_grad():
        assert not fused(t, "rms_norm")  # off by default
        with kernel_fusion():
            assert fused(t, "rms_norm")
            with torch.enable_grad():
                assert not fused(t, "rms_norm")
            with pytest.raises(RuntimeError), unfused_kernels():
                with kernel_fusion():
                    assert fused(t, "rms_norm")
                assert not fused(t, "rms_norm")
                raise RuntimeError
            assert fused(t, "rms_norm")
        assert not fused(t, "rms_norm")
        with kernel_fusion(), fused_without("rms_norm", "moe_route"):
            assert not fused(t, "rms_norm") and not fused(t, "moe_route")
            assert all(fused(t, op) for op in FUSED_OPS if op not in ("rms_norm", "moe_route"))
            with fused_without():
                assert fused(t, "rms_norm")
        with kernel_fusion():
            assert fused(t, "rms_norm")
            assert not any(fused(t, op) for op in NOT_YET_ON_GPU)  # until their GPU tests pass


def test_ops_are_named() -> None:
    t = torch.zeros(1)
    with pytest.raises(AssertionError, match="unknown fused op"):
        fused(t, "no_such_op")
    with pytest.raises(ValueError, match="unknown fused ops"), fused_without("rms", "add_norm"):
        pass


def test_the_worker_flag_reaches_every_pass(monkeypatch) -> None:
    """``--fused-kernels`` (``DHISPARSE_WORKER_FUSED_KERNELS``) sets the engine's config, and its
    passes enter ``kernel_fusion`` with it; on by default, off with ``--no-fused-kernels``."""
    import argparse

    from services.worker.cli import add_arguments, settings_from_args
    from services.worker.engine.engine import Engine
    from services.worker.settings import WorkerSettings

    p = argparse.ArgumentParser()
    add_arguments(p)
    on = settings_from_args(p.parse_args(["--model", "tiny-glm"]))
    assert on.engine_config().fused_kernels is True
    off = settings_from_args(p.parse_args(["--no-fused-kernels", "--model", "tiny-glm"]))
    assert off.engine_config().fused_kernels is False
    monkeypatch.setenv("DHISPARSE_WORKER_FUSED_KERNELS", "false")
    assert WorkerSettings().fused_kernels is False
    for settings, wanted in ((on, True), (off, False)):
        eng = Engine(settings.engine_config())
        assert eng.passes.fused is wanted
        eng.close()
