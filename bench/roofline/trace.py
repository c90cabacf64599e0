"""The kernels of a torch.profiler trace, in device order, each with the host time of its
launch, so that the record_function ranges open at that moment name what launched it.

On CUDA a kernel is a device event (kernels, copies and memsets: CUPTI reports each kernel of a
replayed graph on its own), placed by the CUDA runtime call that launched it — the event of the
same correlation id (``cudaLaunchKernel``, ``cuLaunchKernel``, ``cudaGraphLaunch``, ...). On
the CPU, where there is no device, a "kernel" is an outermost aten operator (one dispatch), its
time its own wall time."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch.autograd import DeviceType

PREFIX = "rl:"  # the names of the ranges the roofline pushes
STEP = PREFIX + "step"  # one engine step
GRAPH_LAUNCH = "cudaGraphLaunch"


@dataclass(frozen=True)
class Kernel:
    name: str
    us: float  # device time (CPU: the operator's wall time)
    start_us: float  # device start: the order
    launch_us: float | None  # host time of its launch; None when no launch call was found


@dataclass(frozen=True)
class Range:
    name: str  # without PREFIX
    start_us: float
    end_us: float


def _is_runtime(name: str) -> bool:
    return name.startswith("cu")  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...


def kernels(events: Iterable, cuda: bool) -> list[Kernel]:
    """The trace's kernels in device order (see the module's docstring)."""
    events = list(events)
    if not cuda:
        out = [
            Kernel(e.name, e.time_range.elapsed_us(), e.time_range.start, e.time_range.start)
            for e in events
            if e.device_type == DeviceType.CPU
            and e.name.startswith("aten::")
            and not _under_aten(e)
        ]
        return sorted(out, key=lambda k: k.start_us)
    launches = {
        e.id: e.time_range.start
        for e in events
        if e.device_type == DeviceType.CPU and _is_runtime(e.name)
    }
    out = [
        Kernel(e.name, e.time_range.elapsed_us(), e.time_range.start, launches.get(e.id))
        for e in events
        if e.device_type == DeviceType.CUDA and not e.name.startswith(PREFIX)
    ]
    return sorted(out, key=lambda k: k.start_us)


def _under_aten(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


def ranges(events: Iterable) -> list[Range]:
    """The roofline's record_function ranges (host side), by start."""
    out = [
        Range(e.name[len(PREFIX) :], e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith(PREFIX)
    ]
    return sorted(out, key=lambda r: r.start_us)


def innermost(at: float | None, spans: Sequence[Range]) -> str | None:
    """The name of the latest-starting range open at host time ``at`` (ranges nest)."""
    if at is None:
        return None
    found = None
    for r in spans:
        if r.start_us > at:
            break
        if r.end_us >= at:
            found = r.name
    return found


def by_step(ks: Sequence[Kernel], steps: Sequence[Range]) -> tuple[list[list[Kernel]], int]:
    """The kernels launched within each step range, in device order, and how many kernels
    were launched in none (or whose launch was not found)."""
    out: list[list[Kernel]] = [[] for _ in steps]
    lost = 0
    for k in ks:
        j = next(
            (
                j
                for j, s in enumerate(steps)
                if k.launch_us is not None and s.start_us <= k.launch_us <= s.end_us
            ),
            None,
        )
        if j is None:
            lost += 1
        else:
            out[j].append(k)
    return out, lost


def graph_launch_us(events: Iterable) -> tuple[float, int]:
    """(host microseconds in ``cudaGraphLaunch`` calls, how many calls) over the trace."""
    calls = [
        e.time_range.elapsed_us()
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith(GRAPH_LAUNCH)
    ]
    return sum(calls), len(calls)
