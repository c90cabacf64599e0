"""``python -m bench index-scores``: DeepSeek-V4's decode indexer over fp32 queries, the paged
scoring kernel's two ways side by side on the GPU: ``ieee`` (one IEEE fp32 dot, no tensor
cores) and ``split`` (each query as three bf16 parts, three tensor-core dots: the same exact
products summed in another order; ``index_scores_paged``'s default for such queries).

Per case (R decode queries, W key rows each, H heads of D, keys bf16 or FP8 in a shuffled page
pool): both variants captured in CUDA graphs of ``--inner`` calls and timed alternately
(``bench/core/lockstep.py``), medians over ``--repeats``; ``agree`` is their largest difference
relative to the largest score. Reported: µs per producer layer and ms per decode step
(``--layers`` producers: V4-Flash has 21 CSA layers)."""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.core import UsageError
from bench.core.cuda_timer import graph_timer
from bench.core.lockstep import alternate
from dhisparse.family.fp8_kv_format import index_key_format
from services.worker.ops.fp8_kv_codec import pack
from services.worker.ops.index_scores_paged import index_scores_paged

VARIANTS = ("ieee", "split")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", default="1,4,16,64", help="R")
    ap.add_argument("--widths", default="2048,8192", help="key rows (8K and 32K at ratio 4)")
    ap.add_argument("--keys", default="bf16,fp8")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--layers", type=int, default=21, help="index producers per step")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/index_scores.json")


def run_case(r: int, width: int, kind: str, args: argparse.Namespace, g: torch.Generator) -> dict:
    h, d, page = args.heads, args.dim, args.page
    per_slot = -(-width // page)
    table = torch.randperm(r * per_slot, generator=g).view(r, per_slot).cuda()
    values = torch.randn(r * per_slot * page, d, generator=g)
    fmt = index_key_format(d) if kind == "fp8" else None
    keys = (values.to(torch.bfloat16) if fmt is None else pack(fmt, values)).cuda()
    q = (torch.randn(r, h, d, generator=g) * 0.5).cuda()
    w = torch.randn(r, h, generator=g).cuda()
    slots = torch.arange(r, device="cuda")
    visible = torch.full((r,), width, device="cuda")

    def variant(split: bool):
        return lambda: index_scores_paged(q, w, keys, table, page, slots, visible, width, fmt,
                                          split=split)  # fmt: skip

    fns = {v: variant(v == "split") for v in VARIANTS}
    a, b = (fn() for fn in fns.values())
    agree = float((a - b).abs().amax() / a.abs().amax().clamp(min=1e-6))
    times = alternate({v: graph_timer(fn, args.inner, True) for v, fn in fns.items()}, args.repeats)
    us = {v: 1e3 * statistics.median(t) for v, t in times.items()}
    spread = {v: [1e3 * min(t), 1e3 * max(t)] for v, t in times.items()}
    return {"requests": r, "width": width, "keys": kind, "us_per_layer": us,
            "us_range": spread, "ms_per_step": {v: t * args.layers / 1e3 for v, t in us.items()},
            "speedup": us["ieee"] / us["split"], "agree": agree}  # fmt: skip


def run(args: argparse.Namespace) -> int | dict:
    rs = [int(v) for v in args.requests.split(",") if v]
    widths = [int(v) for v in args.widths.split(",") if v]
    kinds = [v for v in args.keys.split(",") if v]
    if min(rs + widths, default=0) < 1 or not set(kinds) <= {"bf16", "fp8"}:
        raise UsageError("--requests and --widths take positive sizes, --keys bf16 and fp8")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    cases = [run_case(r, w, k, args, g) for k in kinds for w in widths for r in rs]
    for c in cases:
        u = c["us_per_layer"]
        print(f"{c['keys']:>4} W {c['width']:>5} R {c['requests']:>3}: ieee {u['ieee']:7.1f} us  "
              f"split {u['split']:7.1f} us  ({c['speedup']:.2f}x, agree {c['agree']:.1e})")  # fmt: skip
    return {"bench": "index-scores", "device": torch.cuda.get_device_name(),
            "heads": args.heads, "dim": args.dim, "page": args.page, "layers": args.layers,
            "cases": cases}  # fmt: skip
