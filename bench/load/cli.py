"""``python -m bench load``: flags, the runs, the output JSON (fields in the package's
docstring)."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from bench.core import UsageError
from bench.core.output import write_result
from bench.serving.config import Load
from bench.spec_control import shipped_rates
from dhisparse.family.presets import preset
from dhisparse.family.scaled import SCALED
from services.worker.hierarchy.tail import tail_rows
from services.worker.kv.config import bytes_per_token
from services.worker.kv.row_codec import kv_codecs
from services.worker.model.weight_format import WeightFormat
from services.worker.weights.model_io import build_model

from .engines import MODES, SPEC, EngineSizing, Variant
from .history import KEY_TOKENS
from .pool import plan_pool
from .replay import TRACE, Replay, expansion, load_traces, predicted_census, replay_for
from .report import plot, table
from .runs import Context, derived, run_group

TINY = "tiny-glm-mtp"  # tiny-glm with an MTP layer: what --tiny runs on the CPU
RUN_FIELDS = (
    "sessions_admitted", "mean_running", "output_tokens_per_s", "decode_tokens_per_s",
    "per_request_tokens_per_s", "tpot_s", "ttft_s", "alloc_wait_s", "prefill_s",
    "alloc_wait_share_of_ttft", "reclaim", "repopulate_bytes_per_token", "census",
    "host_read_bytes_per_token", "spec", "acceptance_length", "width_steps", "imported",
)  # fmt: skip


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    strs = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="tiny preset with an MTP layer on the CPU, tiny contexts (a smoke run)",
    )
    ap.add_argument("--family", type=strs, default=list(SCALED), help=f"of {', '.join(SCALED)}")
    ap.add_argument("--contexts", type=ints, default=[32768, 100000], help="input lengths")
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=ints, default=[1, 4, 16, 32, 64, 96])
    ap.add_argument("--modes", type=strs, default=list(MODES))
    ap.add_argument(
        "--spec",
        type=strs,
        default=list(SPEC),
        help="off (no speculation), fixed, paper, online: MTP width schedules",
    )
    ap.add_argument("--spec-mode", default="adaptive", help="the mode speculation runs in")
    ap.add_argument("--spec-concurrency", type=ints, help="default: --concurrency")
    ap.add_argument("--spec-width", type=int, default=4, help="K_max")
    ap.add_argument(
        "--acceptance",
        default="shipped",
        help="MTP proposals under the acceptance control: 'shipped' or rates",
    )
    ap.add_argument("--prefixes", type=int, default=8, help="prepared histories per context")
    ap.add_argument(
        "--history",
        default="random",
        choices=("random",),
        help="rows and keys of the prepared histories",
    )
    ap.add_argument(
        "--selections",
        default="random",
        choices=("random", "replay"),
        help="what decode steps select: the random histories' own top-k (no locality but what "
        "random keys give), or the shipped model's recorded selections replayed (replay.py)",
    )
    ap.add_argument("--trace", default=str(TRACE), help="the selection traces --selections "
                    "replay reads (bench census --trace)")  # fmt: skip
    ap.add_argument(
        "--duration-s",
        type=float,
        help="measured window per run (default 60 s; --tiny: 2 requests per client)",
    )
    ap.add_argument("--warmup-s", type=float, default=0.0, help="before the window")
    ap.add_argument(
        "--requests-per-client", type=int, help="instead of a window: this many requests per client"
    )
    ap.add_argument(
        "--noise-concurrency",
        type=int,
        help="the C whose mode runs are repeated (default: the largest)",
    )
    ap.add_argument("--pool-mib", type=float, help="KV budget (default: bench/load/pool.py)")
    ap.add_argument(
        "--host-gib",
        type=float,
        help="host arena (default: the node's share, at most --host-cap-gib)",
    )
    ap.add_argument(
        "--host-cap-gib", type=float, default=96.0, help="what the machine can give the arena"
    )
    ap.add_argument("--max-slots", type=int, help="max_num_seqs (default: the largest C)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--hot-cache-rows", type=int, default=4096)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=("auto", "fp8"))
    ap.add_argument("--weights", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--fused-kernels", action=argparse.BooleanOptionalAction, default=True,
        help="the fused kernels (a GPU; the engine's default)",
    )  # fmt: skip
    ap.add_argument("--time-limit-s", type=float, help="skip C points that would end past it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="PREFIX", help="PNGs of throughput and sessions vs C")
    ap.add_argument("--out", default="docs/results/load.json")


@dataclasses.dataclass(frozen=True)
class Setup:
    """What --tiny changes: device, dtype, the model, and how the pool is sized."""

    device: str
    dtype: torch.dtype
    families: list[str]

    @staticmethod
    def of(args: argparse.Namespace) -> Setup:
        if args.tiny:
            return Setup("cpu", torch.float32, [TINY])
        if not torch.cuda.is_available():
            raise UsageError("bench load runs the scaled families on a CUDA GPU (--tiny: CPU)")
        bad = [f for f in args.family if f not in SCALED]
        if bad:
            raise UsageError(f"unknown --family {bad}; known: {', '.join(SCALED)}")
        return Setup("cuda", torch.bfloat16, list(args.family))


def check(args: argparse.Namespace) -> None:
    bad = [m for m in args.modes if m not in MODES] + [s for s in args.spec if s not in SPEC]
    if bad or args.spec_mode not in MODES:
        raise UsageError(f"unknown modes or schedules {bad or [args.spec_mode]}")
    if min(args.contexts + args.concurrency) < 1 or args.output_len < 1:
        raise UsageError("contexts, concurrency and --output-len are positive")
    if min(args.contexts) <= max(KEY_TOKENS, args.page):
        raise UsageError(f"contexts must exceed {max(KEY_TOKENS, args.page)} tokens")


def tiny_model(seed: int, mtp: bool):
    base = preset("tiny-glm")
    d = dataclasses.replace(base, name=TINY, config={**base.config, "num_nextn_predict_layers": 1})
    return build_model(d, seed=seed, mtp=mtp)


def load_model(setup: Setup, family: str, args: argparse.Namespace, mtp: bool):
    if family == TINY:
        return tiny_model(args.seed, mtp)
    fmt = WeightFormat(fp8=args.weights == "fp8")
    return build_model(SCALED[family], seed=args.seed, device="cuda", dtype=setup.dtype,
                       weights=fmt, in_place=True, mtp=mtp)  # fmt: skip


def pool_sizing(family: str, ctx: int, model, args: argparse.Namespace) -> dict:
    """The KV budget and host arena of every engine at ``ctx``, and how they were reached."""
    session = ctx + args.output_len + args.spec_width + 16
    if args.pool_mib is not None or family == TINY:
        dtype = model.dtype
        codecs = kv_codecs(model.cfg, args.kv_cache_dtype, dtype)
        per_token = bytes_per_token(model.cfg, torch.empty((), dtype=dtype).element_size(), True,
                                    codecs.rows.row_bytes, codecs.keys.row_bytes)  # fmt: skip
        pool = round(args.pool_mib * 2**20) if args.pool_mib else int(2 * session * per_token)
        formula = (
            f"--pool-mib {args.pool_mib}"
            if args.pool_mib
            else f"tiny: 2 resident sessions of {session} tokens x {per_token:.0f} B/token"
        )
        host = round((args.host_gib or 0.25) * 2**30)
        return {"pool_bytes": pool, "host_bytes": host, "formula": formula, "plan": None}
    plan = plan_pool(family, ctx)
    share = plan.host_share_bytes
    cap = round(args.host_cap_gib * 2**30)
    host = round(args.host_gib * 2**30) if args.host_gib else min(share, cap)
    return {
        "pool_bytes": plan.pool_bytes,
        "host_bytes": host,
        "formula": plan.formula,
        "host_share_bytes": share,
        "host_capped": host < share,
        "plan": plan.as_dict(),
    }


def engine_sizing(ctx: int, sizing: dict, args: argparse.Namespace) -> EngineSizing:
    cs = args.concurrency + (args.spec_concurrency or [])
    return EngineSizing(
        pool_bytes=sizing["pool_bytes"], slots=args.max_slots or max(cs),
        max_model_len=ctx + args.output_len + args.spec_width + 16,
        max_prefill_tokens=max(args.max_prefill_tokens, args.page),
        page_size=args.page, hot_cache_rows=args.hot_cache_rows,
        kv_cache_dtype=args.kv_cache_dtype, spec_width=args.spec_width,
        graphs=not args.eager, fused_kernels=args.fused_kernels, host_bytes=sizing["host_bytes"],
    )  # fmt: skip


def load_of(args: argparse.Namespace) -> Load:
    """Each client's requests: a window of ``--duration-s``, or ``--requests-per-client``; by
    default 60 s, and on ``--tiny`` 2 requests each (the smoke run ends when they are done)."""
    per_client, duration = args.requests_per_client, args.duration_s
    if per_client is None and duration is None:
        per_client, duration = (2, None) if args.tiny else (None, 60.0)
    return Load(output_len=args.output_len, requests_per_client=per_client,
                duration_s=duration, warmup_s=args.warmup_s, seed=args.seed)  # fmt: skip


def rates_of(args: argparse.Namespace) -> tuple[float, ...]:
    rates = shipped_rates() if args.acceptance == "shipped" else tuple(
        float(x) for x in args.acceptance.split(",")
    )  # fmt: skip
    if len(rates) < args.spec_width - 1:
        raise UsageError(f"--acceptance needs {args.spec_width - 1} rates")
    return rates


def replay_of(model, ctx: int, args: argparse.Namespace) -> tuple[Replay, dict]:
    """The replayed selections of prompts of ``ctx`` tokens, and what the JSON records of the
    mapping (``replay.py``), with the census a session alone should show over its first
    decode steps (at most two passes over the trace) without speculation."""
    r = replay_for(model, ctx, load_traces(Path(args.trace)))
    t = r.trace
    steps = max(1, min(args.output_len - 1, 2 * t.steps))
    predicted = predicted_census(r, model.cfg, args.hot_cache_rows, tail_rows(args.page, 1),
                                 steps)  # fmt: skip
    return r, {"trace": t.source, "trace_context": t.context, "trace_steps": t.steps,
               "trace_k": t.k, "trace_producers": r.p0, "producers": r.targets,
               "draft_producers": len(r.producer) - r.targets,
               "expansion": expansion(model.cfg.index_topk, t), "spread": r.spread,
               "predicted_census": predicted}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    check(args)
    setup = Setup.of(args)
    rates = rates_of(args) if any(s != "off" for s in args.spec) else ()
    from services.worker.hierarchy.local_store import LocalHostStore

    t0 = time.monotonic()
    deadline = None if args.time_limit_s is None else t0 + args.time_limit_s
    out: dict = {
        "benchmark": "load",
        "machine": torch.cuda.get_device_name() if setup.device == "cuda" else "cpu",
        "tiny": args.tiny, "output_len": args.output_len, "history": args.history,
        "selections": args.selections,
        "prefixes": args.prefixes, "spec_width": args.spec_width,
        "fused_kernels": args.fused_kernels, "graphs": not args.eager,
        "acceptance_rates": list(rates), "kv_cache_dtype": args.kv_cache_dtype,
        "weights": "fp32" if args.tiny else args.weights,
        "load": dataclasses.asdict(load_of(args)),
        "sizing": [], "engines": [], "runs": [], "skipped": [],
    }  # fmt: skip
    spec_cs = args.spec_concurrency or args.concurrency
    noise_c = args.noise_concurrency or max(args.concurrency)
    mode_variants = [Variant(m) for m in args.modes]
    spec_variants = [Variant(args.spec_mode, s) for s in args.spec if s != "off"]
    for family in setup.families:
        model = load_model(setup, family, args, mtp=bool(spec_variants))
        for ctx in args.contexts:
            sizing = pool_sizing(family, ctx, model, args)
            print(
                f"{family} at {ctx}: {sizing['formula']}; host arena "
                f"{sizing['host_bytes'] / 2**30:.2f} GiB",
                flush=True,
            )
            replay = None
            if args.selections == "replay":
                replay, sizing["replay"] = replay_of(model, ctx, args)
            c = Context(family, model, ctx, args, sizing, engine_sizing(ctx, sizing, args),
                        load_of(args), replay)  # fmt: skip
            out["sizing"].append({"family": family, "context": ctx, **sizing})
            store = LocalHostStore(sizing["host_bytes"])
            try:
                run_group(c, mode_variants, args.concurrency, store, out, rates, deadline,
                          noise_c)  # fmt: skip
                if spec_variants:
                    group = [Variant(args.spec_mode), *spec_variants]
                    run_group(c, group, spec_cs, store, out, rates, deadline, None)
            finally:
                store.close()
            out["sizing"][-1]["prepare_s"] = c.prepare_s
            derived(out)
            out["elapsed_s"] = time.monotonic() - t0
            write_result(out, args.out)  # a run cut short keeps what it measured
        del model
    derived(out)
    out["elapsed_s"] = time.monotonic() - t0
    print(table(out))
    if args.plot:
        out["plots"] = plot(out, args.plot)
    return out
