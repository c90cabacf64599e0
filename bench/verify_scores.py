"""``python -m bench verify-scores``: a verify round's index scores, the two forms side by side
on the GPU at real dimensions: ``chunk`` (each request's keys gathered and widened to fp32, its
K queries scored in one fp32 product: ``row_selection.chunk_scores``, what a verify pass ran
before) and ``paged`` (each query token scored as a decode query of its request's slot by the
decode pass's kernel, ``index_scores_paged``, reading FP8 keys where they are stored: what a
verify pass runs now).

Per case (R requests, K query tokens each, W key rows, H heads of D): random FP8 keys in a
shuffled page pool, queries and weights at random, visible counts W - K + 1 .. W per request.
Both forms are captured in CUDA graphs of ``--inner`` calls and timed alternately
(``bench/core/lockstep.py``), medians over ``--repeats``; ``agree`` is their largest difference
relative to the largest score (the forms sum in different orders). Reported: µs per producer
layer and per verify pass (``--layers`` producers)."""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.core import UsageError
from bench.core.cuda_timer import graph_timer
from bench.core.lockstep import alternate
from dhisparse.family.fp8_kv_format import index_key_format
from services.worker.kv.batch import ForwardBatch
from services.worker.model.row_selection import chunk_scores
from services.worker.ops.fp8_gather_triton import fp8_gather_triton
from services.worker.ops.fp8_kv_codec import pack
from services.worker.ops.index_scores_paged import index_scores_paged


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", default="1,4,16,64", help="R")
    ap.add_argument("--k", type=int, default=4, help="query tokens per request")
    ap.add_argument("--width", type=int, default=9216, help="key rows scored (W)")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16, help="index producers per pass")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/verify_scores.json")


def run_case(r: int, args: argparse.Namespace, g: torch.Generator) -> dict:
    k, width, h, d, page = args.k, args.width, args.heads, args.dim, args.page
    fmt = index_key_format(d)
    per_slot = -(-width // page)
    table = torch.randperm(r * per_slot, generator=g).view(r, per_slot)
    values = torch.randn(r * per_slot * page, d, generator=g)
    keys = pack(fmt, values).cuda()
    table = table.cuda()
    batch = ForwardBatch.build(list(range(r)), [width - k] * r, [k] * r, "cuda")
    visible = (batch.positions + 1).clamp(max=width)
    q = (torch.randn(r * k, h, d, generator=g) * 0.5).to(torch.bfloat16).cuda()
    w = torch.randn(r * k, h, generator=g).cuda()
    rows = torch.arange(width, device="cuda")
    loc = table[:, rows // page] * page + rows % page  # [R, W] each request's key rows

    def chunk() -> torch.Tensor:
        gathered = fp8_gather_triton(fmt, keys, loc.reshape(-1), torch.bfloat16)
        return chunk_scores(q, w, batch, gathered.view(r, width, d))

    def paged() -> torch.Tensor:
        return index_scores_paged(q, w, keys, table, page, batch.token_slot, visible, width, fmt)

    fns = {"chunk": chunk, "paged": paged}
    seen = torch.arange(width, device="cuda") < visible[:, None]
    a, b = (fn().masked_fill(~seen, 0) for fn in fns.values())
    agree = float((a - b).abs().amax() / a.abs().amax().clamp(min=1e-6))
    times = alternate({v: graph_timer(fn, args.inner, True) for v, fn in fns.items()}, args.repeats)
    us = {v: 1e3 * statistics.median(t) for v, t in times.items()}
    return {"requests": r, "tokens": r * k, "us_per_layer": us,
            "ms_per_pass": {v: t * args.layers / 1e3 for v, t in us.items()},
            "speedup": us["chunk"] / us["paged"], "agree": agree}  # fmt: skip


def run(args: argparse.Namespace) -> int | dict:
    rs = [int(v) for v in args.requests.split(",") if v]
    if min(rs, default=0) < 1 or args.k < 1 or args.width < args.k:
        raise UsageError("--requests and --k take positive sizes, --width at least --k")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    cases = [run_case(r, args, g) for r in rs]
    for c in cases:
        u = c["us_per_layer"]
        print(f"R {c['requests']:>3} x K {args.k}: chunk {u['chunk']:8.1f} us  paged "
              f"{u['paged']:8.1f} us  ({c['speedup']:.1f}x, agree {c['agree']:.1e})")  # fmt: skip
    return {"bench": "verify-scores", "device": torch.cuda.get_device_name(),
            "k": args.k, "width": args.width, "heads": args.heads, "dim": args.dim,
            "layers": args.layers, "cases": cases}  # fmt: skip
