"""``python -m bench fp8-linear``: the FP8 block-scaled matmul at DeepSeek-V3.2's and GLM-5.2's
projection shapes, its tile configurations swept side by side in one run (CUDA).

Variants, for each weight [N, K] and batch M: bf16 cuBLAS (``x @ W^T`` on the dequantized
weight), ``default`` (the kernel as it is: ``fp8_linear_tiles.DEFAULT_TILES`` with the splits
summed by torch, ``out.sum(dim=0)`` and a cast), and each ``--candidates`` tile configuration
with the splits summed inside the kernel; ``--scaled-mm`` adds torch's block-scaled FP8 GEMM
(``fp8_scaled_mm``, on x already quantized) where this torch runs it. Each is captured in a
CUDA graph of at least ``--inner`` calls (``--no-graph``: launched eagerly) and timed with CUDA
events; the variants alternate within each repeat, the first one rotating
(``bench/core/lockstep.py``'s reason), and medians over ``--repeats`` are reported.

The weights are cold, as in a decode step: the calls of a graph cycle through copies of the
weight that together exceed ``--working-set`` (well past the L2 cache). Bandwidth is the bytes
a call must read (weight, scales, activations) over its time, and its fraction of the device's
copy rate, measured in the run (a large device-to-device copy: bytes read + written / time).
Error is against the fp32 matmul on the dequantized weight (relative Frobenius); a candidate
whose output is off the default's by more than 1e-3 (only the order of fp32 sums may differ)
is marked and never the best."""

from __future__ import annotations

import argparse
import itertools
import math
import re
import statistics
import sys
from collections.abc import Callable

import torch
import triton
from triton.runtime.errors import OutOfResources

from bench.core import UsageError
from bench.core.cuda_timer import graph_timer
from bench.core.lockstep import alternate
from bench.roofline.limits import copy_rate
from services.worker.ops.fp8_blockwise import dequantize_blockwise, quantize_blockwise
from services.worker.ops.fp8_linear import act_quant_ref, fp8_linear_triton, plan_launch
from services.worker.ops.fp8_linear_tiles import Tiles, tiles_for
from services.worker.ops.fp8_scaled_mm import scaled_mm_blockwise, scaled_mm_unsupported

# Weights [N, K]. Unprefixed: DeepSeek-V3.2's first four (expert_* are also its shared
# expert's gate/up and down); prefixed: the rest of both families' projections.
SHAPES = {
    "q_b_proj": (24576, 1536),
    "kv_a_proj_with_mqa": (576, 7168),
    "expert_gate_up": (2048, 7168),
    "expert_down": (7168, 2048),
    "v32.q_a_proj": (1536, 7168),
    "v32.o_proj": (7168, 16384),
    "v32.indexer.wq_b": (8192, 1536),
    "v32.indexer.wk": (128, 7168),
    "v32.dense_gate_up": (18432, 7168),
    "v32.dense_down": (7168, 18432),
    "glm5.q_a_proj": (2048, 6144),
    "glm5.q_b_proj": (16384, 2048),
    "glm5.kv_a_proj_with_mqa": (576, 6144),
    "glm5.o_proj": (6144, 16384),
    "glm5.indexer.wq_b": (4096, 2048),
    "glm5.indexer.wk": (128, 6144),
    "glm5.shared_gate_up": (2048, 6144),
    "glm5.shared_down": (6144, 2048),
    "glm5.dense_gate_up": (12288, 6144),
    "glm5.dense_down": (6144, 12288),
}
# Tile candidates as ``Tiles.label()`` gives them (BLOCK_M comes from the batch's bucket of the
# default table): the default first, wider tiles, two scale blocks per iteration, more splits.
CANDIDATES = (
    "n64w4s4p264k1", "n128w4s4p264k1", "n64w4s3p528k2",
    "n128w8s3p528k2", "n32w4s6p528k1", "n64w4s6p528k1",
)  # fmt: skip
_LABEL = re.compile(r"n(\d+)w(\d+)s(\d+)p(\d+)k(\d+)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--m", default="1,16,64,256", help="batch sizes (rows of x)")
    ap.add_argument("--candidates", default=",".join(CANDIDATES),
                    help="tile configs n<BLOCK_N>w<warps>s<stages>p<split programs>k<K step>")  # fmt: skip
    ap.add_argument("--mode", default="w8a16", choices=("w8a16", "w8a8"))
    ap.add_argument("--scaled-mm", action="store_true", help="add torch's block-scaled GEMM")
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats per variant")
    ap.add_argument("--inner", type=int, default=20, help="least calls per timed graph replay")
    ap.add_argument("--working-set", type=int, default=256, help="MiB of weight copies cycled")
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


def candidate(label: str, m: int) -> Tiles:
    """The candidate ``label`` at batch ``m``: BLOCK_M from the default table's bucket."""
    match = _LABEL.fullmatch(label)
    if match is None:
        raise ValueError(f"candidate {label!r} is not n<N>w<warps>s<stages>p<programs>k<step>")
    n, w, s, p, k = (int(v) for v in match.groups())
    return Tiles(tiles_for(m, interpret=False).block_m, n, w, s, p, k)


def _error(y: torch.Tensor, y32: torch.Tensor) -> dict[str, float]:
    d = y.float() - y32
    return {
        "rel_fro": (d.norm() / y32.norm()).item(),
        "max_over_max": (d.abs().max() / y32.abs().max()).item(),
    }


def _rotating(make: Callable[[int], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``make(i)`` for i = 0, 1, 2, ... on successive calls (a graph captures each call's i)."""
    counter = itertools.count()
    return lambda: make(next(counter))


def run_case(name: str, m: int, args: argparse.Namespace, copy_gb_s: float) -> dict:
    n, k = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(args.seed + m)
    w_fp8, scale = quantize_blockwise(torch.randn(n, k, generator=g, device=dev) * 0.02,
                                      (128, 128), args.scale_dtype)  # fmt: skip
    scale = scale.float()
    w_deq = dequantize_blockwise(w_fp8, scale, (128, 128))  # fp32
    x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
    y32 = x.float() @ w_deq.T
    fp8_copies = max(1, math.ceil((args.working_set << 20) / (n * k)))
    bf16_copies = max(1, math.ceil((args.working_set << 20) / (2 * n * k)))
    w8 = [w_fp8] + [w_fp8.clone() for _ in range(fp8_copies - 1)]
    w16 = [w_deq.to(torch.bfloat16) for _ in range(bf16_copies)]
    del w_deq
    mode = args.mode

    def fp8(tiles: Tiles | None, fused_sum: bool) -> Callable[[], torch.Tensor]:
        return _rotating(lambda i: fp8_linear_triton(x, w8[i % fp8_copies], scale, None, mode,
                                                     tiles=tiles, sum_splits=fused_sum))  # fmt: skip

    fns: dict[str, Callable[[], torch.Tensor]] = {
        "cublas_bf16": _rotating(lambda i: x @ w16[i % bf16_copies].T),
        "default": fp8(None, False),
    }
    tiles = {"default": tiles_for(m, interpret=False)}
    for label in args.candidates.split(","):
        tiles[label] = candidate(label, m)
        fns[label] = fp8(tiles[label], True)
    if args.scaled_mm and scaled_mm_unsupported(m, n, k) is None:
        x_fp8, x_scale = act_quant_ref(x)
        fns["scaled_mm"] = _rotating(
            lambda i: scaled_mm_blockwise(x_fp8, x_scale, w8[i % fp8_copies], scale, x.dtype)
        )
    errors, failed = {}, {}
    y_default = fns["default"]().float()
    for v, fn in list(fns.items()):
        try:
            y = fn()
        except OutOfResources as e:  # a candidate too large for this device: left out
            failed[v] = str(e)
            del fns[v]
            continue
        # A candidate differs from the default only by the order of fp32 sums (splits).
        errors[v] = {**_error(y, y32), "vs_default": _error(y, y_default)["rel_fro"]}
    inner = max(args.inner, fp8_copies)
    times = alternate({v: graph_timer(fn, inner, not args.no_graph) for v, fn in fns.items()},
                      args.repeats)  # fmt: skip
    act = x.numel() * x.element_size()
    rows = {}
    for v in fns:
        ms = statistics.median(times[v])
        moved = (2 * n * k if v == "cublas_bf16" else n * k + scale.numel() * 4) + act
        gb_s = moved / (ms * 1e-3) / 1e9
        t = tiles.get(v)
        rows[v] = {
            "median_us": 1e3 * ms, "min_us": 1e3 * min(times[v]), "gb_per_s": gb_s,
            "fraction_of_copy_rate": gb_s / copy_gb_s, **errors[v],
            "splits": plan_launch(m, n, k, t, None, False).splits if t else None,
        }  # fmt: skip
    fp8_rows = {
        v: r for v, r in rows.items() if v in args.candidates.split(",") and r["vs_default"] < 1e-3
    }
    best = min(fp8_rows, key=lambda v: fp8_rows[v]["median_us"], default=None)
    return {"shape": name, "n": n, "k": k, "m": m, "weight_copies": fp8_copies, "inner": inner,
            "variants": rows, "best": best, "left_out": failed}  # fmt: skip


def _table(cases: list[dict], candidates: list[str], extra: list[str]) -> str:
    """µs and percent of the copy rate per variant, candidates as c0, c1, ... (a legend line
    names them); ``!`` marks an output off the default's by more than 1e-3 (relative)."""
    variants = ["cublas_bf16", "default", *candidates, *extra]
    short = {v: v for v in variants} | {v: f"c{i}" for i, v in enumerate(candidates)}
    legend = "  ".join(f"{short[v]} = {v}" for v in variants if short[v] != v)
    head = f"{'shape':<24}{'M':>4}" + "".join(f"{short[v][:12]:>13}" for v in variants)
    lines = [legend, head, " " * 28 + "".join(f"{'us %copy':>13}" for _ in variants)]
    for c in cases:
        cells = []
        for v in variants:
            r = c["variants"].get(v)
            bad = "!" if r and v in candidates and r["vs_default"] > 1e-3 else " "
            pct = f"{100 * r['fraction_of_copy_rate']:.0f}" if r else ""
            cells.append(f"{r['median_us']:>7.1f}{bad}{pct:>4}" if r else "-")
        lines.append(f"{c['shape']:<24}{c['m']:>4}" + "".join(f"{s:>13}" for s in cells))
    return "\n".join(lines)


def _best(cases: list[dict], candidates: list[str]) -> str:
    """The best candidate per (shape, M), and per M each candidate's geometric-mean time over
    the shapes relative to each shape's best (1.00: best everywhere; inf: left out or wrong
    somewhere)."""
    lines = [f"{'shape':<24}{'M':>4}  {'best':<16}{'us':>8}{'GB/s':>8}{'%copy':>7}"
             f"{'vs default':>11}{'vs cuBLAS':>10}"]  # fmt: skip
    for c in cases:
        if c["best"] is None:
            lines.append(f"{c['shape']:<24}{c['m']:>4}  no candidate ran correctly")
            continue
        r, v = c["variants"][c["best"]], c["variants"]
        lines.append(
            f"{c['shape']:<24}{c['m']:>4}  {c['best']:<16}{r['median_us']:>8.1f}"
            f"{r['gb_per_s']:>8.0f}{100 * r['fraction_of_copy_rate']:>6.0f}%"
            f"{v['default']['median_us'] / r['median_us']:>10.2f}x"
            f"{v['cublas_bf16']['median_us'] / r['median_us']:>9.2f}x"
        )
    lines.append("\nper M, geometric mean over shapes of time / that shape's best:")
    for m in sorted({c["m"] for c in cases}):
        at = [c for c in cases if c["m"] == m and c["best"] is not None]
        score = {
            v: math.exp(statistics.fmean(
                math.log(c["variants"][v]["median_us"] / c["variants"][c["best"]]["median_us"])
                if v in c["variants"] and c["variants"][v]["vs_default"] < 1e-3 else math.inf
                for c in at))
            for v in candidates
        }  # fmt: skip
        ranked = sorted(score, key=score.__getitem__)
        lines.append(f"  M={m:<4} " + "  ".join(f"{v} {score[v]:.3f}" for v in ranked))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int | dict:
    try:
        names, ms = parse(args)
        for label in args.candidates.split(","):
            candidate(label, 1)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    copy_gb_s = copy_rate(torch.device("cuda"), 1 << 30) / 1e9
    print(f"device copy rate: {copy_gb_s:.0f} GB/s (read + write)", flush=True)
    cases = []
    for name, m in itertools.product(names, ms):
        cases.append(run_case(name, m, args, copy_gb_s))
        torch.cuda.empty_cache()  # the next shape's weight copies
    candidates = args.candidates.split(",")
    print(_table(cases, candidates, ["scaled_mm"] if args.scaled_mm else []))
    print("\nbest tile configuration per (shape, M):\n" + _best(cases, candidates))
    return {
        "bench": "fp8-linear",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "mode": args.mode,
        "scale_dtype": args.scale_dtype,
        "graph": not args.no_graph,
        "repeats": args.repeats,
        "working_set_mib": args.working_set,
        "copy_rate_gb_s": copy_gb_s,
        "bytes": "weight + scales + activations per call (bf16 weight for cublas_bf16)",
        "error_reference": "fp32 matmul of bf16 x on the dequantized weight",
        "candidates": candidates,
        "cases": cases,
    }
