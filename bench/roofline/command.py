"""``python -m bench roofline``: every kernel of a real-dimension model's decode step (and
prefill) with its time, the bytes and FLOPs its region must move, and its fractions of the
device's limits; the step against its roofline; kernel count and graph-launch host time.

    python -m bench roofline --scaled glm5-scaled,v32-scaled --concurrency 1,4,16,64 \
        --context 8192 --variants fused,unfused --prefill 8192

Per family, one engine serves never-ending greedy requests of ``--context`` tokens; the C are
measured from the smallest up, each admitting (prefilling) the requests it adds, so that a
``--time-limit-s`` cuts the largest C (said in the output), never the smaller ones. The variants
share that engine, each with its own captured graphs (``variants.py``: ``unfused`` runs its passes
without the fused kernels), and are stepped alternately while timing
(``bench/core/lockstep.py``'s ``alternate``), so the host's slow and fast phases fall on both
alike. Attribution: ``attribution.py``; bytes and FLOPs: ``cost.py``; limits: ``limits.py``.
On the CPU (``--device cpu --tiny``) there are no graphs: the timed steps are eager and the
regions come from the labelled eager step itself, and the output says so."""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.core import UsageError
from bench.core.lockstep import alternate
from bench.core.steps import steady_engine
from bench.roofline import report
from bench.roofline.attribution import NOT_PER_LAYER, profile_steps
from bench.roofline.cost import Dims, passes_costs
from bench.roofline.limits import Limits, measure
from bench.roofline.models import build, dims_of
from bench.roofline.prefill import prefill
from bench.roofline.variants import VARIANTS, Served
from dhisparse.family.scaled import SCALED
from dhisparse.tokenizer import ByteTokenizer
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.kv.row_codec import KV_CACHE_DTYPES
from services.worker.request.request import SamplingParams

MODES = ("resident", "hisparse", "adaptive")
NO_GRAPHS = (
    "eager: no graphs on this device, so no replay to align; the timed steps are eager and the "
    "regions come from the labelled eager step itself"
)
_DECODE = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--scaled", default="glm5-scaled,v32-scaled", help=f"of {', '.join(SCALED)}")
    ap.add_argument("--mode", default="resident", choices=MODES)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prefill", default="", help="prompt lengths to prefill, e.g. 8192,32768")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant and C")
    ap.add_argument("--warmup", type=int, default=3, help="steps per variant before timing")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--time-limit-s", type=float, default=None,
        help="skip (and say so) a C whose admission would pass it, and prefills past it",
    )  # fmt: skip
    ap.add_argument(
        "--weights", default="fp8", choices=("fp8", "dense"),
        help="projections and experts in FP8 (the released checkpoints') or the serving dtype",
    )  # fmt: skip
    ap.add_argument(
        "--tiny", action="store_true",
        help="the family's tiny model instead of its real dimensions (CPU runs and tests)",
    )  # fmt: skip


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise UsageError(f"{what} takes integers, got {text!r}") from None
    if any(v < 1 for v in out):
        raise UsageError(f"{what} takes positive integers, got {text!r}")
    return out


def run(args: argparse.Namespace) -> dict:
    fams = [f for f in args.scaled.split(",") if f]
    if not fams or set(fams) - set(SCALED):
        raise UsageError(f"--scaled takes {', '.join(SCALED)}, got {args.scaled!r}")
    names = [v for v in args.variants.split(",") if v]
    if not names or set(names) - set(VARIANTS) or len(set(names)) < len(names):
        raise UsageError(f"--variants takes {', '.join(VARIANTS)}, got {args.variants!r}")
    cs = sorted(set(_ints(args.concurrency, "--concurrency")))
    lengths = _ints(args.prefill, "--prefill")
    if not cs and not lengths:
        raise UsageError("nothing to measure: give --concurrency, --prefill or both")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise UsageError("--device cuda on a machine without CUDA (use --device cpu --tiny)")
    if cuda:  # CUPTI attached before any graph is captured: a replayed graph's kernels reported
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            torch.ones(1, device="cuda").add_(1)
            torch.cuda.synchronize()
    limits = measure(torch.device(args.device))
    print(f"== {limits.device}: copy {limits.copy_bytes_per_s / 1e9:.1f} GB/s (measured), "
          f"matmul {limits.matmul_flops_per_s / 1e12:.4g} TFLOP/s (measured), compute limit "
          f"{limits.compute / 1e12:.4g} TFLOP/s ({limits.compute_source})")  # fmt: skip
    deadline = time.monotonic() + (args.time_limit_s or float("inf"))
    families = {f: family(f, args, cs, names, lengths, limits, deadline) for f in fams}
    report.print_summary(families)
    return {
        "bench": "roofline",
        "config": {k: getattr(args, k) for k in (
            "mode", "context", "steps", "warmup", "profile_steps", "kv_cache_dtype",
            "max_prefill_tokens", "device", "tiny", "weights", "time_limit_s",
        )} | {"concurrency": sorted(cs), "variants": names, "prefill": lengths},
        "limits": {
            "device": limits.device, "copy_bytes_per_s": limits.copy_bytes_per_s,
            "matmul_flops_per_s": limits.matmul_flops_per_s, "peak_bf16": limits.peak_bf16,
            "peak_fp8": limits.peak_fp8, "compute": limits.compute,
            "compute_source": limits.compute_source,
        },
        "families": families,
    }  # fmt: skip


def family(
    name: str, args: argparse.Namespace, cs: list[int], names: list[str], lengths: list[int],
    limits: Limits, deadline: float,
) -> dict:  # fmt: skip
    t0 = time.perf_counter()
    preset, model = build(name, args.device, args.tiny, fp8=args.weights == "fp8")
    built_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 256, (args.context,), generator=g).tolist()
        for _ in range(max(cs, default=0))
    ]
    # every running request decodes through each later stage's prefill and measurements
    per_stage = len(names) * (args.warmup + args.steps + args.profile_steps + 2)
    room = args.context + len(cs) * per_stage + max(cs, default=0) + 64
    eng = steady_engine(
        args.mode, [], args.context, 0.0, preset.name, model, ByteTokenizer(),
        device=args.device, graphs=GraphConfig(args.device == "cuda"), kv_pool_mib=None,
        kv_cache_dtype=args.kv_cache_dtype, max_prefill_tokens=args.max_prefill_tokens,
        hot_cache_rows=2 * model.family.index_topk, max_num_seqs=max(cs, default=1),
        max_model_len=max([room, *(n + 64 for n in lengths)]),
    )  # fmt: skip
    served = Served(eng, names)
    codecs = eng.kv.codecs
    dims = dims_of(model, codecs.rows.row_bytes, codecs.keys.row_bytes)
    how = "CUDA graphs" if served.graphs else NO_GRAPHS
    print(f"\n==== {name}{' (tiny)' if args.tiny else ''}, {args.mode}, context {args.context}: "
          f"built in {built_s:.1f} s; decode {how}")  # fmt: skip
    decode: dict[str, dict] = {}
    rate = None  # prompt tokens/s of the last admission
    stage_s = 0.0  # the last C's measurements
    for c in cs:
        new = c - eng.num_running
        need = None if rate is None else new * args.context / rate + stage_s
        if need is not None and time.monotonic() + need > deadline:
            decode[str(c)] = {"skipped": f"admitting {new} more requests and measuring "
                              f"need about {need:.0f} s, past --time-limit-s"}  # fmt: skip
            print(f"\n--- C={c}: {decode[str(c)]['skipped']}")
            break
        took = served.admit(prompts[eng.num_running : c], _DECODE)
        rate = new * args.context / took
        t = time.monotonic()
        decode[str(c)] = {"admit_s": took, "variants": concurrency(served, c, args, dims, limits)}
        stage_s = time.monotonic() - t
    pre: dict[str, dict] = {}
    for n in lengths:
        if time.monotonic() > deadline:
            pre[str(n)] = {"skipped": "past --time-limit-s"}
            continue
        pre[str(n)] = prefill(served, n, dims, limits)
    eng.close()
    del eng, served, model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"built_s": built_s, "row_bytes": dims.row_bytes, "key_bytes": dims.key_bytes,
            "graphs": args.device == "cuda", "decode_passes": how,
            "decode": decode, "prefill": pre}  # fmt: skip


def concurrency(
    served: Served, c: int, args: argparse.Namespace, dims: Dims, limits: Limits
) -> dict:
    """Every variant at C = ``c``: warm-up, timed steps in alternation, then the profiles."""
    for v in served.variants:
        for _ in range(args.warmup):
            served.step(v)
    before = {v.name: v.counters() for v in served.variants}
    times = alternate({v.name: (lambda v=v: served.timed_step(v)) for v in served.variants},
                      args.steps)  # fmt: skip
    out = {}
    for v in served.variants:
        graphs = {k: n - before[v.name][k] for k, n in v.counters().items()}
        sk = profile_steps(served, v, args.profile_steps)
        costs = passes_costs(dims, [sk.shape])
        step = report.spread(times[v.name])
        rows = report.regions(sk.by_region(), costs, limits)
        roof = report.roofline(costs, limits, step["median_ms"] * 1e-3)
        timed = sk.by_region()
        per_step = sum(n for n, _ in timed.values())
        in_layers = sum(n for r, (n, _) in timed.items() if r not in NOT_PER_LAYER)
        out[v.name] = {
            "step": step, "graphs_during_timing": graphs, "roofline": roof,
            "kernels_per_step": per_step,
            # the kernels of the layers' own regions (not the head, embedding, the engine's
            # step or kernels without a region), per decoder layer
            "kernels_per_layer": in_layers / len(dims.layers),
            "device_us_per_step": sum(us for _, us in timed.values()),
            "graph_launch_us_per_step": None if sk.graph_launch_us is None
            else sk.graph_launch_us / sk.steps,
            "graph_launches_per_step": sk.graph_launches / sk.steps,
            "kernels_not_placed": sk.lost, "attribution": sk.source,
            "eager_kernels": sk.eager_kernels, "profiled_steps": sk.steps,
            "visible_rows": max(sk.shape.visible), "experts": dict(sk.shape.experts),
            "regions": rows, "kernels": sk.by_name(),
        }  # fmt: skip
        _print(c, v.name, out[v.name])
    return out


def _print(c: int, variant: str, r: dict) -> None:
    s, roof = r["step"], r["roofline"]
    print(f"\n--- C={c} {variant}: step {s['median_ms']:.3f} ms (median of {s['samples']}; "
          f"min {s['min_ms']:.3f}, IQR {s['q1_ms']:.3f}-{s['q3_ms']:.3f}, max {s['max_ms']:.3f}); "
          f"roofline {roof['roofline_s'] * 1e3:.3f} ms ({roof['bound']}: "
          f"{roof['bytes'] / 1e9:.3f} GB, {roof['flops'] / 1e12:.3f} TFLOP); "
          f"ratio {report.fmt(roof['ratio'], '.3f')}")  # fmt: skip
    print(f"    {r['kernels_per_step']:.0f} kernels/step ({r['kernels_per_layer']:.1f}/layer; "
          f"the labelled eager step ran {r['eager_kernels']}), "
          f"{r['device_us_per_step']:.0f} µs of kernels/step, cudaGraphLaunch "
          f"{report.fmt(r['graph_launch_us_per_step'], '.0f')} µs/step host "
          f"({r['graph_launches_per_step']:.1f} launches); regions {r['attribution']}; graphs during timing "
          f"{r['graphs_during_timing'] or 'none (eager)'}; {r['kernels_not_placed']} kernels "
          f"not placed in a step")  # fmt: skip
    report.print_regions(r["regions"])
    report.print_kernels(r["kernels"])
