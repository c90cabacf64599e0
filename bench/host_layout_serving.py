"""Host recovery of a serving step through the engine's resolver launches (issue 27): >= 256
decoded requests, an arena >= 32 GiB, region placement ``scattered`` against ``grouped``,
host reads as queued against sorted by address, side by side in one run.

    python -m bench host-layout-serving --out docs/results/host_layout_serving.json

The regions are the store's own, placed by its allocator under each policy
(``kv_host_store.placement``) and admitted through the worker's ``HostBackups`` as the engine
admits a request (one region per source; no session regions: small ones would break up the
scattered policy's slots), interleaved with the sessions of the node's other workers (``--other-owners``, as many requests each). One source's
step is then timed as ``bench resolver`` times it (``run_case``: the engine's resolve and copy
launches, replayed from CUDA graphs, the copy in the order the policy says), over the
request's regions where the placement put them. Host bytes are the census's copied rows times
the row bytes: what the worker's ``host_read_bytes`` metric counts.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.core.output import write_result
from bench.resolver import RING, bulk_ceiling, run_case
from services.kv_host_store.placement import Placement
from services.worker.hierarchy.host_backup import HostBackups
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.kv.config import HostReadOrder

GIB = 1 << 30
ROW_DTYPES = {1152: torch.bfloat16, 656: torch.uint8}  # MLA rows: bf16, FP8-packed


def arena_bytes(args: argparse.Namespace, row: int) -> int:
    owners = 1 + args.other_owners
    region = -(-args.history * row // 4096) * 4096
    need = owners * args.requests * args.sources * region
    slack = owners * args.sources * args.extent_mib * (1 << 20)  # grouped extents' tails
    return max(args.arena_gib * GIB, -(-(need + slack) * 11 // 10 // 4096) * 4096)


def admit_all(
    store: LocalHostStore, row: int, dtype: torch.dtype, args: argparse.Namespace,
    device: str = "cuda",
) -> HostBackups:  # fmt: skip
    """The decoded requests through the worker's admission, the other workers' sessions
    through the store, request after request."""
    esize = torch.empty((), dtype=dtype).element_size()
    backups = HostBackups(store, store.mapping, "w0", args.sources, row // esize, dtype,
                          args.requests, device)  # fmt: skip
    for i in range(args.requests):
        backups.admit(i, f"r{i}", [args.history] * args.sources)
        for j in range(1, 1 + args.other_owners):
            for s in range(args.sources):
                store.allocate(f"o{j}-{i}", f"w{j}", s, args.history, row)
    return backups


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--sources", type=int, default=4, help="KV sources of each request")
    ap.add_argument("--history", type=int, default=8192, help="rows of a request's region")
    ap.add_argument("--other-owners", type=int, default=3, help="other workers on the node")
    ap.add_argument("--arena-gib", type=int, default=32, help="the arena, at least")
    ap.add_argument("--extent-mib", type=int, default=256, help="grouped placement's extent")
    ap.add_argument("--misses", default="4096,13120,52480", help="rows missed per step")
    ap.add_argument("--row-bytes", default="1152,656")
    ap.add_argument("--placements", default="scattered,grouped")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--hot-cache-rows", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-sorted", action="store_true", help="reads as queued only")
    ap.add_argument(
        "--variants", action="store_true",
        help="also the copy's launch shapes, the resolve's phases and the copy beside the "
        "second (bench.resolver.run_case)",
    )  # fmt: skip


def print_variants(results: list[dict], ceilings: dict[int, float]) -> None:
    """Each case's variants as fractions of bulk (host bytes over the variant's time)."""
    rows = [r for r in results if "variants" in r]
    if not rows:
        return
    names = list(rows[0]["variants"])
    print("\nvariants: ms (fraction of bulk for copies and totals)")
    for r in rows:
        nbytes = r["misses_per_step"] * r["row_bytes"]
        bulk_ms = nbytes / ceilings[r["row_bytes"]] / 1e6
        print(f"{r['row_bytes']} B {r['placement']} {r['misses_per_step']} misses: "
              f"sequential {r['graph_total_ms']:.3f} ms ({bulk_ms / r['graph_total_ms']:.2f})")  # fmt: skip
        for name in names:
            v = r["variants"][name]
            frac = "" if name.startswith("resolve") or name.endswith("spread") else (
                f" ({bulk_ms / v:.2f})")  # fmt: skip
            print(f"    {name:>16} {v:8.3f}{frac}")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if args.hot_cache_rows > args.history - RING:
        raise SystemExit("--history must exceed the hot cache by the tail ring")
    misses = [int(x) for x in args.misses.split(",")]
    results, ceilings = [], {}
    g = torch.Generator().manual_seed(0)
    for row in (int(x) for x in args.row_bytes.split(",")):
        dtype = ROW_DTYPES[row]
        for kind in args.placements.split(","):
            cap = arena_bytes(args, row)
            t0 = time.perf_counter()
            placement = Placement(kind, extent_bytes=args.extent_mib << 20)
            store = LocalHostStore(cap, placement=placement)
            backups = admit_all(store, row, dtype, args)  # registers the arena on the GPU
            setup_s = time.perf_counter() - t0
            try:
                ceilings.setdefault(row, bulk_ceiling(store.mapping.tensor, GIB))
                bases = backups.base[:, 0].cpu()
                d = backups.row_elems
                for r in range(args.requests):  # source 0's rows: random bytes
                    view = backups.rows_view(r, 0, 0, args.history).view(torch.uint8)
                    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8,
                                             device="cuda"))  # fmt: skip
                span = int(bases.max() - bases.min()) * backups.esize + args.history * row
                print(f"{row} B rows, {kind}: {cap / GIB:.1f} GiB arena, set up in "
                      f"{setup_s:.1f} s; source 0 spans {span / GIB:.2f} GiB")  # fmt: skip
                for m in misses:
                    for sort in (False,) if args.no_sorted else (False, True):
                        res = run_case(
                            args.requests, m / (args.requests * args.k), args.k,
                            args.hot_cache_rows, args.history, d, backups.arena, args.iters, g,
                            bases, HostReadOrder(sort), args.variants and not sort,
                        )  # fmt: skip
                        res.update(row_bytes=row, placement=kind, sorted=sort, span_bytes=span,
                                   arena_bytes=cap, requests_on_node=store.stats().requests,
                                   over_bulk=res["host_recovery_GBps"] / ceilings[row])  # fmt: skip
                        results.append(res)
            finally:
                backups.close()
                store.close()
    print(f"\n{'row':>5} {'placement':>10} {'sorted':>6} {'misses':>7} {'span GiB':>8} "
          f"{'g.total ms':>10} {'rec.GB/s':>8} {'of bulk':>7}")  # fmt: skip
    for r in results:
        print(f"{r['row_bytes']:>5} {r['placement']:>10} {r['sorted']!s:>6} "
              f"{r['misses_per_step']:>7} {r['span_bytes'] / GIB:>8.2f} "
              f"{r['graph_total_ms']:>10.3f} {r['host_recovery_GBps']:>8.1f} "
              f"{r['over_bulk']:>7.2f}")  # fmt: skip
    if args.variants:
        print_variants(results, ceilings)
    out = {
        "benchmark": "host-layout-serving",
        "machine": torch.cuda.get_device_name(),
        "bulk_host_to_device_GBps": {str(k): v for k, v in ceilings.items()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
    }
    if args.out:
        print(f"wrote {write_result(out, args.out)}")
    return 0
