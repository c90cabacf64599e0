"""``python -m bench select-topk``: the indexer's ordered top-k selections side by side at
decode shapes (CUDA): ``torch`` (``select_topk_ref``: mask, stable sort of the whole row,
padding; what serving runs for rows wider than ``MAX_WIDTH``), ``bitonic``
(``select_topk_triton``, one program's top-k of the whole row, for rows of at most
``KERNEL_WIDTH``) and ``radix-*`` (``select_topk_radix`` at each ``RadixTiles``: one program
per query, or ``radix-c*`` the row's passes in chunks of that many scores).

For each batch of ``--t`` queries, row width ``--s`` and ``--k``: fp32 scores at random, the
queries' visible lengths spread over [s/2, s] (the first one sees the whole row), as a decode
batch of requests with different histories. Each variant is captured in a CUDA graph of
``--inner`` calls and timed with CUDA events, alternating (``bench/core/lockstep.py``),
medians over ``--repeats``; each must give ``torch``'s positions exactly (``exact``). Reported:
µs per call and the visible scores' bytes over that time (GB/s)."""

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
from services.worker.ops.indexer import select_topk_ref
from services.worker.ops.select_topk_radix import MAX_K, RadixTiles, select_topk_radix
from services.worker.ops.select_topk_triton import KERNEL_WIDTH, select_topk_triton

RADIX = {
    "radix-b4096w8": RadixTiles(4096, 8),
    "radix-b2048w4": RadixTiles(2048, 4),
    "radix-b8192w16": RadixTiles(8192, 16),
    # the two passes over the row in chunks, a program each
    "radix-c8192-b2048w4": RadixTiles(2048, 4, 8192),
    "radix-c16384-b4096w8": RadixTiles(4096, 8, 16384),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--t", default="1,4,16,64", help="queries per launch (decode tokens)")
    ap.add_argument("--s", default="8192,32768,131072", help="scores per query (row width)")
    ap.add_argument("--k", default="512,1024,2048", help="positions selected per query")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/select_topk.json")


def variants(scores: torch.Tensor, visible: torch.Tensor, k: int) -> dict[str, Callable]:
    fns: dict[str, Callable] = {"torch": lambda: select_topk_ref(scores, visible, k)}
    if scores.shape[1] <= KERNEL_WIDTH:
        fns["bitonic"] = lambda: select_topk_triton(scores, visible, k)
    for name, tiles in RADIX.items():
        fns[name] = lambda tiles=tiles: select_topk_radix(scores, visible, k, tiles)
    return fns


def run_case(t: int, s: int, k: int, args: argparse.Namespace, g: torch.Generator) -> dict:
    scores = torch.randn(t, s, generator=g).cuda()
    visible = torch.randint(s // 2, s + 1, (t,), generator=g)
    visible[0] = s
    visible = visible.cuda()
    fns = variants(scores, visible, k)
    want = fns["torch"]()
    exact, failed = {}, {}
    for name, fn in list(fns.items()):
        try:
            exact[name] = bool(torch.equal(fn(), want))
        except OutOfResources as e:  # a variant too large for this device: left out
            failed[name] = str(e)
            del fns[name]
    times = alternate({v: graph_timer(fn, args.inner, True) for v, fn in fns.items()}, args.repeats)
    read = int(visible.sum()) * 4
    rows = {}
    for name in fns:
        ms = statistics.median(times[name])
        tiles = RADIX.get(name)
        rows[name] = {
            "tiles": dataclasses.asdict(tiles) if tiles else None,
            "median_us": 1e3 * ms,
            "scores_gb_per_s": read / (ms * 1e-3) / 1e9,
            "exact": exact[name],
        }
    return {"t": t, "s": s, "k": k, "visible_scores": read // 4, "variants": rows,
            "failed": failed}  # fmt: skip


def _table(cases: list[dict]) -> str:
    names = ["torch", "bitonic", *RADIX]
    lines = [f"{'T':>4}{'S':>8}{'k':>6}" + "".join(f"{v:>21}" for v in names) + "   best"]
    for c in cases:
        v = c["variants"]
        best = min(v, key=lambda n: v[n]["median_us"])
        cells = "".join(
            f"{v[n]['median_us']:>20.1f}{'' if v[n]['exact'] else '!'}" if n in v else f"{'-':>21}"
            for n in names
        )
        lines.append(f"{c['t']:>4}{c['s']:>8}{c['k']:>6}{cells}   {best}")
    return "\n".join(lines) + "\n(µs per call; ! = not torch's positions)"


def run(args: argparse.Namespace) -> int | dict:
    ts, ss, ks = ([int(v) for v in a.split(",") if v] for a in (args.t, args.s, args.k))
    if min(ts + ss + ks, default=0) < 1 or max(ks) > MAX_K:
        raise UsageError(f"--t, --s and --k take positive sizes, k at most {MAX_K}")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    cases = [run_case(t, s, k, args, g) for s in ss for k in ks for t in ts]
    print(_table(cases))
    return {
        "bench": "select-topk",
        "device": torch.cuda.get_device_name(),
        "all_exact": all(v["exact"] for c in cases for v in c["variants"].values()),
        "cases": cases,
    }
