"""Host-recovery bandwidth against the footprint a step's reads span (issue 27), on a GPU.

    python -m bench host-layout --out docs/results/host_layout.json --plot docs/results/host_layout.png

Rows are read by the resolver's own copy kernel (``copy_triton.copy_queued``) from a /dev/shm
arena registered with CUDA, as the worker maps the store's (a pinned tensor when /dev/shm is
too small; the JSON says which). One arena of the largest footprint serves every case: a case
only restricts where its rows lie. For each row size (MLA bf16 and FP8 rows), misses per step
m, region count R and footprint F, the step reads m/R rows from each of R regions of S rows
(S = ``--region-rows``, or twice a region's share of the misses when that is more; smaller
when R regions of S rows would not fit F), queued as the
resolver queues them (region by region, each region's rows in selection order: scattered):

- ``random``: the R regions at random region-sized slots of the first F bytes;
- ``random-sorted``: the same queue sorted by address first (``read_order.sort_queued``, the
  engine's default);
- ``grouped`` / ``grouped-sorted``: the same R regions side by side (the grouped placement
  keeps one source's regions of the decoded requests together), in the resolver's order and
  sorted.

Each figure is a fraction of one bulk pinned-to-device copy measured in the same run. The
sort's own device time (over a queue of R x k entries, as the engine sorts) is recorded apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from bench.core.clock import cuda_ms
from bench.core.output import write_result
from bench.core.progress import progress
from bench.resolver import bulk_ceiling, host_arena
from services.worker.hierarchy.copy_triton import copy_queued
from services.worker.hierarchy.read_order import sort_queued

MIB = 1 << 20
VARIANTS = ("random", "random-sorted", "grouped", "grouped-sorted")
ROW_DTYPES = {1152: torch.bfloat16, 656: torch.uint8}  # MLA rows: bf16, FP8-packed


def region_bases(
    rng: np.random.Generator, regions: int, region_bytes: int, footprint: int, grouped: bool
) -> np.ndarray:
    """Byte offsets of the step's regions: side by side, or at random slots within F."""
    if grouped:
        return np.arange(regions, dtype=np.int64) * region_bytes
    slots = footprint // region_bytes
    return np.sort(rng.choice(slots, regions, replace=False)).astype(np.int64) * region_bytes


def queue(
    rng: np.random.Generator, bases: np.ndarray, region_rows: int, misses: int, row: int
) -> np.ndarray:
    """Byte offsets of the step's ``misses`` reads in the resolver's order: region after
    region (in the order their requests' programs ran: random), each region's rows (an even
    share) scattered over it."""
    r = len(bases)
    share = [misses // r + (i < misses % r) for i in range(r)]
    parts = [bases[i] + rng.choice(region_rows, share[i], replace=False).astype(np.int64) * row
             for i in rng.permutation(r)]  # fmt: skip
    return np.concatenate(parts)


class Case:
    """One (row size, misses, regions) step on the shared device buffers."""

    def __init__(self, host: torch.Tensor, pool: torch.Tensor, iters: int) -> None:
        self.host, self.pool, self.iters = host, pool, iters
        self.esize = host.element_size()
        n = pool.shape[0]
        self.src = torch.empty(n, dtype=torch.int64, device="cuda")
        self.dst = torch.empty(n, dtype=torch.int64, device="cuda")
        self.count = torch.zeros(1, dtype=torch.int64, device="cuda")

    def load(self, byte_offsets: np.ndarray, sort: bool) -> None:
        m = len(byte_offsets)
        self.src[:m].copy_(torch.from_numpy(byte_offsets // self.esize))
        self.dst[:m].copy_(torch.randperm(m))
        self.count.fill_(m)
        if sort:
            sort_queued(self.src, self.dst, self.count[0], m)

    def copy_ms(self) -> float:
        n = self.src.numel()
        ms = cuda_ms(
            lambda: copy_queued(self.pool, self.src, self.dst, self.count, self.host, n),
            self.iters,
        )
        return statistics.median(ms)

    def sort_ms(self, m: int, queued: int) -> float:
        """Device time of the engine's sort of a queue of ``queued`` entries, m of them live."""
        src = torch.randint(0, 1 << 36, (queued,), device="cuda")
        dst = torch.arange(queued, device="cuda")
        count = torch.tensor(m, device="cuda")
        return statistics.median(cuda_ms(lambda: sort_queued(src, dst, count, queued), 5))


def check_exact(host: torch.Tensor, pool: torch.Tensor, d: int) -> None:
    """In either order every queued row lands where its entry says, byte for byte, and the
    sort keeps every entry."""
    span = min(64 * MIB, host.numel() * host.element_size())
    raw = host.view(torch.uint8)[:span]
    raw.copy_(torch.randint(0, 256, (span,), dtype=torch.uint8))
    row = d * host.element_size()
    offs = np.random.default_rng(1).choice(span // row, 4096, replace=False) * row
    case = Case(host, pool, 1)
    for sort in (False, True):
        case.load(offs.astype(np.int64), sort)
        pool.zero_()
        copy_queued(pool, case.src, case.dst, case.count, host, len(offs))
        torch.cuda.synchronize()
        src, dst = case.src[: len(offs)].cpu(), case.dst[: len(offs)].cpu()
        assert torch.equal(torch.sort(src).values,
                           torch.sort(torch.from_numpy(offs // host.element_size())).values)  # fmt: skip
        want = host[src[:, None] + torch.arange(d)].contiguous().view(torch.uint8)
        got = pool[dst.cuda()].cpu().contiguous().view(torch.uint8)  # bytes: random bits hold NaNs
        assert torch.equal(got, want), f"copied rows differ (sorted={sort})"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--footprints-mib", default="64,256,1024,4096,8192,16384,32768,65536")
    ap.add_argument("--misses", default="4096,13120,52480", help="rows read per step")
    ap.add_argument("--regions", default="1,64,256,1024", help="request regions per step")
    ap.add_argument("--row-bytes", default="1152,656")
    ap.add_argument("--region-rows", type=int, default=32768, help="a region's rows (at most)")
    ap.add_argument("--k", type=int, default=2048, help="selected rows per request (the sort)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="PNG path")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def run(args: argparse.Namespace) -> dict | int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    footprints = [f * MIB for f in _ints(args.footprints_mib)]
    misses, regions, row_sizes = _ints(args.misses), _ints(args.regions), _ints(args.row_bytes)
    t0 = time.perf_counter()
    host_u8, kind, keep = host_arena(max(footprints))
    arena_s = time.perf_counter() - t0
    try:
        ceiling = bulk_ceiling(host_u8, min(max(footprints), 1 << 30))
        print(f"host arena: {kind}, {max(footprints) / 2**30:.1f} GiB in {arena_s:.1f} s; "
              f"bulk host->device {ceiling:.1f} GB/s")  # fmt: skip
        results, sorts = [], []
        rng = np.random.default_rng(args.seed)
        for row in row_sizes:
            dtype = ROW_DTYPES[row]
            esize = torch.empty((), dtype=dtype).element_size()
            d = row // esize
            host = host_u8[: host_u8.numel() // esize * esize].view(dtype)
            pool = torch.empty(max(misses), d, dtype=dtype, device="cuda")
            check_exact(host, pool, d)
            case = Case(host, pool, args.iters)
            grid = [(m, r, f) for m in misses for r in regions for f in footprints]
            done: dict[tuple, float] = {}
            for m, r, f in progress(grid, f"host-layout {row} B"):
                # a region holds at least twice its share of the misses
                s_rows = min(max(args.region_rows, -(-2 * m // r)), f // r // row)
                if s_rows < -(-m // r):
                    continue  # R regions cannot hold m distinct rows here
                for variant in VARIANTS:
                    grouped, sort = variant.startswith("grouped"), variant.endswith("sorted")
                    key = (m, r, s_rows, variant) if grouped else (m, r, s_rows, f, variant)
                    if key not in done:
                        bases = region_bases(rng, r, s_rows * row, f, grouped)
                        case.load(queue(rng, bases, s_rows, m, row), sort)
                        done[key] = case.copy_ms()
                    ms = done[key]
                    gbps = m * row / ms / 1e6
                    span = r * s_rows * row if grouped else f
                    results.append({
                        "row_bytes": row, "misses": m, "regions": r, "footprint_bytes": f,
                        "region_rows": s_rows, "variant": variant, "span_bytes": span,
                        "copy_ms": ms, "GBps": gbps, "over_bulk": gbps / ceiling,
                    })  # fmt: skip
            for m in misses:
                for r in regions:
                    queued = max(m, r * args.k)
                    sorts.append({"row_bytes": row, "misses": m, "regions": r,
                                  "queued": queued, "sort_ms": case.sort_ms(m, queued)})  # fmt: skip
            del pool, case
    finally:
        if keep is not None:
            arena, mapping = keep
            mapping.close()
            arena.close(remove=True)
    out = {
        "benchmark": "host-layout",
        "machine": torch.cuda.get_device_name(),
        "host_arena": kind,
        "arena_bytes": max(footprints),
        "arena_setup_s": arena_s,
        "bulk_host_to_device_GBps": ceiling,
        "copy_kernel": "services.worker.hierarchy.copy_triton.copy_queued",
        "region_rows": args.region_rows,
        "k": args.k,
        "results": results,
        "sort": sorts,
    }
    print_table(out)
    if args.out:
        print(f"wrote {write_result(out, args.out)}")
    if args.plot:
        plot(out, args.plot)
    return 0


def print_table(out: dict) -> None:
    fps = sorted({r["footprint_bytes"] for r in out["results"]})
    print("\nfraction of bulk by footprint (GiB); rows: row bytes, misses, regions, variant")
    print(f"{'row':>5} {'misses':>6} {'R':>5} {'variant':>15} "
          + " ".join(f"{f / 2**30:>6.3g}" for f in fps))  # fmt: skip
    keys = sorted({(r["row_bytes"], r["misses"], r["regions"], r["variant"])
                   for r in out["results"]}, key=lambda k: (-k[0], k[1], k[2], VARIANTS.index(k[3])))  # fmt: skip
    for key in keys:
        by_f = {r["footprint_bytes"]: r["over_bulk"] for r in out["results"]
                if (r["row_bytes"], r["misses"], r["regions"], r["variant"]) == key}  # fmt: skip
        cells = " ".join(f"{by_f[f]:>6.2f}" if f in by_f else f"{'':>6}" for f in fps)
        print(f"{key[0]:>5} {key[1]:>6} {key[2]:>5} {key[3]:>15} {cells}")
    worst = max(out["sort"], key=lambda s: s["sort_ms"])
    print(f"sort of a step's queue: at most {worst['sort_ms']:.3f} ms ({worst['queued']} entries)")


def plot(out: dict, path: str) -> None:
    from bench.core.plots import pyplot, save

    try:
        plt = pyplot()
    except ImportError as e:
        print(f"no plot: matplotlib is not installed ({e})")
        return
    rows = sorted({r["row_bytes"] for r in out["results"]}, reverse=True)
    misses = sorted({r["misses"] for r in out["results"]})
    fig, axes = plt.subplots(len(rows), len(misses), figsize=(4.5 * len(misses), 3.6 * len(rows)),
                             squeeze=False, sharey=True)  # fmt: skip
    styles = {"random": "-", "random-sorted": "--", "grouped": ":", "grouped-sorted": "-."}
    for i, row in enumerate(rows):
        for j, m in enumerate(misses):
            ax = axes[i][j]
            for c, r in enumerate(sorted({x["regions"] for x in out["results"]})):
                for v, ls in styles.items():
                    pts = sorted((x["footprint_bytes"] / 2**30, x["over_bulk"])
                                 for x in out["results"] if (x["row_bytes"], x["misses"],
                                 x["regions"], x["variant"]) == (row, m, r, v))  # fmt: skip
                    if pts:
                        ax.plot(*zip(*pts, strict=True), ls, color=f"C{c}", marker=".",
                                label=f"R={r} {v}")  # fmt: skip
            ax.set(xscale="log", xlabel="footprint (GiB)", ylim=(0, 1.05),
                   title=f"{row} B rows, {m} misses/step")  # fmt: skip
            if j == 0:
                ax.set_ylabel("fraction of bulk copy")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"host-row gather vs footprint ({out['machine']}, bulk "
                 f"{out['bulk_host_to_device_GBps']:.1f} GB/s)")  # fmt: skip
    fig.tight_layout()
    save(fig, path)
