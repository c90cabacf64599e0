"""The Triton kernels a process builds (``engine.kernel_builds``): counted and timed by kernel
from Triton's JIT hooks (a build once the worker serves warned, with its specialization), hooks
that were there before kept and called, given back on close; the worker's metrics export the
totals from zero. On the GPU a real first launch of a kernel
specialization is one build, and a second launch of it none."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JitFunctionInfo

from dhisparse import metrics as m
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.kernel_builds import KernelBuilds, kernel_name
from services.worker.metrics import WorkerMetrics
from services.worker.request.request import SamplingParams


def _build(name: str, module: str = "services.worker.ops.some_kernel") -> None:
    """What Triton calls around one build (its hooks' keywords, as ``JITFunction`` passes)."""
    rt = triton.knobs.runtime
    info = JitFunctionInfo(module, name, None)
    assert not rt.jit_cache_hook(key="k", repr=name, fn=info, compile={}, is_manual_warmup=False,
                                 already_compiled=False)  # fmt: skip
    rt.jit_post_compile_hook(key="k", repr=name, fn=info, compile={}, is_manual_warmup=False,
                             already_compiled=False)  # fmt: skip


@pytest.fixture
def fresh():
    """A recorder of its own (the process's one stays as it is), its hooks given back after."""
    rt = triton.knobs.runtime
    before = (rt.jit_cache_hook, rt.jit_post_compile_hook)
    rec = KernelBuilds()
    yield rec
    rec.close()
    assert (rt.jit_cache_hook, rt.jit_post_compile_hook) == before


def test_builds_are_counted_by_kernel(fresh: KernelBuilds) -> None:
    _build("_gather")
    _build("_gather")
    _build("_scatter", module="services.worker.ops.other")
    count, seconds = fresh.snapshot()
    assert count == {"some_kernel._gather": 2, "other._scatter": 1}
    assert all(s >= 0.0 for s in seconds.values())
    assert fresh.totals()[0] == 3 == fresh.total


def test_builds_while_serving_are_warned_with_their_specialization(
    fresh: KernelBuilds, caplog
) -> None:
    caplog.set_level("INFO", logger="services.worker.engine.kernel_builds")
    _build("_start_up")
    fresh.serving()
    _build("_gather[num_warps=4](x: *fp32, n: i32)")
    # this recorder's records (a process recorder it chains to may log the builds too)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "while serving" in warned[0] and "_gather" in warned[0]
    assert "(x: *fp32, n: i32)" in warned[0]  # the specialization built
    assert any("_start_up" in r.getMessage() for r in caplog.records if r.levelname == "INFO")
    assert fresh.total == 2


def test_hooks_found_are_kept_and_called() -> None:
    rt = triton.knobs.runtime
    held = (rt.jit_cache_hook, rt.jit_post_compile_hook)
    calls: list[str] = []
    rt.jit_cache_hook = lambda **kw: calls.append("before") or False
    rt.jit_post_compile_hook = lambda **kw: calls.append("after")
    try:
        rec = KernelBuilds()
        _build("_k")
        assert calls == ["before", "after"] and rec.total == 1
        rec.close()
        _build("_k")  # the earlier hooks alone again
        assert calls == ["before", "after", "before", "after"] and rec.total == 1
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = held


def test_kernel_names() -> None:
    assert kernel_name(JitFunctionInfo("a.b.c", "_f", None)) == "c._f"
    assert kernel_name(JitFunctionInfo("", "_f", None)) == "_f"


def test_worker_metrics_export_builds_from_zero() -> None:
    engine = Engine(EngineConfig(model="tiny-glm", kv_pool_mib=16, max_num_seqs=1))
    metrics = WorkerMetrics("t")

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(f"{name}_total", {"model": "t"})

    assert value(m.KERNEL_BUILDS) == 0 and value(m.KERNEL_BUILD_SECONDS) == 0
    builds = KernelBuilds.process()  # the process's recorder, which the metrics read
    _build("_exported")
    engine.add_request("r", list(range(8)), SamplingParams(max_tokens=1, ignore_eos=True))
    metrics.on_step(engine, engine.step())
    # every build of the process so far (the worker's from its start), this one included
    assert value(m.KERNEL_BUILDS) == builds.total >= 1
    assert value(m.KERNEL_BUILD_SECONDS) >= 0.0
    engine.close()


@triton.jit
def _scale(x_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=keep) * FACTOR, mask=keep)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_first_launch_on_the_gpu_is_one_build(fresh: KernelBuilds) -> None:
    x = torch.ones(1000, device="cuda")
    _scale[(8,)](x, 1000, FACTOR=3, BLOCK=128)
    count, seconds = fresh.snapshot()
    assert count == {"test_kernel_builds._scale": 1} and seconds["test_kernel_builds._scale"] > 0
    _scale[(8,)](x, 1000, FACTOR=3, BLOCK=128)  # built: launched as it is
    assert fresh.total == 1
    _scale[(8,)](x, 1000, FACTOR=5, BLOCK=128)  # another specialization
    assert fresh.total == 2
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 45.0))
