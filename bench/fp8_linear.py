"""``python -m bench fp8-linear``: the FP8 block-scaled matmul at DeepSeek-V3.2's real weight
shapes, side by side in one run (CUDA).

Variants, for each weight [N, K] and batch M: W8A16 Triton, W8A8 Triton (activation
quantization fused in), bf16 torch matmul on the dequantized weight, and torch's block-scaled
FP8 GEMM (``fp8_scaled_mm``; on x already quantized, so without the quantization) where this
torch runs it. Each is captured in a CUDA graph of ``--inner`` calls (or launched eagerly with
``--no-graph``) and timed with CUDA events; the variants alternate within each repeat, the
first one rotating (``bench/core/lockstep.py``'s reason: host and clock phases fall on all
alike), and the medians over ``--repeats`` are reported. Error is against the fp32 matmul on
the dequantized weight: relative Frobenius, and max |error| / max |y|."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

from bench.core import UsageError
from bench.core.lockstep import alternate
from services.worker.ops.fp8_blockwise import (
    dequantize_blockwise,
    quantize_blockwise,
    scale_to_float,
)
from services.worker.ops.fp8_linear import act_quant_ref, fp8_linear_triton
from services.worker.ops.fp8_scaled_mm import scaled_mm_blockwise, scaled_mm_unsupported

# DeepSeek-V3.2's weights [N, K] (docs: shared/notes/real-models.md §1.5).
SHAPES = {
    "q_b_proj": (24576, 1536),
    "kv_a_proj_with_mqa": (576, 7168),
    "expert_gate_up": (2048, 7168),
    "expert_down": (7168, 2048),
}
VARIANTS = ("w8a16_triton", "w8a8_triton", "bf16_torch", "scaled_mm")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--m", default="1,16,64,256", help="batch sizes (rows of x)")
    ap.add_argument("--repeats", type=int, default=30, help="timed repeats per variant")
    ap.add_argument("--inner", type=int, default=20, help="calls per timed graph replay")
    ap.add_argument("--no-graph", action="store_true", help="launch eagerly, no CUDA graph")
    ap.add_argument("--scale-dtype", default="F8_E8M0", choices=("F32", "F8_E8M0"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/fp8_linear.json")


def parse(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The shape names and batch sizes asked for; raises ValueError on unknown ones."""
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    ms = [int(v) for v in args.m.split(",") if v]
    if not ms or min(ms) < 1:
        raise ValueError(f"--m must be positive integers, got {args.m!r}")
    return names, ms


def _timer(fn: Callable[[], object], inner: int, graph: bool) -> Callable[[], float]:
    """A function returning the device ms of one call of ``fn`` (``inner`` calls per event
    pair, in one CUDA graph replay unless ``graph`` is False)."""
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()  # warm-up: compile, autotune caches, cuBLAS workspaces
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
        launch = g.replay
    else:
        fn()

        def launch() -> None:
            for _ in range(inner):
                fn()

    def once() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / inner

    return once


def _error(y: torch.Tensor, y32: torch.Tensor) -> dict[str, float]:
    d = y.float() - y32
    return {
        "rel_fro": (d.norm() / y32.norm()).item(),
        "max_over_max": (d.abs().max() / y32.abs().max()).item(),
    }


def run_case(name: str, m: int, args: argparse.Namespace, g: torch.Generator) -> dict:
    n, k = SHAPES[name]
    w = torch.randn(n, k, generator=g) * 0.02
    w_fp8, raw = quantize_blockwise(w, (128, 128), args.scale_dtype)
    dev = torch.device("cuda")
    w_fp8, scale = w_fp8.to(dev), scale_to_float(raw).to(dev)
    w_deq = dequantize_blockwise(w_fp8, scale, (128, 128))  # fp32
    w_bf16 = w_deq.to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
    x_fp8, x_scale = act_quant_ref(x)
    y32 = x.float() @ w_deq.T

    fns: dict[str, Callable[[], torch.Tensor]] = {
        "w8a16_triton": lambda: fp8_linear_triton(x, w_fp8, scale, None, "w8a16"),
        "w8a8_triton": lambda: fp8_linear_triton(x, w_fp8, scale, None, "w8a8"),
        "bf16_torch": lambda: x @ w_bf16.T,
    }
    why_not = scaled_mm_unsupported(m, n, k)
    if why_not is None:
        fns["scaled_mm"] = lambda: scaled_mm_blockwise(x_fp8, x_scale, w_fp8, scale, x.dtype)
    errors = {v: _error(fn(), y32) for v, fn in fns.items()}
    timers = {v: _timer(fn, args.inner, not args.no_graph) for v, fn in fns.items()}
    times = alternate(timers, args.repeats)
    fp8_bytes = n * k + scale.numel() * 4
    rows = {}
    for v in fns:
        ms = statistics.median(times[v])
        wbytes = 2 * n * k if v == "bf16_torch" else fp8_bytes
        rows[v] = {
            "median_us": 1e3 * ms,
            "min_us": 1e3 * min(times[v]),
            "weight_gb_per_s": wbytes / (ms * 1e-3) / 1e9,
            "tflops": 2 * m * n * k / (ms * 1e-3) / 1e12,
            **errors[v],
        }
    return {"shape": name, "n": n, "k": k, "m": m, "variants": rows, "scaled_mm_skipped": why_not}


def _table(cases: list[dict]) -> str:
    head = f"{'shape':<20}{'M':>5}" + "".join(f"{v:>26}" for v in VARIANTS)
    lines = [head, " " * 25 + "".join(f"{'us (rel err)':>26}" for _ in VARIANTS)]
    for c in cases:
        cells = []
        for v in VARIANTS:
            r = c["variants"].get(v)
            cells.append(f"{r['median_us']:>12.1f} ({r['rel_fro']:.1e})" if r else f"{'-':>26}")
        lines.append(f"{c['shape']:<20}{c['m']:>5}" + "".join(f"{s:>26}" for s in cells))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int | dict:
    try:
        names, ms = parse(args)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    g = torch.Generator().manual_seed(args.seed)
    cases = [run_case(name, m, args, g) for name in names for m in ms]
    print(_table(cases))
    return {
        "bench": "fp8-linear",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "scale_dtype": args.scale_dtype,
        "graph": not args.no_graph,
        "inner": args.inner,
        "repeats": args.repeats,
        "error_reference": "fp32 matmul of bf16 x on the dequantized weight",
        "scaled_mm_input": "x already quantized by act_quant_ref (quantization not timed)",
        "cases": cases,
    }
