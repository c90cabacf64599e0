"""``python -m bench serving``: flags, the matrix, the output JSON (fields in the package's
docstring)."""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.core.output import write_result

from . import config as C
from .report import plot, table
from .run import Bench, Deadline, engine_level, http_level
from .setup import (
    default_drafter_dir,
    drafter_source,
    load_target,
    prepare_prefixes,
    size_kv,
)

# The output's top-level fields and each run's metric fields (documented in the package).
TOP_FIELDS = (
    "benchmark", "level", "machine", "elapsed_s", "model", "matrix", "drafter_dir",
    "spec_width", "load", "prompts", "sizing", "engines", "runs", "skipped", "unavailable",
    "definitions", "provenance",
)  # fmt: skip
RUN_FIELDS = (
    "window_s", "requests", "output_tokens_per_s", "requests_per_s", "sessions_admitted",
    "ttft_s", "alloc_wait_s", "prefill_s", "alloc_wait_share_of_ttft", "tpot_s", "e2e_s",
    "census", "host_read_bytes_per_token", "reclaim", "reclaim_latency_s", "acceptance_length",
    "spec",
)  # fmt: skip
UNAVAILABLE = {
    "backup (device->host) bytes": "the engine counts no backup traffic; reclaim.pages x page "
    "bytes bounds only the reclaims' backups (write-through of decode rows is not counted)",
    "per-request allocation wait (http level)": "the gateway exports a histogram only: the "
    "HTTP level reports its mean over the window, and prefill_s = mean TTFT - that mean",
    "decode step costs (http level)": "the worker exports no per-step timing",
    "census, reclaim (resident)": "resident serving resolves nothing and reclaims nothing",
}
DEFINITIONS = {
    "alloc_wait_s": "engine level: arrival (add_request) to the engine's first admission (a "
    "slot and KV room); http level: the gateway's admission wait (capacity ledger)",
    "prefill_s": "TTFT - allocation wait: the prefill pass and waiting behind other prefills "
    "for the step's prefill budget",
    "reclaim_latency_s": "ResidencyStats.reclaim_latency: a reclaim's start to the request's "
    "last page freed (backup and earlier readers done)",
    "host_read_bytes_per_token": "census rows_copied (distinct rows read from host by the "
    "resolver, decode selections) x row bytes / output tokens in the window",
    "sessions_admitted": "engine level: the most requests running in one step; http level: a "
    "lower bound (sampled running gauge, streams between first and last token)",
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    strs = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument(
        "--model", default="models/glm-dsa-mini", help="model dir, preset, or bench-glm"
    )
    ap.add_argument(
        "--drafter-dir",
        help="dir with dflash/ dspark/ dflash2/, or 'random' "
        "(default: MODEL/drafters; presets: bench/drafters/PRESET or random)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--http", action="store_true", help="through the real stack over HTTP")
    ap.add_argument("--modes", type=strs, default=list(C.MODES))
    ap.add_argument("--drafters", type=strs, default=list(C.DRAFTERS), help="off = no speculation")
    ap.add_argument("--schedules", type=strs, default=list(C.SCHEDULES))
    ap.add_argument("--concurrency", type=ints, default=list(C.CONCURRENCY))
    ap.add_argument("--spec-modes", type=strs, default=list(C.SPEC_MODES))
    ap.add_argument("--spec-concurrency", type=ints, default=list(C.SPEC_CONCURRENCY))
    ap.add_argument("--full", action="store_true", help="every mode x drafter x schedule x C")
    ap.add_argument("--input-lens", type=ints, default=[8192])
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 greedy; 1 sampling")
    ap.add_argument("--requests-per-client", type=int)
    ap.add_argument("--duration-s", type=float, help="measured window per run (default 5)")
    ap.add_argument("--warmup-s", type=float, default=2.0, help="before the window (duration)")
    ap.add_argument("--time-limit-s", type=float, default=420.0, help="skip runs past this")
    ap.add_argument("--prefixes", type=int, default=64, help="prepared prompts per input length")
    ap.add_argument("--prompts", default="text", help="text | random | a corpus file/dir")
    ap.add_argument("--resident-sessions", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, help="slots (default: what the budget holds)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--hot-cache-rows", type=int, help="B (default 2k)")
    ap.add_argument("--spec-width", type=int, default=8, help="K_max")
    ap.add_argument("--durable-sessions", action=argparse.BooleanOptionalAction,
                    help="hierarchy modes back up what resuming a session needs (default: on, "
                    "as a worker attached to a host store)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=8, help="bench-glm only")
    ap.add_argument("--k", type=int, default=512, help="bench-glm only")
    ap.add_argument("--out", default="docs/results/serving.json")
    ap.add_argument("--plot", metavar="PREFIX")
    ap.add_argument("--table", metavar="FILE.md")
    ap.add_argument("--log-dir", default="/tmp/dhisparse-bench", help="stack logs (--http)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--cpu-threads", type=int, default=1, help="torch threads on a CPU device")
    ap.add_argument(
        "--lockstep", action=argparse.BooleanOptionalAction, default=True,
        help="engine level: the runs of one input length and C step in turn, each on its own "
        "clock (bench/core/lockstep.py); --no-lockstep runs one engine after the other",
    )  # fmt: skip


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.machine()} CPU ({platform.processor() or platform.node()})"


def run(args: argparse.Namespace) -> int:
    if args.requests_per_client is None and args.duration_s is None:
        args.duration_s = 5.0
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    threads = torch.get_num_threads()
    if not args.device.startswith("cuda"):  # tiny models: more threads only contend
        torch.set_num_threads(args.cpu_threads)
    try:
        return run_matrix(args)
    finally:
        torch.set_num_threads(threads)


def run_matrix(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    load = C.Load(output_len=args.output_len, temperature=args.temperature,
                  requests_per_client=args.requests_per_client,
                  duration_s=None if args.requests_per_client else args.duration_s,
                  warmup_s=args.warmup_s if not args.requests_per_client else 0.0)  # fmt: skip
    runs = C.build_matrix(
        args.modes, args.drafters, args.schedules, args.concurrency, args.input_lens,
        full=args.full, spec_modes=args.spec_modes, spec_concurrency=args.spec_concurrency,
    )  # fmt: skip
    per_run = (load.warmup_s + load.duration_s + 0.5) if load.duration_s else 0.0
    engines = len({r.key for r in runs})
    print(f"{len(runs)} runs on {engines} engines: about {len(runs) * per_run:.0f} s of runs "
          f"+ a few s per engine (time limit {args.time_limit_s:.0f} s)", flush=True)  # fmt: skip
    drafter_dir = args.drafter_dir or default_drafter_dir(args.model)
    try:  # fail now, not after the baselines
        target = load_target(args.model, args.device, args.dtype, args.layers, args.k)
        for kind in {r.key.drafter for r in runs} - {"off"}:
            drafter_source(kind, drafter_dir)
    except FileNotFoundError as e:
        raise SystemExit(f"python -m bench serving: {e}") from None
    sizing = size_kv(target, args.input_lens, args.output_len, args.spec_width,
                     args.resident_sessions, args.page_size, args.hot_cache_rows,
                     max(args.concurrency + args.spec_concurrency), args.max_num_seqs)  # fmt: skip
    if sizing.max_model_len > target.model.cfg.max_position:
        raise SystemExit(f"inputs of {max(args.input_lens)} tokens + output exceed the model's "
                         f"max_position {target.model.cfg.max_position}")  # fmt: skip
    prefixes = prepare_prefixes(target, args.input_lens, args.prefixes, args.prompts)
    out: dict = {
        "benchmark": "serving", "level": "http" if args.http else "engine",
        "machine": machine(args.device), "elapsed_s": 0.0,
        "model": {"spec": args.model, "name": target.name, "dtype": args.dtype,
                  "parameters": sum(p.numel() for p in target.model.parameters()),
                  "config": target.model.cfg.to_dict()},
        "matrix": {"modes": args.modes, "drafters": args.drafters, "schedules": args.schedules,
                   "concurrency": args.concurrency, "spec_modes": args.spec_modes,
                   "spec_concurrency": args.spec_concurrency, "full": args.full,
                   "time_limit_s": args.time_limit_s,
                   "lockstep": args.lockstep and not args.http},
        "drafter_dir": drafter_dir, "spec_width": args.spec_width, "load": asdict(load),
        "prompts": {"source": args.prompts, "prefixes": args.prefixes,
                    "input_lens": args.input_lens},
        "sizing": sizing.as_dict(), "engines": [], "runs": [], "skipped": [],
        "unavailable": UNAVAILABLE, "definitions": DEFINITIONS,
    }  # fmt: skip
    bar = None if args.quiet else _bar(len(runs))

    def on_run(run: C.RunSpec, metrics: dict | None, skipped: str | None) -> None:
        entry = {"name": run.name, "engine": run.key.name, "run": run.as_dict()}
        if metrics is None:
            out["skipped"].append({**entry, "reason": skipped})
        else:
            out["runs"].append({**entry, "metrics": metrics})
            if bar is None:
                print(
                    json.dumps({"run": run.name, "tok/s": round(metrics["output_tokens_per_s"], 1)})
                )
        out["elapsed_s"] = time.monotonic() - t0
        _write(out, args)  # after every run: a run cut short still leaves its data
        if bar is not None:
            bar.set_postfix_str(run.name)
            bar.update(1)

    deadline = Deadline(args.time_limit_s - (time.monotonic() - t0), per_run)
    bench = Bench(target, prefixes, sizing, load, args.device, drafter_dir, args.spec_width,
                  args.durable_sessions)  # fmt: skip
    if args.http:
        out["engines"] = http_level(bench, runs, deadline, on_run, Path(args.log_dir))
    else:
        out["engines"] = engine_level(bench, runs, deadline, on_run, args.lockstep)
        order = {r.name: i for i, r in enumerate(runs)}  # the matrix's order, not lockstep's
        out["runs"].sort(key=lambda e: order[e["name"]])
    if bar is not None:
        bar.close()
    out["elapsed_s"] = time.monotonic() - t0
    _write(out, args)
    md = table(out)
    print(md)
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(md)
    if args.plot:
        for p in plot(out, args.plot):
            print(f"wrote {p}")
    print(f"wrote {args.out} ({out['elapsed_s']:.0f} s)")
    return 0


def _bar(n: int):
    from tqdm import tqdm

    return tqdm(total=n, desc="runs", unit="run")


def _write(out: dict, args: argparse.Namespace) -> None:
    corpus = [args.prompts] if Path(args.prompts).is_file() else []  # not text / random
    write_result(out, args.out, data=corpus)
