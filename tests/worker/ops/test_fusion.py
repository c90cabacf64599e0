"""The fusion switch: fused kernels on CUDA tensors only, inside ``kernel_fusion()`` (off by
default), never in a pass that records gradients, and never inside ``unfused_kernels()``;
blocks nest and restore the outer choice, also when they raise."""

from __future__ import annotations

import pytest
import torch

from services.worker.ops.fusion import fused, kernel_fusion, unfused_kernels


def test_cpu_tensors_never_take_fused_kernels() -> None:
    t = torch.zeros(1)
    with torch.no_grad(), kernel_fusion():
        assert not fused(t)


@pytest.mark.gpu
def test_fusion_is_on_only_inside_its_block_and_without_gradients() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    t = torch.zeros(1, device="cuda")
    with torch.no_grad():
        assert not fused(t)  # off by default
        with kernel_fusion():
            assert fused(t)
            with torch.enable_grad():
                assert not fused(t)
            with pytest.raises(RuntimeError), unfused_kernels():
                with kernel_fusion():
                    assert fused(t)
                assert not fused(t)
                raise RuntimeError
            assert fused(t)
        assert not fused(t)


def test_the_worker_flag_reaches_every_pass(monkeypatch) -> None:
    """``--fused-kernels`` (``DHISPARSE_WORKER_FUSED_KERNELS``) sets the engine's config, and its
    passes enter ``kernel_fusion`` with it; off by default."""
    import argparse

    from services.worker.cli import add_arguments, settings_from_args
    from services.worker.engine.engine import Engine
    from services.worker.settings import WorkerSettings

    p = argparse.ArgumentParser()
    add_arguments(p)
    off = settings_from_args(p.parse_args(["--model", "tiny-glm"]))
    assert off.engine_config().fused_kernels is False
    on = settings_from_args(p.parse_args(["--fused-kernels", "--model", "tiny-glm"]))
    assert on.engine_config().fused_kernels is True
    monkeypatch.setenv("DHISPARSE_WORKER_FUSED_KERNELS", "true")
    assert WorkerSettings().fused_kernels is True
    for settings, wanted in ((on, True), (off, False)):
        eng = Engine(settings.engine_config())
        assert eng.passes.fused is wanted
        eng.close()
