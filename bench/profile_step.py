"""Where a decode step's time goes: torch.profiler over a few decode steps of the capacity
benchmark's model, per mode and concurrency, printing the top operators by host (CPU) time and
by device time, and the step's wall time with and without the profiler.

    python -m bench profile-step --modes resident,hisparse,adaptive --concurrency 4,32
    python -m bench profile-step --model models/glm-dsa-mini --context 512 --modes adaptive \
        --drafter models/glm-dsa-mini/drafters/dflash2 --spec-width 4 --concurrency 1,16

With ``--model`` a trained checkpoint is served instead of the random capacity model (and with
``--drafter`` a step is a speculative round; ``--scaled v32-scaled --drafter mtp``: the
real-dimension model with its MTP layer, each step a round of a random MTP layer's proposals,
whose kernels cost what any proposals' do; ``--selections replay``: every layer, the MTP
layer's too, attends the shipped model's recorded selections, so that the hot cache and host
reads are a trained model's, not a random indexer's). ``--cprofile`` adds the Python functions that
take the host's time (a launch-bound step spends it there). It prints what it measures and
returns, per mode, concurrency and graph choice, the step's wall time, the graphs' counters and
the top operators by device and by host time per step (``--out``: a result JSON).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch

from bench.core.model import BENCH_GLM, bench_model_config
from bench.core.steps import steady_engine
from bench.load.replay import TRACE, install, load_traces, replay_for
from dhisparse.family.scaled import SCALED, V4_SCALED
from dhisparse.tokenizer import ByteTokenizer
from services.worker.engine.engine import Engine
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.model.weight_format import WeightFormat
from services.worker.speculative.config import SpeculationConfig
from services.worker.weights.model_io import build_model


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--modes", default="resident,hisparse,adaptive")
    ap.add_argument("--concurrency", default="4,32")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--pool-gib", type=float, default=8.0)
    ap.add_argument("--host-gib", type=float, default=16.0, help="the hierarchy's host arena")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: bench-glm)")
    ap.add_argument(
        "--scaled", default=None, choices=sorted(SCALED | V4_SCALED),
        help="a real-dimension model built in place with FP8 weights (bench scaled's)",
    )  # fmt: skip
    ap.add_argument(
        "--drafter", default=None,
        help="a drafter directory, or 'mtp' (the checkpoint's MTP layer; with --scaled, built "
        "in place with the model): profile spec rounds",
    )  # fmt: skip
    ap.add_argument("--spec-width", type=int, default=4)
    ap.add_argument(
        "--selections", default="own", choices=("own", "replay"),
        help="replay: decode steps and rounds attend the shipped model's recorded selections "
        "(bench load's replay), as bench scaled --selections replay; own: the model's",
    )  # fmt: skip
    ap.add_argument("--trace", default=str(TRACE), help="the traces --selections replay reads")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument(
        "--graphs", default="on", help="on | off | on,off: decode passes as CUDA graphs or eager"
    )
    ap.add_argument("--durable", action="store_true", help="durable sessions (as serving)")
    ap.add_argument(
        "--phases", action="store_true",
        help="also split the step's host time into maintain / schedule / forward / commit / "
        "the rest (unsynchronised, so a launch-bound step's wall time), and list every call "
        "that waits for the device in one step",
    )  # fmt: skip
    ap.add_argument(
        "--series", type=int, default=0,
        help="also time this many steps one by one right after the prefills (synchronised), "
        "with the time in kv.payload.residency.maintain(): the transient after admission",
    )  # fmt: skip


def _top(ka, key: str, rows: int, steps: int) -> list[dict]:
    """The ``rows`` operators of most ``key`` time (self, µs): name, calls and µs per step."""
    ops = sorted(ka, key=lambda e: -getattr(e, key))[:rows]
    return [{"name": e.key, "calls": e.count / steps, "us": getattr(e, key) / steps} for e in ops]


def run(args: argparse.Namespace) -> dict:
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:  # CUPTI attached before any graph is captured: a replayed graph's kernels reported
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.ones(1, device="cuda").add_(1)
            torch.cuda.synchronize()
    model = None
    if args.scaled is not None:
        model = build_model((SCALED | V4_SCALED)[args.scaled], seed=0, device=args.device, dtype=dtype,
                            weights=WeightFormat(fp8=True), in_place=True,
                            mtp=args.drafter == "mtp")  # fmt: skip
    elif args.model is None:
        model = build_model(bench_model_config(8, 512), seed=0, device=args.device, dtype=dtype)
    replay = None
    if args.selections == "replay":
        if model is None:
            raise ValueError("--selections replay needs a model built here (not --model)")
        replay = replay_for(model, args.context, load_traces(Path(args.trace)))
    g = torch.Generator().manual_seed(0)
    cs = [int(c) for c in args.concurrency.split(",")]
    prompts = [torch.randint(0, 256, (args.context,), generator=g).tolist() for _ in range(max(cs))]
    runs = [
        (mode, c, choice == "on")
        for mode in args.modes.split(",")
        for c in cs
        for choice in args.graphs.split(",")
    ]
    results = []
    for mode, c, graphs in runs:
        eng = steady_engine(
            mode, prompts[:c], args.context, args.pool_gib, args.scaled or args.model or BENCH_GLM,
            model, ByteTokenizer() if model is not None else None, device=args.device,
            durable_sessions=args.durable, graphs=GraphConfig(graphs),
            **({"host_arena_mib": args.host_gib * 1024} if mode != "resident" else {}),
            built=None if replay is None else (lambda e: install(e, replay)),
            **({"hot_cache_rows": 2 * model.cfg.index_topk} if args.scaled else {}),
            speculation=SpeculationConfig(args.drafter, args.spec_width, "fixed"),
            # room for every round profiled: no request ends (nor the batch shrinks) meanwhile
            max_model_len=args.context + (4096 if args.drafter else 256),
        )  # fmt: skip
        if args.series:
            print_series(eng, args.series, cuda, f"{mode} C={c}")
        for _ in range(8):  # warm: every kernel compiled, hot caches filled
            eng.step()
        if args.phases:
            print_phases(eng, args.steps, cuda, f"{mode} C={c} graphs={graphs}")
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        before = census(eng)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        sync()
        plain = (time.perf_counter() - t0) / args.steps
        rows = {k: (v - before[k]) / args.steps for k, v in census(eng).items()}
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.steps):
                eng.step()
            sync()
        what = f"spec K={args.spec_width}" if args.drafter else "decode"
        what += " graphs" if eng.passes.graphs is not None else " eager"
        print(f"\n===== {mode} C={c} {what}: {plain * 1e3:.2f} ms/step")
        for kind, gs in (
            ("pass", eng.passes.graphs),
            ("draft", getattr(eng.speculator, "graphs", None)),
        ):
            if gs is not None:
                print(f"===== {kind} graphs: {gs.captures} captured, {gs.replays} replays, "
                      f"{gs.eager} eager")  # fmt: skip
        ka = prof.key_averages()
        counters = {
            kind: {"captures": gs.captures, "replays": gs.replays, "eager": gs.eager}
            for kind, gs in (("pass", eng.passes.graphs),
                             ("draft", getattr(eng.speculator, "graphs", None)))
            if gs is not None
        }  # fmt: skip
        results.append({
            "mode": mode, "concurrency": c, "graphs": graphs, "what": what,
            "ms_per_step": plain * 1e3, "graph_counters": counters, "rows_per_step": rows,
            "top_device": _top(ka, "self_device_time_total", args.rows, args.steps) if cuda else [],
            "top_host": _top(ka, "self_cpu_time_total", args.rows, args.steps),
        })  # fmt: skip
        print(
            ka.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60)
        )
        if cuda:
            print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
        if args.cprofile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.steps):
                eng.step()
            sync()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        eng.close()
        del eng
        if cuda:
            torch.cuda.empty_cache()
    return {
        "bench": "profile-step", "device": torch.cuda.get_device_name() if cuda else "cpu",
        "context": args.context, "steps": args.steps, "drafter": args.drafter,
        "spec_width": args.spec_width if args.drafter else None,
        "selections": args.selections, "runs": results,
    }  # fmt: skip


def census(eng: Engine) -> dict[str, int]:
    """The rows the hierarchy resolved so far, by where from (direct, hot, host; none in
    resident mode)."""
    c = getattr(eng.kv.payload, "census", None)
    return {} if c is None else {k: getattr(c, k) for k in ("direct", "hot", "host")}


def print_series(eng: Engine, steps: int, cuda: bool, label: str) -> None:
    """Per-step wall time (ms, synchronised) and the part spent in ``kv.payload.residency.maintain()``."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spent = [0.0]
    maintain = eng.kv.payload.residency.maintain

    def timed() -> None:
        t = time.perf_counter()
        maintain()
        spent[0] += time.perf_counter() - t

    eng.kv.payload.residency.maintain = timed  # type: ignore[method-assign]
    walls, maint = [], []
    for _ in range(steps):
        sync()
        spent[0] = 0.0
        t0 = time.perf_counter()
        eng.step()
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
        maint.append(spent[0] * 1e3)
    eng.kv.payload.residency.maintain = maintain  # type: ignore[method-assign]
    print(f"\n===== series {label}: step ms " + " ".join(f"{w:.1f}" for w in walls))
    print(f"===== series {label}: maintain ms " + " ".join(f"{m:.1f}" for m in maint))
    st = eng.kv.payload.residency.stats
    if st is not None:
        print(
            f"===== series {label}: reclaims {st.reclaim_events} repopulated {st.repopulated_pages}"
        )
    census = eng.kv.payload.census
    if census is not None:
        print(f"===== series {label}: census {census}")


def print_phases(eng: Engine, steps: int, cuda: bool, label: str) -> None:
    """Mean host milliseconds per step in each phase, then the calls that synchronise."""
    spent: dict[str, float] = {}
    swapped = []
    # the first four split the step; begin and replay are parts of forward (their host time)
    for name, owner, attr in (
        ("maintain", eng.kv, "maintain"),
        ("schedule", eng.scheduler, "schedule"),
        ("forward", eng.passes.graphs or eng.model, "logits" if eng.passes.graphs else "forward"),
        ("commit", eng.kv, "commit"),
        ("begin", eng.kv, "begin"),
        ("replay", torch.cuda.CUDAGraph, "replay"),
    ):
        fn = getattr(owner, attr)

        def timed(*a, _fn=fn, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t

        setattr(owner, attr, timed)
        swapped.append((owner, attr, fn))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    total = (time.perf_counter() - t0) / steps * 1e3
    parts = {k: v / steps * 1e3 for k, v in spent.items()}
    inner = {k: parts.pop(k) for k in ("begin", "replay") if k in parts}
    rest = total - sum(parts.values())
    print(
        f"\n===== phases {label}: step {total:.2f} ms = "
        + " + ".join(f"{k} {v:.2f}" for k, v in parts.items())
        + f" + rest {rest:.2f}"
        + "".join(f"; forward's {k} {v:.2f}" for k, v in inner.items())
    )
    for owner, attr, fn in swapped:
        setattr(owner, attr, fn)
    if not cuda:
        return
    import traceback
    import warnings

    root = str(Path(__file__).resolve().parents[1])
    counts: dict[str, int] = {}

    def hook(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(root)]
        key = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-1:-4:-1])
        counts[key] = counts.get(key, 0) + 1

    old = warnings.showwarning
    warnings.showwarning = hook
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    print(f"===== syncs {label}: {sum(counts.values())} in one step")
    for key, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d}  {key}")
