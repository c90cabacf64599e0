"""``python -m bench sparse-attention``: the sparse MLA decode kernel's program shapes
(``AttentionTiles``) side by side at the real families' decode shapes (CUDA).

For DeepSeek-V3.2 (128 heads) and GLM-5 (64 heads), rows of 576 (the stored MLA row, bf16) with
values of 512 and ``--k`` selected rows per token at random pool locations, and each decode
batch of ``--n`` tokens: every candidate tile shape (and the default, ``attention_tiles``),
each captured in a CUDA graph of ``--inner`` calls and timed with CUDA events, alternating
(``bench/core/lockstep.py``), medians over ``--repeats``. Reported per shape: µs per call, the
selected rows' bytes over that time (GB/s), and the largest difference from the default's
output. The device's copy rate is measured in the same run."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

from bench.core.cuda_timer import graph_timer
from bench.core.lockstep import alternate
from bench.roofline.limits import copy_rate
from services.worker.ops.sparse_attention_triton import (
    AttentionTiles,
    attention_tiles,
    sparse_attention_triton,
)

FAMILIES = {"v32": 128, "glm5": 64}  # heads
D, DV = 576, 512
CANDIDATES = {
    "h32v512w8": AttentionTiles(32, 512, 32, 8),
    "h64v256w8": AttentionTiles(64, 256, 32, 8),
    "h64v128w4": AttentionTiles(64, 128, 32, 4),
    "h32v256w4": AttentionTiles(32, 256, 32, 4),
    "h64v256k64w8": AttentionTiles(64, 256, 64, 8),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--n", default="1,4,16,64", help="decode tokens per launch")
    ap.add_argument("--k", type=int, default=2048, help="selected rows per token")
    ap.add_argument("--pool-rows", type=int, default=1 << 19)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/sparse_attention.json")


def run_case(heads: int, n: int, args: argparse.Namespace, g: torch.Generator) -> dict:
    dev = torch.device("cuda")
    pool = (torch.randn(args.pool_rows, D, generator=g) * 0.5).to(dev, torch.bfloat16)
    q = (torch.randn(n, heads, D, generator=g) * 0.5).to(dev, torch.bfloat16)
    locs = torch.randint(0, args.pool_rows, (n, args.k), generator=g).to(dev)
    shapes = {"default": attention_tiles(heads, DV), **CANDIDATES}
    fns = {
        name: (lambda t=t: sparse_attention_triton(q, pool, locs, DV, 0.07, tiles=t))
        for name, t in shapes.items()
    }
    want = fns["default"]().float()
    diffs = {name: (fn().float() - want).abs().max().item() for name, fn in fns.items()}
    times = alternate({v: graph_timer(fn, args.inner, True) for v, fn in fns.items()}, args.repeats)
    row_bytes = n * args.k * D * 2
    rows = {}
    for name, t in shapes.items():
        ms = statistics.median(times[name])
        rows[name] = {
            "tiles": dataclasses.asdict(t),
            "median_us": 1e3 * ms,
            "rows_gb_per_s": row_bytes / (ms * 1e-3) / 1e9,
            "max_abs_diff_vs_default": diffs[name],
        }
    return {"heads": heads, "n": n, "k": args.k, "variants": rows}


def _table(cases: list[dict]) -> str:
    names = list(cases[0]["variants"])
    lines = [f"{'heads':>6}{'N':>5}" + "".join(f"{v:>14}" for v in names) + "   best"]
    for c in cases:
        v = c["variants"]
        best = min(v, key=lambda k: v[k]["median_us"])
        cells = "".join(f"{v[k]['median_us']:>14.1f}" for k in names)
        lines.append(
            f"{c['heads']:>6}{c['n']:>5}{cells}   {best} ({v[best]['rows_gb_per_s']:.0f} GB/s)"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int | dict:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    fams = [f for f in args.families.split(",") if f]
    ns = [int(v) for v in args.n.split(",") if v]
    cases = [run_case(FAMILIES[f], n, args, g) for f in fams for n in ns]
    rate = copy_rate(torch.device("cuda"), 1 << 30) / 1e9
    print(_table(cases))
    print(f"device copy rate: {rate:.0f} GB/s (read + write)")
    return {
        "bench": "sparse-attention",
        "device": torch.cuda.get_device_name(),
        "copy_gb_per_s": rate,
        "row": {"d": D, "dv": DV, "dtype": "bfloat16"},
        "cases": cases,
    }
