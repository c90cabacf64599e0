"""Capacity and throughput of resident / hisparse / adaptive serving vs concurrency (issue 5).

    python bench/capacity.py --out docs/results/capacity.json --plot docs/results/capacity.png

One run, the same model and requests for every mode; at each concurrency the modes' engines
are stepped in lockstep (``bench/lockstep.py``), so the host's slow phases fall on all of them
alike, and each mode's times count only its own steps. The KV budget for sessions is sized so
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
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lockstep import OwnClock, lockstep
from bench.steps import StepRates
from services.worker.engine.config import EngineConfig
from services.worker.engine.cuda_graph import CAPTURE_POLICIES
from services.worker.engine.engine import Engine
from services.worker.engine.heap import GcPauses, freeze_heap
from services.worker.engine.request import SamplingParams
from services.worker.hierarchy.build import hierarchy_fixed_bytes
from services.worker.kv.config import bytes_per_token
from services.worker.model import LayerSpec, ModelConfig, SourceSpec, build_model

MODES = ("resident", "hisparse", "adaptive")


def bench_model_config(layers: int, k: int) -> ModelConfig:
    """GLM-style IndexShare at a size that makes the GPU, not Python, do the work: MLA rows of
    576 elements (512 latent + 64 RoPE, bf16), producers every 4 layers."""
    specs = []
    for i in range(layers):
        if i % 4 == 0:
            specs.append(LayerSpec(source=i, index="producer"))
        else:
            specs.append(LayerSpec(source=i, index="follower", leader=i - i % 4))
    return ModelConfig(
        name="bench-glm", vocab_size=264, d_model=1024, n_heads=16, d_latent=512, d_rope=64,
        d_ff=2048, n_index_heads=8, d_index=64, index_topk=k,
        sources=tuple(SourceSpec() for _ in range(layers)), layers=tuple(specs),
        tie_embeddings=False, dtype="bfloat16", max_position=1 << 20,
    )  # fmt: skip


def build_engine(mode: str, args, budget: int) -> tuple[Engine, int, int]:
    """(engine, pool bytes, fixed bytes): the session budget plus the mode's fixed allocations."""
    ctx = args.context
    common = dict(
        model="bench-glm", device=args.device, dtype=DTYPE, mode=mode, page_size=args.page,
        max_num_seqs=max(*args.concurrency, args.probe_sessions), max_model_len=ctx + args.decode_tokens + 16,
        max_prefill_tokens=ctx, hot_cache_rows=args.hot_cache_rows, resolver="auto",
        attention_backend="auto", host_arena_mib=args.host_gib * 1024,
        cuda_graphs=not args.eager, overlap_refills=args.overlap_refills,
        graph_capture=args.graph_capture, populate_payback=args.populate_payback,
    )  # fmt: skip
    fixed = 0
    if mode != "resident":
        probe = EngineConfig(kv_pool_mib=budget / 2**20, **common)
        fixed = hierarchy_fixed_bytes(MODEL.cfg, probe.kv_config(MODEL.embed.weight.dtype))
    pool = budget + fixed
    engine = Engine(
        EngineConfig(kv_pool_mib=pool / 2**20, **common), model=MODEL, tokenizer=TOKENIZER
    )
    return engine, pool, fixed


class Sweep:
    """One mode at one concurrency: C requests arrive at once and each decodes
    ``--decode-tokens`` tokens. Stepped by ``lockstep`` beside the other modes; its clock
    counts only its own steps (wall time, allocation waits), so the other modes' steps in
    between do not count against it."""

    def __init__(
        self, engine: Engine, mode: str, c: int, args, prompts: list[list[int]], gc: GcPauses
    ) -> None:
        self.engine, self.mode, self.c, self.args = engine, mode, c, args
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        self.census0 = engine.kv.census()
        self._host = self.census0.host if self.census0 is not None else 0
        self.reqs = [engine.add_request(f"{mode}-{c}-{i}", prompts[i], params) for i in range(c)]
        self.stats0 = (engine.stats.decode_s, engine.stats.decode_tokens)
        self.steps = StepRates(engine)
        self.peak = 0
        self.clock = OwnClock()  # counts only this engine's steps
        self.waits: dict[int, float] = {}  # request -> its clock when admitted
        # decode seconds and steps by what else the step did (``KINDS``), or nothing else
        self.split = {k: [0.0, 0] for k in (*self.KINDS, "plain")}
        # with --trace: per step [requests running, decode ms, kind, host rows read, GC ms]
        self.trace: list[list] = []
        self.gc = gc  # the process's collector pauses; those inside this mode's steps count
        self.gc_s = 0.0

    @property
    def active(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        start = self.clock.now()
        before = self._events()
        decode_s = self.engine.stats.decode_s
        gc_s = self.gc.total_s
        self.clock.timed(self._step)
        gc_s = self.gc.total_s - gc_s
        self.gc_s += gc_s
        after = self._events()
        kind = next(
            (k for k, a, b in zip(self.KINDS, after, before, strict=True) if a > b), "plain"
        )
        self.split[kind][0] += self.engine.stats.decode_s - decode_s
        self.split[kind][1] += 1
        if self.args.trace:
            census = self.engine.kv.census()
            host = census.host if census is not None else 0
            self.trace.append([
                self.engine.num_running, round(1e3 * (self.engine.stats.decode_s - decode_s), 3),
                kind, host - self._host, round(1e3 * gc_s, 3),
            ])  # fmt: skip
            self._host = host
        for i, r in enumerate(self.reqs):
            if i not in self.waits and r.admitted_time is not None:
                self.waits[i] = self.clock.stamp(r.admitted_time, start)
        self.steps.record()
        self.peak = max(self.peak, self.engine.num_running)

    # captured a decode graph; ran the pass eagerly (its graph key not captured yet);
    # queued a refill of optional history (its copy runs before the step's decode pass)
    KINDS = ("capture", "eager", "refill")

    def _events(self) -> tuple[int, int, int]:
        """Counts of ``KINDS`` so far."""
        res = getattr(self.engine.kv.payload, "residency", None)
        graphs = self.engine.graphs
        return (
            graphs.captures if graphs is not None else 0,
            graphs.eager if graphs is not None else 0,
            res.stats.refill_pages if res is not None else 0,
        )

    def _step(self) -> None:
        self.engine.step()
        if self.args.device == "cuda":
            torch.cuda.synchronize()

    def row(self) -> dict:
        st, args, c = self.engine.stats, self.args, self.c
        decode_time = st.decode_s - self.stats0[0]
        decode_tokens = st.decode_tokens - self.stats0[1]
        waits = list(self.waits.values())
        row = {
            "mode": self.mode,
            "concurrency": c,
            "sessions_admitted": self.peak,
            "decode_tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
            "decode_tokens_per_s_median": self.steps.median,
            "output_tokens_per_s": c * args.decode_tokens / self.clock.now(),
            "wall_s": self.clock.now(),
            "alloc_wait_mean_s": statistics.mean(waits),
            "alloc_wait_max_s": max(waits),
            # where decode time went: steps that also captured a graph (the capture runs the
            # step eagerly, then records it), ran eagerly, queued a refill, and the rest
            "decode_s_by_step": {k: round(v[0], 4) for k, v in self.split.items()},
            "steps_by_kind": {k: v[1] for k, v in self.split.items()},
            "gc_pause_s": round(self.gc_s, 4),  # the collector's pauses inside its steps
        }
        census1 = self.engine.kv.census()
        if census1 is not None:
            d = {
                k: getattr(census1, k) - getattr(self.census0, k)
                for k in ("direct", "hot", "host", "copied")
            }
            total = max(1, d["direct"] + d["hot"] + d["host"])
            row.update(
                census_direct=d["direct"] / total, census_hot=d["hot"] / total,
                census_host=d["host"] / total,
                host_bytes_per_token=d["copied"] * self.engine.kv.row_bytes / max(1, c * args.decode_tokens),
            )  # fmt: skip
        res = getattr(self.engine.kv.payload, "residency", None)
        if res is not None:
            row.update(reclaims=res.stats.reclaim_events, repopulated=res.stats.repopulated_pages)
        if self.engine.graphs is not None:  # captured so far (a capture step runs eagerly)
            row.update(graphs_captured=self.engine.graphs.captures)
        if args.trace:
            row["trace"] = self.trace
        return row


def run_modes(modes: list[str], args, budget: int, prompts: list[list[int]]) -> list[dict]:
    """Every mode's engine at once; at each C the modes run in lockstep (``bench/lockstep.py``),
    then each mode's capacity is probed on its own."""
    engines = {}
    results = {}
    for mode in modes:
        engine, pool, fixed = build_engine(mode, args, budget)
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        # Warm-up at the context measured: every kernel variant compiled (and decode graphs
        # captured for one and two requests at its index-key width) before anything is timed.
        engine.generate(prompts[:2], params)
        engines[mode] = engine
        results[mode] = {"mode": mode, "pool_bytes": pool, "fixed_bytes": fixed, "rows": []}
    if args.gc_freeze:  # as a worker does once its engine is built
        freeze_heap()
    pauses = GcPauses()
    for c in args.concurrency:
        sweeps = [Sweep(engines[m], m, c, args, prompts, pauses) for m in modes]
        lockstep(sweeps)
        for sw in sweeps:
            row = sw.row()
            results[sw.mode]["rows"].append(row)
            print(json.dumps(row), flush=True)
    pauses.close()
    for mode, engine in engines.items():
        results[mode]["capacity"] = probe_capacity(engine, mode, args, prompts)
        print(json.dumps({"mode": mode, "capacity": results[mode]["capacity"]}), flush=True)
        engine.close()
    engines.clear()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return [results[m] for m in modes]


def probe_capacity(engine: Engine, mode: str, args, prompts: list[list[int]]) -> dict:
    """Sessions of the context held at once: ``--probe-sessions`` requests that never finish
    arrive together; steps run until the queue stops draining (no admission for
    ``--probe-stable`` steps while nothing is settling: reclaims and copies done), then all are
    aborted. Unlike the concurrency sweep this is not bounded by how fast requests finish."""
    params = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)
    ids = [f"probe-{mode}-{i}" for i in range(args.probe_sessions)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, prompts[i % len(prompts)], params)
    t0 = time.perf_counter()
    peak, stable, steps = 0, 0, 0
    while engine.num_waiting and stable < args.probe_stable:
        engine.step()
        steps += 1
        running = engine.num_running
        stable = 0 if running > peak or engine.kv.settling() else stable + 1
        peak = max(peak, running)
    for rid in ids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return {
        "sessions": peak,
        "offered": args.probe_sessions,
        "all_admitted": peak == args.probe_sessions,
        "steps": steps,
        "seconds": time.perf_counter() - t0,
    }


MODEL = None
TOKENIZER = None
DTYPE = "bfloat16"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = ap.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    return args


def setup(args: argparse.Namespace) -> tuple[ModelConfig, int, int, list[list[int]]]:
    """Builds the benchmark's model (``MODEL``, ``TOKENIZER``): (its config, resident bytes
    per token, the session KV budget, one prompt per request of the largest concurrency)."""
    global MODEL, TOKENIZER, DTYPE
    DTYPE = "bfloat16" if args.device == "cuda" else "float32"
    from dhisparse.tokenizer import ByteTokenizer

    TOKENIZER = ByteTokenizer()
    cfg = bench_model_config(args.layers, args.k)
    MODEL = build_model(cfg, seed=0, device=args.device, dtype=getattr(torch, DTYPE))
    per_token = bytes_per_token(cfg, MODEL.embed.weight.element_size(), payload=True)
    session_tokens = args.context + args.decode_tokens + 16
    budget = int(args.resident_sessions * session_tokens * per_token * 1.02)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 256, (args.context,), generator=g).tolist()
        for _ in range(max(args.concurrency))
    ]
    return cfg, per_token, budget, prompts


def main() -> int:
    args = parse_args()
    cfg, per_token, budget, prompts = setup(args)
    results = run_modes(args.modes.split(","), args, budget, prompts)
    summary = summarize(results, args)
    out = {
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": cfg.to_dict(),
        "context": args.context,
        "decode_tokens": args.decode_tokens,
        "session_budget_bytes": budget,
        "resident_bytes_per_token": per_token,
        "hot_cache_rows": args.hot_cache_rows,
        "page": args.page,
        "command": "python bench/capacity.py " + " ".join(sys.argv[1:]),
        "modes": results,
        "summary": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    if args.plot:
        plot(out, args.plot)
    return 0


def summarize(results: list[dict], args) -> dict:
    """The issue's ratios, from the aggregate decode rate and (``*_median``) from the median
    per-step rate, which the host's slow phases do not move (``bench/steps.py``)."""
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
