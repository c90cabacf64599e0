"""``python -m bench sparse-attention``: the sparse MLA decode kernels side by side at the real
families' decode shapes (CUDA): the tiled kernel's program shapes (``AttentionTiles``) and the
one-pass kernel's (``OnePassTiles``), over rows stored in bf16 and in packed FP8.

For DeepSeek-V3.2 (128 heads) and GLM-5 (64 heads), rows of 576 (the stored MLA row) with
values of 512 and ``--k`` selected rows per token at random pool locations, and each decode
batch of ``--n`` tokens. In bf16 (``--kv bf16``): every candidate reads the pool by location.
In FP8 (``--kv fp8``, 656-byte packed rows): ``gather+<tiles>`` dequantizes the selected rows
into a workspace (``fp8_gather_triton``) and attends over it (``gather+default``: the serving
path), ``onepass-*`` reads the packed rows itself. Each variant is captured in a CUDA
graph of ``--inner`` calls and timed with CUDA events, alternating
(``bench/core/lockstep.py``), medians over ``--repeats``. Reported per shape: µs per call, the
selected rows' stored bytes over that time (GB/s), and the largest difference from
``default``'s output (the shape ``attention_tiles`` chooses, or in FP8 ``gather+default``).
A candidate this device cannot compile (registers or shared memory) is listed as failed. The
device's copy rate is measured in the same run."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable

import torch
from triton.runtime.errors import OutOfResources

from bench.core import UsageError
from bench.core.cuda_timer import graph_timer
from bench.core.lockstep import alternate
from bench.roofline.limits import copy_rate
from dhisparse.family.fp8_kv_format import mla_row_format
from services.worker.ops.fp8_gather_triton import fp8_gather_triton
from services.worker.ops.fp8_kv_codec import pack
from services.worker.ops.sparse_attention_onepass import OnePassTiles, PackedRows
from services.worker.ops.sparse_attention_triton import (
    AttentionTiles,
    attention_tiles,
    sparse_attention_triton,
)

FAMILIES = {"v32": 128, "glm5": 64}  # heads
D, DV = 576, 512
FMT = mla_row_format(DV, D - DV)
TILED = {
    "h64v256k64w8": AttentionTiles(64, 256, 64, 8),  # the tiled kernel's best
    "h16v512w4": AttentionTiles(16, 512),
    "h32v512w8": AttentionTiles(32, 512, 32, 8),
    "h64v256w8": AttentionTiles(64, 256, 32, 8),
    "h64v128w4": AttentionTiles(64, 128, 32, 4),
    "h32v256w4": AttentionTiles(32, 256, 32, 4),
}
ONE_PASS = {
    "onepass-h16k32w4": OnePassTiles(16, 32, 4),
    "onepass-h32k32w8": OnePassTiles(32, 32, 8),
    "onepass-h32k64w8": OnePassTiles(32, 64, 8),
    "onepass-h64k32w8": OnePassTiles(64, 32, 8),
    "onepass-h32k32w8s3": OnePassTiles(32, 32, 8, 3),
    # fewer splits: fewer fp32 partials written and combined at small batches
    "onepass-h32k32w8x8": OnePassTiles(32, 32, 8, max_splits=8),
    "onepass-h32k32w8x16": OnePassTiles(32, 32, 8, max_splits=16),
    "onepass-h64k32w8x16": OnePassTiles(64, 32, 8, max_splits=16),
}
# over packed FP8 rows, the values decoded by the device's conversion too
ONE_PASS_FP8 = {
    **ONE_PASS,
    "onepass-h32k32w8c": OnePassTiles(32, 32, 8, cast_fp8=True),
    "onepass-h64k32w8c": OnePassTiles(64, 32, 8, cast_fp8=True),
}
KV = ("bf16", "fp8")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--n", default="1,4,16,64", help="decode tokens per launch")
    ap.add_argument("--k", type=int, default=2048, help="selected rows per token")
    ap.add_argument("--kv", default=",".join(KV), help="stored row formats: bf16, fp8")
    ap.add_argument("--pool-rows", type=int, default=1 << 19)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/sparse_attention.json")


def variants(
    heads: int, n: int, kv: str, args: argparse.Namespace, g: torch.Generator, dev: torch.device
) -> tuple[dict[str, Callable], dict, int]:
    """(name -> a call, name -> its tiles, the stored bytes a call reads) of one shape."""
    rows = torch.randn(args.pool_rows, D, generator=g) * 0.5
    q = (torch.randn(n, heads, D, generator=g) * 0.5).to(dev, torch.bfloat16)
    locs = torch.randint(0, args.pool_rows, (n, args.k), generator=g).to(dev)
    scale = D**-0.5
    tiled = {"default": attention_tiles(heads, n), **TILED}
    if kv == "bf16":
        pool = rows.to(dev, torch.bfloat16)
        shapes = {**tiled, **ONE_PASS}
        fns = {
            name: (lambda t=t: sparse_attention_triton(q, pool, locs, DV, scale, tiles=t))
            for name, t in shapes.items()
        }
        return fns, shapes, n * args.k * D * 2
    packed = pack(FMT, rows.to(dev))
    ws = torch.empty(n * args.k, D, dtype=torch.bfloat16, device=dev)
    at = torch.arange(n * args.k, device=dev).view(n, args.k)

    def gathered(t: AttentionTiles | OnePassTiles) -> torch.Tensor:
        fp8_gather_triton(FMT, packed, locs.flatten(), torch.bfloat16, out=ws)
        return sparse_attention_triton(q, ws, at, DV, scale, tiles=t)

    src = PackedRows(packed, FMT)
    fns = {f"gather+{name}": (lambda t=t: gathered(t)) for name, t in tiled.items()}
    fns |= {
        name: (lambda t=t: sparse_attention_triton(q, src, locs, DV, scale, tiles=t))
        for name, t in ONE_PASS_FP8.items()
    }
    shapes = {f"gather+{name}": t for name, t in tiled.items()} | ONE_PASS_FP8
    return fns, shapes, n * args.k * FMT.row_bytes


def run_case(heads: int, n: int, kv: str, args: argparse.Namespace, g: torch.Generator) -> dict:
    fns, shapes, row_bytes = variants(heads, n, kv, args, g, torch.device("cuda"))
    base = "default" if kv == "bf16" else "gather+default"
    want = fns[base]().float()
    diffs, failed = {}, {}
    for name, fn in list(fns.items()):
        try:
            diffs[name] = (fn().float() - want).abs().max().item()
        except OutOfResources as e:  # a candidate too large for this device: left out
            failed[name] = str(e)
            del fns[name]
    times = alternate({v: graph_timer(fn, args.inner, True) for v, fn in fns.items()}, args.repeats)
    rows = {}
    for name in fns:
        ms = statistics.median(times[name])
        rows[name] = {
            "kernel": type(shapes[name]).__name__,
            "tiles": dataclasses.asdict(shapes[name]),
            "median_us": 1e3 * ms,
            "rows_gb_per_s": row_bytes / (ms * 1e-3) / 1e9,
            "max_abs_diff_vs_default": diffs[name],
        }
    return {"heads": heads, "n": n, "k": args.k, "kv": kv, "base": base, "variants": rows,
            "failed": failed}  # fmt: skip


def _table(cases: list[dict]) -> str:
    lines = []
    for kv in dict.fromkeys(c["kv"] for c in cases):
        block = [c for c in cases if c["kv"] == kv]
        names = list(block[0]["variants"])
        lines.append(f"{kv}: " + ", ".join(f"[{i}] {v}" for i, v in enumerate(names)))
        lines.append(f"{'heads':>6}{'N':>5}" + "".join(f"{i:>9}" for i in range(len(names)))
                     + "   best")  # fmt: skip
        for c in block:
            v = c["variants"]
            best = min(v, key=lambda k: v[k]["median_us"])
            cells = "".join(f"{v[k]['median_us']:>9.1f}" if k in v else f"{'-':>9}"
                            for k in names)  # fmt: skip
            lines.append(f"{c['heads']:>6}{c['n']:>5}{cells}   {best} "
                         f"({v[best]['rows_gb_per_s']:.0f} GB/s)")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int | dict:
    fams = [f for f in args.families.split(",") if f]
    ns = [int(v) for v in args.n.split(",") if v]
    kvs = [v for v in args.kv.split(",") if v]
    if unknown := set(kvs) - set(KV):
        raise UsageError(f"--kv {sorted(unknown)}: choose from {', '.join(KV)}")
    if unknown := set(fams) - set(FAMILIES):
        raise UsageError(f"--families {sorted(unknown)}: choose from {', '.join(FAMILIES)}")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    cases = [run_case(FAMILIES[f], n, kv, args, g) for kv in kvs for f in fams for n in ns]
    rate = copy_rate(torch.device("cuda"), 1 << 30) / 1e9
    print(_table(cases))
    print(f"device copy rate: {rate:.0f} GB/s (read + write)")
    return {
        "bench": "sparse-attention",
        "device": torch.cuda.get_device_name(),
        "copy_gb_per_s": rate,
        "row": {"d": D, "dv": DV, "bf16_bytes": 2 * D, "fp8_bytes": FMT.row_bytes},
        "cases": cases,
    }
