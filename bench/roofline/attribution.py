"""Every kernel of a step, with the region it belongs to: profile a few steps as served
(replayed graphs on a GPU), profile one eager step with region labels, and give each replayed
kernel the region of the eager kernel it aligns with (``align``). Without graphs (the CPU) the
labelled eager step is the step itself: no alignment, every kernel has its label.

The eager step is the same engine's next step with its graphs detached for that step: the same
requests, KV state and kernels' shapes (one token later), with no second engine to build, fill
and keep in memory beside the first."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile

from bench.roofline.align import align
from bench.roofline.cost import PassShape
from bench.roofline.regions import Instruments, step_span
from bench.roofline.trace import Kernel, Range, by_step, graph_launch_us, innermost, kernels, ranges
from bench.roofline.variants import Served, Variant

UNATTRIBUTED = "unattributed"  # a replayed kernel with no eager counterpart
OUTSIDE = "outside"  # an eager kernel launched outside every labelled range
NO_LAUNCH = "launch not found"  # a kernel whose launch call the trace lacks
# regions that run once per pass or step, not in each decoder layer
NOT_PER_LAYER = frozenset(
    {"embed", "norm", "lm_head", "step", "kv.begin", "kv.commit", OUTSIDE, NO_LAUNCH, UNATTRIBUTED}
)


@dataclass(frozen=True)
class StepKernels:
    """The kernels of ``steps`` profiled steps, each with its region."""

    steps: int
    kernels: list[tuple[Kernel, str]]
    graph_launch_us: float | None  # host time in cudaGraphLaunch, all steps (None: no graphs)
    graph_launches: int
    lost: int  # kernels in no step's range (their launch not found): counted, not placed
    shape: PassShape  # the labelled eager pass's batch, for the byte model
    source: str  # how regions were given: "aligned" or "labelled"
    eager_kernels: int  # in the labelled eager step

    def by_region(self) -> dict[str, tuple[float, float]]:
        """region -> (kernels per step, device µs per step)."""
        count: Counter[str] = Counter()
        us: Counter[str] = Counter()
        for k, r in self.kernels:
            count[r] += 1
            us[r] += k.us
        return {r: (count[r] / self.steps, us[r] / self.steps) for r in count}

    def by_name(self) -> list[dict]:
        """Each kernel name: count and µs per step, and the regions it ran in (by count)."""
        rows: dict[str, dict] = {}
        for k, r in self.kernels:
            row = rows.setdefault(k.name, {"name": k.name, "count": 0, "us": 0.0, "regions": {}})
            row["count"] += 1
            row["us"] += k.us
            row["regions"][r] = row["regions"].get(r, 0) + 1
        for row in rows.values():
            row["count"] /= self.steps
            row["us"] /= self.steps
            row["regions"] = {r: n / self.steps for r, n in row["regions"].items()}
        return sorted(rows.values(), key=lambda row: -row["us"])


def _activities(cuda: bool) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]


def labelled_step(served: Served, v: Variant) -> tuple[list[tuple[Kernel, str]], PassShape]:
    """One eager step of ``v`` under the profiler with region labels: its kernels with their
    regions, and its forward pass's shape."""
    eng = served.eng
    inst = Instruments(eng.model, eng.kv)
    acts = _activities(served.cuda)
    with served.as_variant(v, eager=True), inst.installed(), profile(activities=acts) as prof:
        with step_span():
            eng.step()
        served.sync()
    events = prof.events()
    spans = ranges(events)
    labelled = [(k, region(k, spans)) for k in kernels(events, served.cuda)]
    if len(inst.passes) != 1:
        raise RuntimeError(f"a decode step ran {len(inst.passes)} forward passes, not one")
    return labelled, inst.passes[0].shape()


def region(k: Kernel, spans: list[Range]) -> str:
    """The region an eager kernel was launched in."""
    if k.launch_us is None:
        return NO_LAUNCH
    return innermost(k.launch_us, spans) or OUTSIDE


def profile_steps(served: Served, v: Variant, steps: int) -> StepKernels:
    """``steps`` steps of ``v`` as served, their kernels given regions (the module's docstring)."""
    eager, shape = labelled_step(served, v)
    if not served.graphs:
        return StepKernels(1, eager, None, 0, 0, shape, "labelled", len(eager))
    with profile(activities=_activities(served.cuda)) as prof:
        for _ in range(steps):
            with step_span():
                served.step(v)
        served.sync()
    events = prof.events()
    step_ranges = [r for r in ranges(events) if r.name == "step"]
    per_step, lost = by_step(kernels(events, served.cuda), step_ranges)
    names = [k.name for k, _ in eager]
    out: list[tuple[Kernel, str]] = []
    for ks in per_step:
        match = align(names, [k.name for k in ks])
        out += [
            (k, UNATTRIBUTED if j is None else eager[j][1]) for k, j in zip(ks, match, strict=True)
        ]
    launch, calls = graph_launch_us(events)
    return StepKernels(steps, out, launch, calls, lost, shape, "aligned", len(eager))
