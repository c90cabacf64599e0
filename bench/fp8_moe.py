"""``python -m bench fp8-moe``: the routed experts of DeepSeek-V3.2 over FP8 weights (D = 7168,
I = 2048, top_k = 8 by default), side by side in one run (CUDA).

Variants, for each expert count E and batch of T tokens: W8A16 Triton and W8A8 Triton
(``fp8_moe_triton``: block alignment, gate_up GEMM with SwiGLU fused, down GEMM with the
routing weight, sum over choices), and bf16 torch grouped_mm (``moe.Experts`` on the
dequantized weights in bf16). Routing is uniform at random (distinct experts per token, as the
router chooses them), fixed per case. Each variant is captured in a CUDA graph of ``--inner``
calls (or launched eagerly with ``--no-graph``) and timed with CUDA events; the variants
alternate within each repeat, the first one rotating (``bench/core/cuda_timer.py``), and the
medians over ``--repeats`` are reported. Bandwidth is the bytes of the experts the routing
touches (e4m3 values and fp32 scales, or bf16) over the median time. Error is against the fp32
computation on the dequantized weights (``fp8_moe_ref`` of fp32 x): relative Frobenius, and
max |error| / max |y|."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
from torch import nn

from bench.core import UsageError
from bench.core.cuda_timer import graph_timer
from bench.core.lockstep import alternate
from bench.fp8_linear import _error
from dhisparse.family.hf_config import MoESpec
from services.worker.model.fp8_experts import FP8Experts
from services.worker.model.mla_moe import Experts
from services.worker.ops.fp8_blockwise import dequantize_blockwise, quantize_blockwise
from services.worker.ops.fp8_moe import (
    dequantize_gate_up,
    fp8_moe_ref,
    fp8_moe_triton,
    tiles,
)

VARIANTS = ("w8a16_triton", "w8a8_triton", "bf16_torch")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--experts", default="64,256", help="routed expert counts E")
    ap.add_argument("--tokens", default="1,16,64,256", help="batch sizes T")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048, help="I, per expert")
    ap.add_argument("--repeats", type=int, default=30, help="timed repeats per variant")
    ap.add_argument("--inner", type=int, default=20, help="calls per timed graph replay")
    ap.add_argument("--no-graph", action="store_true", help="launch eagerly, no CUDA graph")
    ap.add_argument("--scale-dtype", default="F8_E8M0", choices=("F32", "F8_E8M0"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/fp8_moe.json")


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError as e:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise ValueError(f"{name} must be positive integers, got {text!r}")
    return values


def parse(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The (E, T) cases asked for, E-major; raises ValueError on bad ones."""
    experts, tokens = _ints(args.experts, "--experts"), _ints(args.tokens, "--tokens")
    if args.top_k < 1 or args.top_k > min(experts):
        raise ValueError(f"--top-k must be in [1, min(--experts)], got {args.top_k}")
    if args.d_model < 1 or args.intermediate < 1:
        raise ValueError("--d-model and --intermediate must be positive")
    return [(e, t) for e in experts for t in tokens]


def _layers(e: int, args: argparse.Namespace, g: torch.Generator) -> tuple[FP8Experts, Experts]:
    """E experts quantized as the checkpoint writer does, and moe.Experts holding them
    dequantized in bf16, both on the GPU (made one expert at a time)."""
    d, i = args.d_model, args.intermediate

    def pair(rows: int, cols: int):
        w = torch.randn(rows, cols, generator=g, device="cuda") * cols**-0.5
        return quantize_blockwise(w, (128, 128), args.scale_dtype)

    fp8 = FP8Experts.from_checkpoint(
        [pair(i, d) for _ in range(e)], [pair(i, d) for _ in range(e)],
        [pair(d, i) for _ in range(e)], "w8a16",
    )  # fmt: skip
    spec = MoESpec(e, 1, args.top_k, 1, 1, True, 1.0, i)
    with torch.device("meta"):
        bf16 = Experts(spec.n_routed, d, spec.intermediate)
    gate_up = torch.empty(e, 2 * i, d, dtype=torch.bfloat16, device="cuda")
    down = torch.empty(e, d, i, dtype=torch.bfloat16, device="cuda")
    for j in range(e):
        gate_up[j] = dequantize_gate_up(fp8.gate_up_proj[j], fp8.gate_up_proj_scale_inv[j])
        down[j] = dequantize_blockwise(fp8.down_proj[j], fp8.down_proj_scale_inv[j], (128, 128))
    bf16.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
    bf16.down_proj = nn.Parameter(down, requires_grad=False)
    return fp8, bf16


def run_case(t: int, fp8: FP8Experts, bf16: Experts, args: argparse.Namespace, g) -> dict:
    e, d, i, k = fp8.n, args.d_model, args.intermediate, args.top_k
    x = torch.randn(t, d, generator=g, device="cuda").bfloat16()
    idx = torch.rand(t, e, generator=g, device="cuda").topk(k, dim=1).indices
    w = torch.rand(t, k, generator=g, device="cuda") + 0.1
    w = w / w.sum(dim=1, keepdim=True)
    weights = (fp8.gate_up_proj, fp8.gate_up_proj_scale_inv, fp8.down_proj, fp8.down_proj_scale_inv)
    y32 = fp8_moe_ref(x.float(), idx, w, *weights, "w8a16")

    fns: dict[str, Callable[[], torch.Tensor]] = {
        "w8a16_triton": lambda: fp8_moe_triton(x, idx, w, *weights, "w8a16"),
        "w8a8_triton": lambda: fp8_moe_triton(x, idx, w, *weights, "w8a8"),
        "bf16_torch": lambda: bf16(x, idx, w),
    }
    touched = int(idx.unique().numel())  # the experts whose weights are read
    scales = (fp8.gate_up_proj_scale_inv[0].numel() + fp8.down_proj_scale_inv[0].numel()) * 4
    per_expert = {"fp8": 3 * i * d + scales, "bf16": 2 * 3 * i * d}
    rows = timed_variants(
        fns, y32, args, lambda v: touched * per_expert["bf16" if v == "bf16_torch" else "fp8"]
    )
    return {
        "experts": e, "tokens": t, "pairs": t * k, "experts_touched": touched,
        "tile": tiles(t * k, e, False)._asdict(), "variants": rows,
    }  # fmt: skip


def timed_variants(
    fns: dict[str, Callable[[], torch.Tensor]], y32: torch.Tensor, args: argparse.Namespace,
    weight_bytes: Callable[[str], int],
) -> dict[str, dict]:  # fmt: skip
    """Each variant's error against ``y32`` and its time, the variants alternating in lockstep
    (``--inner`` calls per graph replay, ``--repeats`` rounds): median and least µs, and GB/s
    over ``weight_bytes(variant)``."""
    with torch.no_grad():
        errors = {v: _error(fn(), y32) for v, fn in fns.items()}
        timers = {v: graph_timer(fn, args.inner, not args.no_graph) for v, fn in fns.items()}
        times = alternate(timers, args.repeats)
    rows = {}
    for v in fns:
        ms = statistics.median(times[v])
        rows[v] = {
            "median_us": 1e3 * ms,
            "min_us": 1e3 * min(times[v]),
            "weight_gb_per_s": weight_bytes(v) / (ms * 1e-3) / 1e9,
            **errors[v],
        }
    return rows


def table(cases: list[dict], variants: tuple[str, ...]) -> str:
    """One line per case: µs, GB/s and relative error of each variant."""
    head = f"{'E':>5}{'T':>6}{'touched':>9}" + "".join(f"{v:>30}" for v in variants)
    lines = [head, " " * 20 + "".join(f"{'us  GB/s (rel err)':>30}" for _ in variants)]
    for c in cases:
        cells = [
            f"{r['median_us']:>9.1f} {r['weight_gb_per_s']:>6.0f} ({r['rel_fro']:.1e})"
            for r in (c["variants"][v] for v in variants)
        ]
        lines.append(
            f"{c['experts']:>5}{c['tokens']:>6}{c['experts_touched']:>9}"
            + "".join(f"{s:>30}" for s in cells)
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int | dict:
    try:
        cases = parse(args)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if not torch.cuda.is_available():
        print("fp8-moe needs a CUDA device (none is available)", file=sys.stderr)
        return 2
    import triton

    g = torch.Generator(device="cuda").manual_seed(args.seed)
    results = []
    for e in dict.fromkeys(e for e, _ in cases):
        fp8, bf16 = _layers(e, args, g)
        results += [run_case(t, fp8, bf16, args, g) for e2, t in cases if e2 == e]
        del fp8, bf16
        torch.cuda.empty_cache()
    print(table(results, VARIANTS))
    return {
        "bench": "fp8-moe",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "d_model": args.d_model,
        "intermediate": args.intermediate,
        "top_k": args.top_k,
        "scale_dtype": args.scale_dtype,
        "graph": not args.no_graph,
        "inner": args.inner,
        "repeats": args.repeats,
        "routing": "uniform at random, distinct experts per token, weights normalised",
        "error_reference": "fp8_moe_ref of fp32 x: fp32 matmuls on the dequantized weights",
        "bandwidth_bytes": "experts touched x (3 I D e4m3 + fp32 scales), or x 6 I D for bf16",
        "cases": results,
    }
