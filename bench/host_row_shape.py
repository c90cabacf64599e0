"""Host recovery by the shape of a row in the arena (issue 27): the resolver's copy kernel
(``hierarchy/copy_triton.copy_queued``) reading a step's misses from a registered /dev/shm
arena, for MLA rows of 1,152 B (bf16) and 656 B (packed FP8), by the row's pitch in the arena
and the width of the lanes that read it, every shape once per round, side by side.

    python -m bench host-row-shape --out docs/results/host_row_shape.json

A GPU reads pinned host memory in 128-byte lines: a 1,152-B row (nine lines) read from a
line boundary moves only its own bytes, a 656-B row at a 656-B pitch starts anywhere in a line
and touches six or seven of them. The shapes:

- ``bf16``: 1,152-B pitch, 2-byte lanes (as stored); ``bf16-words``: 4-byte lanes;
  ``bf16-offset``: every region 16 B past a line boundary (rows straddle ten lines).
- ``fp8``: 656-B pitch, 1-byte lanes (as stored); ``fp8-words``: 4-byte lanes;
  ``fp8-pitch768`` / ``fp8-pitch768-words``: each row on its own 128-B line (768-B pitch);
  ``fp8-split``: the row's first 640 B at a 640-B pitch and its last 16 B in a second plane
  (two copies; no padding).

Each step reads ``--misses`` rows, as many from each of ``--requests`` regions (one request's
rows of one source, ``--history`` rows each), in random order within a request. Times are CUDA
graph replays (medians); host recovery is the rows' bytes over that time, against a bulk
pinned-to-device copy measured in the same run."""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import torch

from bench.core.clock import cuda_ms
from bench.resolver import bulk_ceiling, host_arena
from services.worker.hierarchy.copy_triton import copy_queued

LINE = 128  # bytes of a host read's cache line
GIB = 1 << 30


@dataclass(frozen=True)
class Shape:
    """A row of ``row`` bytes stored at ``pitch`` bytes per row from a region base ``offset``
    bytes past a line boundary, read in lanes of ``lane`` bytes; ``split``: the row's first
    ``split`` bytes at a ``split``-byte pitch, the rest in a second plane."""

    name: str
    row: int
    pitch: int
    lane: int
    offset: int = 0
    split: int = 0

    def planes(self) -> list[tuple[int, int]]:
        """(bytes of the row, pitch) per plane."""
        if self.split:
            return [(self.split, self.split), (self.row - self.split, self.row - self.split)]
        return [(self.row, self.pitch)]


SHAPES = {
    s.name: s
    for s in (
        Shape("bf16", 1152, 1152, 2),
        Shape("bf16-words", 1152, 1152, 4),
        Shape("bf16-offset", 1152, 1152, 2, offset=16),
        Shape("fp8", 656, 656, 1),
        Shape("fp8-words", 656, 656, 4),
        Shape("fp8-pitch768", 656, 768, 1),
        Shape("fp8-pitch768-words", 656, 768, 4),
        Shape("fp8-split", 656, 656, 4, split=640),
    )
}
LANES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.int32}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--history", type=int, default=8192, help="rows of a request's region")
    ap.add_argument("--misses", default="4096,13056,52480", help="rows read per step")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)


def _plane_bytes(rows: int, pitch: int) -> int:
    return -(-rows * pitch // 4096) * 4096


class Case:
    """One shape at one miss count: the copy of each plane captured in a CUDA graph."""

    def __init__(self, shape: Shape, host: torch.Tensor, requests: int, history: int,
                 picks: torch.Tensor) -> None:  # fmt: skip
        self.shape = shape
        dev = torch.device("cuda")
        lane = LANES[shape.lane]
        n = picks.numel()
        req = torch.arange(requests).repeat_interleave(n // requests)
        self.pool = torch.zeros(n, shape.row, dtype=torch.uint8, device=dev)
        self.copies = []
        base = 0
        col = 0
        for width, pitch in shape.planes():
            region = _plane_bytes(history, pitch)
            start = base + shape.offset + req * region + picks * pitch  # byte offsets
            base += requests * region
            typed = host[: host.numel() // shape.lane * shape.lane].view(lane)
            pool = self.pool[:, col : col + width].view(lane)
            col += width
            src = (start // shape.lane).to(dev)
            dst = torch.arange(n, dtype=torch.int64, device=dev)
            count = torch.tensor([n], dtype=torch.int64, device=dev)
            self.copies.append((pool, src, dst, count, typed, start))
        self.graph = torch.cuda.CUDAGraph()
        self.run()  # warm: compile before the capture
        with torch.cuda.graph(self.graph):
            self.run()

    def run(self) -> None:
        for pool, src, dst, count, typed, _ in self.copies:
            copy_queued(pool, src, dst, count, typed, src.numel())

    def check(self, host: torch.Tensor) -> None:
        """The pool holds each row's bytes, plane by plane."""
        col = 0
        self.pool.zero_()
        self.graph.replay()
        torch.cuda.synchronize()
        got = self.pool.cpu()
        for (_, _, _, _, _, start), (width, _) in zip(
            self.copies, self.shape.planes(), strict=True
        ):
            idx = start[:64].unsqueeze(1) + torch.arange(width)
            assert torch.equal(got[:64, col : col + width], host[idx]), self.shape.name
            col += width


def run(args: argparse.Namespace) -> dict | int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    shapes = [SHAPES[s] for s in args.shapes.split(",")]
    misses = [int(m) // args.requests * args.requests for m in args.misses.split(",")]
    need = max(
        sum(args.requests * _plane_bytes(args.history, p) for _, p in s.planes()) + LINE
        for s in shapes
    )
    host, kind, keep = host_arena(need)
    chunk = 1 << 28
    for off in range(0, need, chunk):  # random bytes, generated on the device
        n = min(chunk, need - off)
        host[off : off + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"))
    bulk = bulk_ceiling(host, min(need, GIB))
    print(f"host arena: {kind}, {need / GIB:.2f} GiB; bulk host->device {bulk:.1f} GB/s")
    g = torch.Generator().manual_seed(0)
    results = []
    for m in misses:
        per = m // args.requests
        picks = torch.stack([torch.randperm(args.history, generator=g)[:per]
                             for _ in range(args.requests)]).flatten()  # fmt: skip
        cases = [Case(s, host, args.requests, args.history, picks) for s in shapes]
        for c in cases:
            c.check(host)
        times: dict[str, list[float]] = {c.shape.name: [] for c in cases}
        for _ in range(args.rounds):
            for c in cases:
                times[c.shape.name] += cuda_ms(c.graph.replay, args.iters)
        for c in cases:
            ms = statistics.median(times[c.shape.name])
            spread = (max(times[c.shape.name]) - min(times[c.shape.name])) / ms
            gbps = m * c.shape.row / ms / 1e6
            results.append({
                "shape": c.shape.name, "row_bytes": c.shape.row, "pitch": c.shape.pitch,
                "lane_bytes": c.shape.lane, "offset": c.shape.offset, "split": c.shape.split,
                "misses": m, "ms": ms, "spread": spread, "GBps": gbps, "over_bulk": gbps / bulk,
            })  # fmt: skip
        del cases
    print(f"\n{'shape':>20} {'misses':>7} {'ms':>8} {'GB/s':>6} {'of bulk':>7} {'spread':>6}")
    for r in results:
        print(f"{r['shape']:>20} {r['misses']:>7} {r['ms']:>8.3f} {r['GBps']:>6.1f} "
              f"{r['over_bulk']:>7.2f} {r['spread']:>6.2f}")  # fmt: skip
    del keep
    return {
        "benchmark": "host-row-shape",
        "machine": torch.cuda.get_device_name(),
        "arena": kind,
        "bulk_host_to_device_GBps": bulk,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
    }
