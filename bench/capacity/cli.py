"""Capacity and throughput of resident / hisparse / adaptive serving vs concurrency (issue 5).

    python -m bench capacity --out docs/results/capacity.json --plot docs/results/capacity.png

One run, the same model and requests for every mode; at each concurrency the modes' engines
are stepped in lockstep (``bench/core/lockstep.py``), so the host's slow phases fall on all of
them alike, and each mode's times count only its own steps. The KV budget for sessions is sized so
resident serving holds ``--resident-sessions`` sessions of the context; each hierarchy mode gets
that same budget plus its own fixed allocations (prefill scratch, hot-cache metadata), which are
reported. At each concurrency C, C requests with C distinct prompts of ``--context`` tokens
arrive at once and each decodes ``--decode-tokens`` tokens greedily (closed loop); requests that
do not fit wait for admission (allocation wait). Reported per mode and C: sessions admitted at
once, decode throughput (tokens of decode steps / their time), end-to-end output tokens/s,
allocation wait, resolver census and host bytes read per decode token.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from bench.core.model import bench_model_config
from bench.core.output import write_result
from bench.core.plots import pyplot, save
from services.worker.graphs.cuda_graph import CAPTURE_POLICIES
from services.worker.kv.config import bytes_per_token
from services.worker.weights.model_io import build_model

from .sweep import MODES, Setup, run_modes


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--context", type=int, default=16384)
    # 256: decode steps of a few ms (CUDA graphs) need that many to outweigh each C's prefills
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,48")
    ap.add_argument("--resident-sessions", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--hot-cache-rows", type=int, default=1024)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--host-gib", type=float, default=16.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--probe-sessions", type=int, default=48, help="offered in the capacity probe")
    ap.add_argument("--probe-stable", type=int, default=6)
    ap.add_argument("--out", default="docs/results/capacity.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs of decode passes")
    ap.add_argument("--graph-capture", default="second", choices=CAPTURE_POLICIES)
    ap.add_argument(
        "--overlap-refills", action="store_true",
        help="adaptive: refill copies on a side stream beside the decode passes",
    )  # fmt: skip
    ap.add_argument(
        "--populate-payback", type=float, default=1.0,
        help="adaptive: refill a request's history only with >= this x V/k decode steps left",
    )  # fmt: skip
    ap.add_argument(
        "--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
        help="freeze the Python heap once the engines are built, as a worker does (on)",
    )  # fmt: skip
    ap.add_argument(
        "--trace", action="store_true",
        help="record each step (requests running, decode ms, kind, host rows read) in the rows",
    )  # fmt: skip


def setup(args: argparse.Namespace) -> Setup:
    """The benchmark's model, session KV budget and prompts (one per request of the largest
    concurrency)."""
    from dhisparse.tokenizer import ByteTokenizer

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    cfg = bench_model_config(args.layers, args.k)
    model = build_model(cfg, seed=0, device=args.device, dtype=getattr(torch, dtype))
    per_token = bytes_per_token(cfg, model.embed.weight.element_size(), payload=True)
    session_tokens = args.context + args.decode_tokens + 16
    budget = int(args.resident_sessions * session_tokens * per_token * 1.02)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 256, (args.context,), generator=g).tolist()
        for _ in range(max(args.concurrency))
    ]
    return Setup(cfg, model, ByteTokenizer(), dtype, per_token, budget, prompts)


def run(args: argparse.Namespace) -> int:
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    s = setup(args)
    results = run_modes(args.modes.split(","), args, s)
    summary = summarize(results, args)
    out = {
        "benchmark": "capacity",
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
        "model": s.cfg.to_dict(),
        "context": args.context,
        "decode_tokens": args.decode_tokens,
        "session_budget_bytes": s.budget,
        "resident_bytes_per_token": s.per_token,
        "hot_cache_rows": args.hot_cache_rows,
        "page": args.page,
        "modes": results,
        "summary": summary,
    }
    print(f"wrote {write_result(out, args.out)}")
    print(json.dumps(summary, indent=2))
    if args.plot:
        plot(out, args.plot)
    return 0


def summarize(results: list[dict], args) -> dict:
    """The issue's ratios, from the aggregate decode rate and (``*_median``) from the median
    per-step rate, which the host's slow phases do not move (``bench/core/steps.py``)."""
    by = {r["mode"]: {row["concurrency"]: row for row in r["rows"]} for r in results}
    out: dict = {}

    def ratios(a: str, b: str, cs) -> tuple[dict, dict]:
        agg, med = "decode_tokens_per_s", "decode_tokens_per_s_median"
        return (
            {c: by[a][c][agg] / by[b][c][agg] for c in cs},
            {c: by[a][c].get(med, 0.0) / max(by[b][c].get(med, 0.0), 1e-9) for c in cs},
        )

    if {"resident", "adaptive"} <= by.keys():
        fits = [c for c, row in by["resident"].items() if row["sessions_admitted"] >= c]
        (
            out["adaptive_vs_resident_where_resident_fits"],
            out["adaptive_vs_resident_where_resident_fits_median"],
        ) = ratios("adaptive", "resident", fits)
        cmax = max(args.concurrency)
        out["sessions_ratio_adaptive_over_resident_at_max_c"] = (
            by["adaptive"][cmax]["sessions_admitted"] / by["resident"][cmax]["sessions_admitted"]
        )
        cap = {r["mode"]: r["capacity"]["sessions"] for r in results}
        out["capacity_sessions"] = cap
        out["capacity_ratio_adaptive_over_resident"] = cap["adaptive"] / cap["resident"]
    if {"hisparse", "adaptive"} <= by.keys():
        out["adaptive_vs_hisparse"], out["adaptive_vs_hisparse_median"] = ratios(
            "adaptive", "hisparse", args.concurrency
        )
    return out


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for res in out["modes"]:
        cs = [r["concurrency"] for r in res["rows"]]
        axes[0].plot(cs, [r["output_tokens_per_s"] for r in res["rows"]], "o-", label=res["mode"])
        axes[1].plot(cs, [r["sessions_admitted"] for r in res["rows"]], "o-", label=res["mode"])
        axes[2].plot(cs, [r["alloc_wait_mean_s"] for r in res["rows"]], "o-", label=res["mode"])
    titles = (
        "output tokens/s (end to end)",
        "sessions admitted at once",
        "mean allocation wait (s)",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set(xscale="log", xlabel="concurrency", title=title)
        ax.legend(fontsize=8)
    fig.suptitle(f"{out['machine']}, context {out['context']}, {out['model']['name']}")
    fig.tight_layout()
    save(fig, path)
