"""Triton kernels built while the process runs: how many and how long, by kernel.

A ``@triton.jit`` kernel is built the first time the process launches it with a new
specialization (its constexprs, its integer arguments' divisibility, its dtypes); building takes
tens to hundreds of milliseconds (a binary the on-disk cache holds only loads), and the launch
that asks for it waits. A kernel built while serving therefore stalls the step that met a new
shape first: ``dhisparse:kernel_builds`` tells how often that happens.

Triton calls ``knobs.runtime.jit_cache_hook`` before it builds a kernel the process has not
built (the hook may not return true: that would skip the build) and
``jit_post_compile_hook`` once it is built; a recorder keeps the hooks it found and calls
them too. Each build is logged with its kernel: at INFO during start-up, and once the worker
serves (``serving``) at WARNING with the specialization built (a request waited for it: a
shape the start-up warm-up did not meet). The worker's metrics export the totals. Under the
Triton interpreter (the CPU) nothing is built."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

import triton

log = logging.getLogger(__name__)
REPR_CHARS = 600  # of a build's specialization (Triton's repr: the kernel's argument types)
WHILE_SERVING = "while serving"  # in the warning of a build once the worker serves


def kernel_name(info: Any) -> str:
    """``module.function`` of a hook's ``fn`` (Triton's ``JitFunctionInfo``: the kernel's
    module name and qualified name), the module's last part only."""
    module = str(getattr(info, "module", "") or "")
    name = str(getattr(info, "name", "?"))
    return f"{module.rsplit('.', 1)[-1]}.{name}" if module else name


class KernelBuilds:
    """Builds and their seconds by kernel (``module.function``), recorded from Triton's JIT
    hooks while open. Builds happen on the thread that launches the kernel; each thread's
    build in progress is timed on its own."""

    _process: KernelBuilds | None = None

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._started = threading.local()
        self._serving = False
        rt = triton.knobs.runtime
        self._chained = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        rt.jit_cache_hook, rt.jit_post_compile_hook = self._before, self._after

    def _before(self, *args: Any, **kw: Any) -> bool:
        self._started.at = time.perf_counter()
        hook = self._chained[0]
        return bool(hook(*args, **kw)) if hook is not None else False

    def _after(self, *args: Any, **kw: Any) -> None:
        at = getattr(self._started, "at", None)
        dt = 0.0 if at is None else time.perf_counter() - at
        self._started.at = None
        name = kernel_name(kw.get("fn"))
        with self._lock:
            self.count[name] += 1
            self.seconds[name] += dt
        if self._serving:
            log.warning(
                "built Triton kernel %s in %.3f s %s (a request waited): %s",
                name, dt, WHILE_SERVING, str(kw.get("repr", ""))[:REPR_CHARS],
            )  # fmt: skip
        else:
            log.info("built Triton kernel %s in %.3f s", name, dt)
        hook = self._chained[1]
        if hook is not None:
            hook(*args, **kw)

    def serving(self) -> None:
        """From now on each build is logged as a warning, with its specialization."""
        self._serving = True

    def snapshot(self) -> tuple[dict[str, int], dict[str, float]]:
        """(builds, seconds) by kernel so far."""
        with self._lock:
            return dict(self.count), dict(self.seconds)

    def totals(self) -> tuple[int, float]:
        """(builds, seconds) over every kernel so far."""
        with self._lock:
            return sum(self.count.values()), sum(self.seconds.values())

    @property
    def total(self) -> int:
        return self.totals()[0]

    @classmethod
    def process(cls) -> KernelBuilds:
        """The one recorder that stays open for the life of the process (the worker's
        metrics read it)."""
        if cls._process is None:
            cls._process = cls()
        return cls._process

    def close(self) -> None:
        """Gives Triton back the hooks this recorder found."""
        rt = triton.knobs.runtime
        if rt.jit_cache_hook == self._before:
            rt.jit_cache_hook, rt.jit_post_compile_hook = self._chained
