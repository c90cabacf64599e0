"""``dhisparse worker``: flags override ``DHISPARSE_WORKER_*`` settings."""

from __future__ import annotations

import argparse
import asyncio
import logging

from dhisparse.flags import add_switch
from services.worker.engine.config import CPU_KV_POOL_MIB, GPU_KV_POOL_SHARE
from services.worker.graphs.cuda_graph import CAPTURE_POLICIES
from services.worker.kv.row_codec import KV_CACHE_DTYPES
from services.worker.model.weight_format import WEIGHT_DTYPES
from services.worker.ops.fp8_linear import MODES
from services.worker.settings import WorkerSettings
from services.worker.startup import mark_start

# flag -> settings field; every engine knob is a flag.
_FLAGS: dict[str, tuple[type, str]] = {
    "host": (str, "address to bind"),
    "port": (int, "gRPC port"),
    "metrics-port": (int, "Prometheus metrics port (0: off)"),
    "worker-id": (str, "worker id (default host:port)"),
    "served-model-name": (str, "model name reported to the gateway"),
    "kv-store": (str, "host:port of the node's kv-host-store"),
    "lease-ttl-s": (float, "lease of this process at the kv-host-store, in seconds"),
    "attach-timeout-s": (float, "abort a resumed session not re-attached within this"),
}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine knobs shared by ``worker`` and ``generate``."""
    p.add_argument("--model", help="preset name (tiny-glm, tiny-dsv4) or model directory")
    p.add_argument("--device", help="cpu, cuda[:N], or auto: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--kv-cache-dtype", choices=list(KV_CACHE_DTYPES),
        help="KV rows and index keys: auto (the serving dtype, default) or fp8 (packed FP8 "
        "rows: 656 B at the released dims, index keys 132 B; docs/fp8_kv.md)",
    )  # fmt: skip
    p.add_argument(
        "--weight-dtype", choices=list(WEIGHT_DTYPES),
        help="projections and routed experts in fp8, fp4 (DeepSeek-V4: FP4 routed experts, as "
        "released) or the serving dtype (bf16); auto: fp8 where the checkpoint is",
    )  # fmt: skip
    p.add_argument(
        "--fp8-mode", choices=list(MODES),
        help="FP8 weights: bf16 activations (w8a16, default) or activations quantized per 1x128",
    )  # fmt: skip
    p.add_argument("--seed", type=int, help="random-init seed for presets")
    p.add_argument("--mode", choices=["resident", "hisparse", "adaptive"], help="serving mode")
    p.add_argument("--reserve-pages", type=int, help="adaptive: admission reserve, in pages")
    p.add_argument("--populate-pages", type=int, help="adaptive: pages refilled per attempt")
    p.add_argument(
        "--populate-payback", type=float,
        help="adaptive: refill a request only with >= this x V/k decode steps left (0: always)",
    )  # fmt: skip
    add_switch(
        p, "overlap-refills", "adaptive, GPU: refill copies on a side stream beside the decode "
        "passes (off)",
    )  # fmt: skip
    p.add_argument("--reclaim-order", choices=["largest", "smallest", "oldest", "newest"])
    p.add_argument(
        "--kv-pool-mib", type=float,
        help=f"KV pool size in MiB (default: on a GPU {GPU_KV_POOL_SHARE:.0%}% of its memory free "
        f"once the model is loaded; {CPU_KV_POOL_MIB:.0f} on a CPU)",
    )  # fmt: skip
    p.add_argument("--hot-cache-rows", type=int, help="hot cache rows B per request and source")
    p.add_argument("--host-arena-mib", type=float, help="private host arena (no kv-store)")
    p.add_argument("--resolver", choices=["auto", "torch", "triton"])
    p.add_argument(
        "--drafter",
        help="dflash | dspark | dflash2 (random weights), mtp (the checkpoint's MTP layer), a "
        "drafter dir, or none (plain decoding)",
    )
    p.add_argument("--spec-width", type=int, help="K_max: target queries per verify round")
    p.add_argument(
        "--speculative-token-map", metavar="PATH",
        help="--drafter mtp: the draft steps score only the token ids this file lists, most "
        "frequent first (a JSON list, one id per line, or a torch .pt tensor; docs/mtp.md)",
    )  # fmt: skip
    p.add_argument(
        "--draft-vocab-size", type=int, metavar="N",
        help="--drafter mtp: score the first N ids of --speculative-token-map (without a map, "
        "ids 0..N-1: for models of random weights only)",
    )  # fmt: skip
    p.add_argument("--width-policy", choices=["fixed", "paper", "online"])
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"])
    add_switch(p, "cuda-graphs", "on a GPU: replay decode passes as captured CUDA graphs (on)")
    add_switch(
        p, "cuda-graphs-mtp", "on a GPU: capture the passes of a model served with its MTP layer "
        "too (on; off: such a model runs eagerly)",
    )  # fmt: skip
    add_switch(
        p, "fused-kernels", "on a GPU: norms, RoPE, routing, top-k ... as fused kernels (on)"
    )
    p.add_argument(
        "--graph-capture",
        choices=CAPTURE_POLICIES,
        help="capture a decode graph at its key's second sighting (default), or once two "
        "passes in a row meet it",
    )
    p.add_argument("--page-size", type=int, help="rows per KV page")
    p.add_argument("--max-num-seqs", type=int, help="request slots")
    p.add_argument("--max-model-len", type=int, help="context limit in tokens")
    p.add_argument(
        "--max-prefill-tokens", type=int,
        help="prefill tokens per step; longer prompts run in chunks between decode steps",
    )  # fmt: skip
    add_switch(
        p, "chunked-prefill",
        "prefill long prompts in chunks of --max-prefill-tokens interleaved with decoding (on)",
    )  # fmt: skip
    p.add_argument("--top-k-rows", type=int, help="the indexer's k (rows attended per query)")
    p.add_argument(
        "--tensor-parallel-size", type=int,
        help="ranks (one process and one GPU each) the worker spans: attention heads, dense "
        "MLPs, the vocabulary and the experts split over them (1)",
    )  # fmt: skip
    add_switch(
        p, "expert-parallel",
        "with --tensor-parallel-size N: each rank holds n_experts / N whole experts, tokens "
        "exchanged between ranks (off: every expert split by its intermediate dimension)",
    )  # fmt: skip
    add_switch(
        p, "data-parallel-attention",
        "with --tensor-parallel-size N: each rank attends for its own requests (attention and "
        "KV hierarchy per rank, MoE shared over the ranks; docs/deploy.md) (off)",
    )  # fmt: skip
    add_switch(
        p, "durable-sessions",
        "hierarchy modes: keep what a successor needs to resume each session (on)",
    )  # fmt: skip
    add_switch(
        p, "prefix-cache",
        "hierarchy modes: finished requests leave their complete pages in the node's host "
        "store and admissions import the longest cached prefix of their prompt (on)",
    )  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    overrides = {
        k: v for k, v in vars(args).items() if v is not None and k in WorkerSettings.model_fields
    }
    return WorkerSettings(**overrides)


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flag, (typ, help_text) in _FLAGS.items():
        p.add_argument(f"--{flag}", type=typ, help=help_text)
    add_switch(p, "gc-freeze", "freeze the Python heap after start-up: collections skip it (on)")
    add_switch(
        p, "warmup", "run a short synthetic conversation before serving, so the kernels and "
        "graphs the first requests meet are built at start-up (default: on a GPU)",
    )  # fmt: skip
    add_engine_arguments(p)
    p.add_argument("--log-level", default="INFO")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from dhisparse.family.parallel_layout import LayoutError

    mark_start()  # before the ranks are spawned: they inherit it
    settings = settings_from_args(args)
    try:
        if settings.tensor_parallel_size > 1:
            from services.worker.group import launch

            return launch(settings, serve_rank)
        from services.worker.server import serve

        asyncio.run(serve(settings))
    except LayoutError as e:
        logging.getLogger(__name__).error("%s", e)
        return 2
    return 0


def serve_rank(settings: WorkerSettings, comm) -> int:
    """Rank 0 of a worker's group: the gRPC server over the group's engine."""
    from services.worker.server import serve

    asyncio.run(serve(settings, comm))
    return 0
