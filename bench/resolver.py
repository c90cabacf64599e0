"""Resolver benchmark (H200): latency vs batch and miss rate, host-recovery bandwidth, and
all-hit resolution against a plain device gather of the same rows.

    python -m bench resolver --out docs/results/resolver.json --plot docs/results/resolver.png

One source, k selected rows per request, B hot-cache entries per request, rows of
``--row-bytes`` (bf16). The host backups live in a /dev/shm arena registered with CUDA, as in
serving (a pinned tensor if /dev/shm is too small; the JSON says which). Each request's misses
are spread uniformly over its own contiguous region. Every timed run starts from the same hot
cache state.

Each case times four things in lockstep, eagerly and then replayed from CUDA graphs: the
resolve, the copy of the rows it queued, both (what a decode step runs), and a plain device
gather (``index_select``) of the rows the resolve located: one run of each per round, the first
rotating, on the same inputs, for ``--iters`` rounds (``bench.core.lockstep.alternate``), so a
phase of the machine weighs on all four alike. ``total_over_gather`` is the replayed medians'
``graph_total_ms / graph_plain_gather_ms``: what the resolver costs a step over reading the
same rows from a fully resident cache (``resolve_over_gather``: the resolve alone).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.core.clock import cuda_ms
from bench.core.lockstep import alternate
from bench.core.output import write_result
from bench.core.plots import pyplot, save
from bench.core.progress import progress
from services.worker.hierarchy.copy_triton import CopyLaunch, copy_queued
from services.worker.hierarchy.geometry import SourceGeometry
from services.worker.hierarchy.hot_cache import HotCache
from services.worker.hierarchy.plan import ChunkPlan
from services.worker.hierarchy.resolver_triton import (
    ResolveLaunch,
    Workspace,
    launch_copy,
    launch_resolve,
    resolve_launcher,
)
from services.worker.kv.config import HostReadOrder

# the launch shapes ``run_case(variants=True)`` times beside the defaults
COPY_VARIANTS = {
    "default": CopyLaunch(),
    "rows8": CopyLaunch(rows=8),
    "rows32": CopyLaunch(rows=32),
    "1/sm": CopyLaunch(programs_per_sm=1),
    "4/sm": CopyLaunch(programs_per_sm=4),
    "8warps": CopyLaunch(num_warps=8),
}
RESOLVE_VARIANTS = {f"{w}warps": ResolveLaunch(num_warps=w) for w in (4, 8, 16, 32)}

PAGE = 64
RING = 128  # one 64-row page plus a verification block, rounded to pages as the engine does


def host_arena(nbytes: int) -> tuple[torch.Tensor, str, object]:
    """A registered /dev/shm arena, or pinned memory when /dev/shm is too small."""
    shm = Path("/dev/shm")
    if shm.exists() and shutil.disk_usage(shm).free > nbytes * 1.1:
        from services.kv_host_store.arena import HostArena, map_arena

        path = shm / f"dhisparse-bench-{os.getpid()}"
        arena = HostArena.create(path, nbytes)
        mapping = map_arena(path, nbytes)
        t0 = time.perf_counter()
        mapping.pin()
        print(f"registered {nbytes / 2**30:.1f} GiB arena in {time.perf_counter() - t0:.1f} s")
        return mapping.tensor, "dev-shm-registered", (arena, mapping)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "pinned-tensor", None


def bulk_ceiling(host_u8: torch.Tensor, nbytes: int) -> float:
    src = host_u8[:nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = statistics.median(cuda_ms(lambda: dst.copy_(src, non_blocking=True), 10))
    return nbytes / ms / 1e6  # GB/s


def run_case(
    nreq: int, miss_rate: float, k: int, b: int, hist: int, d: int, host: torch.Tensor,
    iters: int, g: torch.Generator, host_base: torch.Tensor | None = None,
    order: HostReadOrder = HostReadOrder(), variants: bool = False,
) -> dict:  # fmt: skip
    """One batch: ``host_base`` [nreq] int64 is each request's region (element offset of its
    row 0; default: the regions side by side); ``order``: how the copy issues the reads.
    ``variants``: also the resolve's launch shapes (``RESOLVE_VARIANTS``) and, where rows miss,
    its two phases, the copy kernel's launch shapes (``COPY_VARIANTS``), the copy beside the
    second phase (on a side stream) and a compact-window copy of as many rows (``variants`` in
    the result, ms from CUDA graphs)."""
    dev = torch.device("cuda")
    per = (b + RING) // PAGE
    geo = SourceGeometry.create(nreq, PAGE, b, RING, nreq * per * PAGE, 1, hist, dev)
    geo.optional = False  # hisparse serving: no optional history, the resolver skips its map
    pages = torch.arange(nreq * per, dtype=torch.int32, device=dev).view(nreq, per)
    geo.hot_pages.copy_(pages[:, : b // PAGE])
    geo.tail_pages.copy_(pages[:, b // PAGE :])
    pool = torch.zeros(nreq * per * PAGE + 1, d, dtype=host.dtype, device=dev)
    hot = HotCache(nreq, b, hist, dev)
    n_miss = round(k * miss_rate)
    n_hit = k - n_miss
    sel = torch.empty(nreq, k, dtype=torch.int64)
    rows = torch.empty(nreq, b, dtype=torch.int64)
    history = hist - RING  # rows old enough to need the hierarchy
    for r in range(nreq):
        perm = torch.randperm(history, generator=g)
        rows[r] = perm[:b]
        chosen = torch.cat([perm[:b][torch.randperm(b, generator=g)[:n_hit]], perm[b : b + n_miss]])
        sel[r] = chosen[torch.randperm(k, generator=g)]
    entries = torch.arange(b).expand(nreq, b)
    hot.rows.copy_(rows.to(torch.int32))
    hot.stamp.copy_(torch.randint(1, 1000, (nreq, b), generator=g))
    hot.map.scatter_(1, rows.to(dev), entries.to(dev, hot.map.dtype))
    if host_base is None:
        host_base = torch.arange(nreq, dtype=torch.int64) * hist * d
    host_base = host_base.cpu()
    # The cached entries hold their rows' bytes, as after earlier steps' copies.
    hot_locs = geo.hot_loc(torch.arange(nreq, device=dev).unsqueeze(1), entries.to(dev))
    for r, base in enumerate(host_base.tolist()):
        pool[hot_locs[r]] = host[base : base + hist * d].view(hist, d)[rows[r]].to(dev)
    saved = [t.clone() for t in (hot.map, hot.rows, hot.lru, hot.stamp)]
    sel = sel.to(dev)
    slots = torch.arange(nreq, device=dev)
    plan = ChunkPlan.build([hist - 1] * nreq, [hist] * nreq, RING, dev)
    bases = host_base
    host_base = host_base.to(dev)
    cu = torch.arange(nreq + 1, device=dev)
    ws = Workspace(nreq, k, nreq, b, dev)
    clock = torch.tensor(10_000, dtype=torch.int64, device=dev)
    state: dict = {}

    def restore() -> None:
        for t, s in zip((hot.map, hot.rows, hot.lru, hot.stamp), saved, strict=True):
            t.copy_(s)

    def resolve_only() -> None:
        state["locs"] = launch_resolve(sel, cu, slots, plan, geo, hot, clock, host_base, d, ws)

    def copy_only() -> None:
        launch_copy(ws, pool, host, order, sel.numel())

    def both() -> None:
        resolve_only()
        copy_only()

    restore()
    both()
    torch.cuda.synchronize()
    locs = state["locs"]
    copied = int(ws.counters[3])
    assert copied == nreq * n_miss, (copied, nreq * n_miss)
    # Correctness: what attention would read equals the host backup, row for row.
    check = torch.randint(0, nreq, (8,), generator=g)
    for r in check.tolist():
        got = pool[locs[r]].cpu()
        base = int(bases[r])
        want = host[base : base + hist * d].view(hist, d)[sel[r].cpu()]
        # as bytes: random row bits hold NaNs, which no comparison of values finds equal
        same = torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
        assert same, "resolved rows differ from the host backup"
    flat = locs.flatten()

    def gather() -> None:
        torch.index_select(pool, 0, flat)

    # name -> (the work, what runs before each timed run: a restored hot cache for a resolve;
    # the copy reads the queue every resolve from that state leaves, the gather ``flat``)
    work = {"resolve": (resolve_only, restore), "copy": (copy_only, None),
            "total": (both, restore), "gather": (gather, None)}  # fmt: skip
    eager = in_lockstep(work, iters)
    # The same work replayed from CUDA graphs: GPU time without Python launch overhead, as an
    # engine that captures its decode step sees it.
    graphs = {}
    for name, (fn, _) in work.items():
        restore()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs[name] = graph
    replayed = in_lockstep({n: (graphs[n].replay, setup) for n, (_, setup) in work.items()}, iters)
    t_resolve, t_copy, t_total, t_gather = (eager[n] for n in work)
    g_resolve, g_copy, g_total, g_gather = (replayed[n] for n in work)
    row_bytes = d * host.element_size()
    med = statistics.median
    extra = {}
    if variants:
        # a compact window of as many rows: side by side from the first region's row 0
        c_src = int(bases[0]) + torch.arange(copied, dtype=torch.int64, device=dev) * d
        c_dst = ws.plan_dst[:copied].clone()
        c_count = torch.tensor([copied], dtype=torch.int64, device=dev)
        extra["variants"] = _variants(
            lambda: resolve_launcher(sel, cu, slots, plan, geo, hot, clock, host_base, d, ws),
            lambda launch: launch_copy(ws, pool, host, order, sel.numel(), launch),
            (lambda: copy_queued(pool, c_src, c_dst, c_count, host, copied)) if copied else None,
            gather,
            restore,
            iters,
        )
    return {
        **extra,
        "batch": nreq,
        "miss_rate": miss_rate,
        "misses_per_step": copied,
        "resolve_ms": med(t_resolve),
        "copy_ms": med(t_copy),
        "total_ms": med(t_total),
        "plain_gather_ms": med(t_gather),
        "graph_resolve_ms": med(g_resolve),
        "graph_copy_ms": med(g_copy),
        "graph_total_ms": med(g_total),
        "graph_plain_gather_ms": med(g_gather),
        "timing": f"lockstep, {iters} rounds",
        "total_over_gather": med(g_total) / med(g_gather),
        "resolve_over_gather": med(g_resolve) / med(g_gather),
        "copy_GBps": copied * row_bytes / med(g_copy) / 1e6 if copied else None,
        "host_recovery_GBps": copied * row_bytes / med(g_total) / 1e6 if copied else None,
    }


def in_lockstep(
    work: dict[str, tuple[Callable[[], object], Callable[[], None] | None]], rounds: int
) -> dict[str, list[float]]:
    """Device ms of each ``work`` item (name -> (the work, what runs before it, untimed)),
    one run of each per round, the first rotating, ``rounds`` rounds; each timed run after
    one untimed run of the same (``cuda_ms``)."""
    timers = {name: functools.partial(_one_ms, fn, setup) for name, (fn, setup) in work.items()}
    return alternate(timers, rounds)


def _one_ms(fn: Callable[[], object], setup: Callable[[], None] | None) -> float:
    return cuda_ms(fn, 1, setup)[0]


def _variants(
    resolver: Callable[[], Callable[..., torch.Tensor]],
    copy: Callable[[CopyLaunch], None],
    compact: Callable[[], None] | None,
    gather: Callable[[], None],
    restore: Callable[[], None],
    iters: int,
) -> dict[str, float]:
    """Median ms (CUDA graphs) of one case's variants: the whole resolve in each launch shape
    of ``RESOLVE_VARIANTS`` and the plain ``gather`` they are compared with; where rows miss
    (``compact`` given), the resolve's two phases, the copy in each launch shape of
    ``COPY_VARIANTS``, the copy on a side stream beside the resolve's second phase
    (``split_total``), and the ``compact`` window copy; every variant once per round, three
    rounds, so drift hits them alike."""
    side = torch.cuda.Stream()

    def split() -> None:
        launch = resolver()
        launch(1)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            copy(CopyLaunch())
        launch(2)
        torch.cuda.current_stream().wait_stream(side)

    def queue() -> None:  # the state the copies replay: a restored hot cache, the queue
        restore()
        resolver()(1)

    # variant -> what runs before each timed replay: a restored hot cache for a whole
    # resolve, the queue for the second phase; the copies replay the queue left before them
    fns = {
        f"resolve_{name}": (lambda shape=shape: resolver()(0, shape), restore)
        for name, shape in RESOLVE_VARIANTS.items()
    }
    fns["plain_gather"] = (gather, None)
    if compact is not None:
        fns |= {
            "resolve_phase1": (lambda: resolver()(1), restore),
            "resolve_phase2": (lambda: resolver()(2), queue),
            "split_total": (split, restore),
            "compact_copy": (compact, None),
        }
        for name, launch in COPY_VARIANTS.items():
            fns[f"copy_{name}"] = (functools.partial(copy, launch), None)
    graphs = {}
    for name, (fn, _) in fns.items():
        queue()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs[name] = graph
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(3):
        for name, graph in graphs.items():
            queue()
            times[name] += cuda_ms(graph.replay, max(1, iters // 3), fns[name][1])
    res = {name: statistics.median(v) for name, v in times.items()}
    for name in ("copy_default", "resolve_4warps"):
        if name in res:
            res[f"{name}_spread"] = (max(times[name]) - min(times[name])) / res[name]
    return res


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    ap.add_argument("--miss-rates", default="0,0.0005,0.01,0.1")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--hot-cache-rows", type=int, default=4096)
    ap.add_argument("--row-bytes", type=int, default=576)
    ap.add_argument("--history", type=int, default=32768, help="rows per request")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="docs/results/resolver.json")
    ap.add_argument("--plot", default=None, help="PNG path")
    ap.add_argument(
        "--variants", action="store_true",
        help="also the resolve's and the copy's launch shapes side by side (run_case)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    batches = [int(x) for x in args.batches.split(",")]
    rates = [float(x) for x in args.miss_rates.split(",")]
    d = args.row_bytes // 2
    nbytes = max(batches) * args.history * args.row_bytes
    host_u8, kind, keep = host_arena(nbytes)
    host = host_u8[: nbytes - nbytes % 2].view(torch.bfloat16)
    # Random bytes, generated on the device and copied down in chunks.
    chunk = 1 << 28
    for off in range(0, host.numel(), chunk):
        n = min(chunk, host.numel() - off)
        host[off : off + n].copy_(torch.randn(n, device="cuda", dtype=torch.bfloat16).cpu())
    ceiling = bulk_ceiling(host_u8, min(nbytes, 1 << 30))
    print(f"host arena: {kind}, {nbytes / 2**30:.2f} GiB; bulk host->device {ceiling:.1f} GB/s")
    g = torch.Generator().manual_seed(0)
    results = []
    cases = [(b, r) for b in batches for r in rates]
    for nreq, rate in progress(cases, "resolver"):
        res = run_case(
            nreq,
            rate,
            args.k,
            args.hot_cache_rows,
            args.history,
            d,
            host,
            args.iters,
            g,
            variants=args.variants,
        )
        if res["host_recovery_GBps"]:
            res["recovery_over_bulk"] = res["host_recovery_GBps"] / ceiling
        results.append(res)
    print("\nms per resolve, in lockstep with the plain gather; graph = replayed from a CUDA "
          "graph (GPU time), eager = launched from Python; /gather = g.total / g.gather"
          )  # fmt: skip
    print(f"{'batch':>5} {'miss%':>6} {'misses':>7} {'g.resolve':>9} {'g.copy':>7} "
          f"{'g.total':>7} {'g.gather':>8} {'/gather':>7} {'eager':>7} {'copyGB/s':>9} "
          f"{'rec.%bulk':>9}")  # fmt: skip
    for r in results:
        gbps = r["host_recovery_GBps"]
        print(f"{r['batch']:>5} {100 * r['miss_rate']:>6.2f} {r['misses_per_step']:>7} "
              f"{r['graph_resolve_ms']:>9.3f} {r['graph_copy_ms']:>7.3f} "
              f"{r['graph_total_ms']:>7.3f} {r['graph_plain_gather_ms']:>8.3f} "
              f"{r['total_over_gather']:>7.2f} {r['total_ms']:>7.3f} {r['copy_GBps'] or 0:>9.1f} "
              f"{(100 * gbps / ceiling) if gbps else 0:>9.1f}")  # fmt: skip
    if args.variants:
        print_resolve_variants(results)
    out = {
        "benchmark": "resolver",
        "machine": torch.cuda.get_device_name(),
        "host_arena": kind,
        "bulk_host_to_device_GBps": ceiling,
        "k": args.k,
        "hot_cache_rows": args.hot_cache_rows,
        "row_bytes": args.row_bytes,
        "history_rows": args.history,
        "results": results,
    }
    try:
        print(f"wrote {write_result(out, args.out)}")
        if args.plot:
            plot(out, args.plot)
    finally:
        if keep is not None:
            arena, mapping = keep
            mapping.close()
            arena.close(remove=True)
    return 0


def print_resolve_variants(results: list[dict]) -> None:
    """The resolve's launch shapes beside the plain gather of the same rounds, ms from CUDA
    graphs."""
    names = [f"resolve_{n}" for n in RESOLVE_VARIANTS]
    print("\nresolve by launch shape, ms (CUDA graphs), and over the plain gather")
    print(f"{'batch':>5} {'miss%':>6} " + " ".join(f"{n[8:]:>14}" for n in names)
          + f" {'gather':>7}")  # fmt: skip
    for r in results:
        v = r["variants"]
        gather = v["plain_gather"]
        cells = " ".join(f"{v[n]:7.4f} {v[n] / gather:5.2f}x" for n in names)
        print(f"{r['batch']:>5} {100 * r['miss_rate']:>6.2f} {cells} {gather:>7.4f}")


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    rates = sorted({r["miss_rate"] for r in out["results"]})
    for rate in rates:
        rs = [r for r in out["results"] if r["miss_rate"] == rate]
        a1.plot([r["batch"] for r in rs], [r["graph_total_ms"] for r in rs], "o-",
                label=f"{100 * rate:g}% miss")  # fmt: skip
    rs0 = [r for r in out["results"] if r["miss_rate"] == 0]
    a1.plot([r["batch"] for r in rs0], [r["graph_plain_gather_ms"] for r in rs0], "k--",
            label="plain device gather")  # fmt: skip
    a1.set(xscale="log", yscale="log", xlabel="batch (requests)", ylabel="ms per resolve",
           title=f"resolver, k={out['k']}, B={out['hot_cache_rows']}")  # fmt: skip
    a1.legend(fontsize=8)
    rs = [r for r in out["results"] if r["misses_per_step"]]
    a2.scatter(
        [r["misses_per_step"] for r in rs], [r["copy_GBps"] for r in rs], label="copy kernel"
    )
    a2.scatter([r["misses_per_step"] for r in rs], [r["host_recovery_GBps"] for r in rs],
               label="resolve + copy")  # fmt: skip
    a2.axhline(out["bulk_host_to_device_GBps"], color="k", ls="--", label="bulk pinned copy")
    a2.axhline(0.8 * out["bulk_host_to_device_GBps"], color="gray", ls=":", label="80% of bulk")
    a2.set(xscale="log", xlabel="rows missed per step", ylabel="GB/s",
           title=f"host recovery ({out['machine']})")  # fmt: skip
    a2.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)
