"""``dhisparse plan``: size GPUs and host memory with the capacity model (no torch import); with
the worker's parallel flags, workers that span GPUs, one column per layout."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from dhisparse.capacity.builtin import (
    default_deployment,
    get_profile,
    profile_from_model_dir,
    profile_names,
)
from dhisparse.capacity.layouts import ALL, layouts_of
from dhisparse.capacity.model import GIB, TB
from dhisparse.capacity.model_size import model_size_from_dir
from dhisparse.capacity.plan import build_plan
from dhisparse.capacity.profile import Deployment, DrafterProfile, Profile
from dhisparse.capacity.report import render_json, render_table
from dhisparse.capacity.weights import ModelWeights, model_weights_of
from dhisparse.family.held_weights import SERVING_DTYPE_BYTES
from dhisparse.family.parallel_layout import ParallelConfig
from dhisparse.family.quantization_config import WEIGHT_DTYPES
from dhisparse.flags import add_switch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", choices=profile_names(), help="built-in profile or preset")
    src.add_argument(
        "--model",
        metavar="DIR",
        help="model directory: a Hugging Face one (deepseek_v32, glm_moe_dsa, deepseek_v4 "
        "with V4.1's shared sources; V4's weights are not sized) or the engine's",
    )
    parser.add_argument("--context", type=int, required=True, help="tokens per session")
    parser.add_argument(
        "--shared-prefix",
        type=_tokens,
        metavar="TOKENS",
        help="the first TOKENS of every session's context are the same (a system prompt and "
        "tools): its complete pages are held once per GPU where the worker shares them",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (exact bytes)")

    d = parser.add_argument_group("drafter (eqs. 9-11)")
    d.add_argument(
        "--drafter",
        help="a drafter of the profile (e.g. dflash2 for glm-5.3); with --model, mtp: the "
        "model's own MTP layer (its KV counted as one more source, no draft ring)",
    )
    d.add_argument("--draft-window", type=int, help="W: prior positions the drafter reads")
    d.add_argument("--draft-k-max", type=int, help="K_max: largest verified block")
    d.add_argument("--draft-row-bytes", type=int, help="draft K/V bytes per row, all layers")
    d.add_argument("--draft-fixed-gib", type=float, help="drafter fixed GiB/GPU besides staging")

    m = parser.add_argument_group("profile overrides")
    m.add_argument("--hot-cache-rows", type=int, help="B: hot-cache rows per source")
    m.add_argument("--top-k-rows", type=int, help="k: rows each query selects")
    m.add_argument("--page-size", type=int, help="p: rows per page")
    m.add_argument("--tail-pages", type=int, help="tail pages per source")
    m.add_argument("--chi", type=int, help="χ: payload sources live at once")
    m.add_argument(
        "--kv-dtype-bytes",
        type=int,
        help="element bytes (presets and --model; default: the config dtype)",
    )
    m.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="as the worker's flag: fp8 sizes rows and index keys in the worker's FP8 formats "
        "(656 B rows, 132 B keys at the released dims; presets and --model)",
    )

    g = parser.add_argument_group("deployment (defaults: the profile's reference deployment)")
    memory = g.add_mutually_exclusive_group()
    memory.add_argument("--pool-gib", type=float, help="per-GPU memory for required allocations")
    memory.add_argument(
        "--gpu-gib",
        type=float,
        help="per-GPU memory (HBM): each layout's KV pool is what its weights per GPU and "
        "--reserve-gib leave (--model DIR or a family preset)",
    )
    g.add_argument(
        "--reserve-gib",
        type=float,
        help="with --gpu-gib: per-GPU memory besides weights and KV pool (activations, CUDA "
        "graphs, NCCL buffers; default 0)",
    )
    g.add_argument(
        "--gpus",
        type=int,
        help="GPUs per host, each with its own sessions (with --tensor-parallel-size N: a "
        "multiple of N, N per worker; default N)",
    )
    g.add_argument("--fixed-gib", type=float, help="other fixed per-GPU allocations")
    g.add_argument("--slots", type=int, help="N: request slots per GPU (ring and staging)")
    host = g.add_mutually_exclusive_group()
    host.add_argument("--host-gib", type=float, help="host memory for backups, GiB")
    host.add_argument("--host-tb", type=float, help="host memory for backups, TB")

    p = parser.add_argument_group(
        "workers that span GPUs (the worker's flags; docs/deploy.md 'Workers that span GPUs')"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="GPUs per worker: size the layout the flags below give, or --layouts",
    )
    add_switch(p, "expert-parallel", "each rank holds n_experts / N whole experts (off)")
    add_switch(
        p,
        "data-parallel-attention",
        "each rank attends for its own requests from its own KV pool (off)",
    )
    p.add_argument(
        "--layouts",
        metavar="LIST",
        help=f"{ALL} (every layout over N GPUs the model divides into), or a comma-separated "
        "list of tp, tp+ep, dp-attention, dp-attention+ep: one column each",
    )
    p.add_argument(
        "--weight-dtype",
        choices=list(WEIGHT_DTYPES),
        default="auto",
        help="weights as the worker holds them: fp8, the serving dtype (bf16), or auto: fp8 "
        "where the checkpoint is",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(SERVING_DTYPE_BYTES),
        help="the serving dtype (default: the model config's)",
    )

    e = parser.add_argument_group("speculation pays (eq. 13)")
    e.add_argument("--tpot-ratio", type=float, help="TPOT_spec / TPOT_base")
    e.add_argument("--concurrency", type=int, help="offered load (sessions) for the share kept")


def main(args: argparse.Namespace) -> int:
    try:
        _check_prefix(args)
        profile = _profile(args)
        drafter = _drafter(args, profile)
        layouts = _layouts(args)
        weights = _weights(args, layouts)
        deployment = _deployment(args, layouts)
        plan = build_plan(
            profile,
            args.context,
            drafter,
            deployment,
            tpot_ratio=args.tpot_ratio,
            load=args.concurrency,
            model=model_size_from_dir(args.model, mtp=_mtp(args)) if args.model else None,
            layouts=layouts,
            weights=weights,
            refuse=args.layouts != ALL,
            prefix_tokens=args.shared_prefix,
        )
    except (ValueError, OSError) as exc:
        print(f"dhisparse plan: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_json(plan) + "\n" if args.json else render_table(plan))
    return 0


def _tokens(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a prefix of {value} tokens: give 1 or more")
    return value


def _check_prefix(args: argparse.Namespace) -> None:
    if args.shared_prefix is not None and args.shared_prefix > args.context:
        raise ValueError(
            f"--shared-prefix {args.shared_prefix} is longer than --context {args.context}: "
            "the prefix is part of each session's context"
        )


def _mtp(args: argparse.Namespace) -> bool:
    return bool(args.model) and args.drafter == "mtp"


def _profile(args: argparse.Namespace) -> Profile:
    if args.model:
        profile = profile_from_model_dir(
            args.model, kv_dtype_bytes=args.kv_dtype_bytes, mtp=_mtp(args),
            kv_cache_dtype=args.kv_cache_dtype,
        )  # fmt: skip
    else:
        profile = get_profile(
            args.profile, kv_dtype_bytes=args.kv_dtype_bytes, kv_cache_dtype=args.kv_cache_dtype
        )
    return profile.with_overrides(
        hot_cache_rows=args.hot_cache_rows,
        top_k=args.top_k_rows,
        page_size=args.page_size,
        tail_pages=args.tail_pages,
        chi=args.chi,
    )


def _drafter(args: argparse.Namespace, profile: Profile) -> DrafterProfile | None:
    changes = {
        "window": args.draft_window,
        "k_max": args.draft_k_max,
        "row_bytes": args.draft_row_bytes,
        "fixed_bytes": _bytes(args.draft_fixed_gib, GIB),
    }
    given = {k: v for k, v in changes.items() if v is not None}
    if args.drafter:
        return replace(profile.drafter(args.drafter), **given)
    if not given:
        return None
    required = {
        "window": "--draft-window",
        "k_max": "--draft-k-max",
        "row_bytes": "--draft-row-bytes",
    }
    missing = [flag for field, flag in required.items() if field not in given]
    if missing:
        raise ValueError(f"a custom drafter needs {', '.join(missing)} (or --drafter NAME)")
    return DrafterProfile(name="custom", **given)


def _layouts(args: argparse.Namespace) -> tuple[ParallelConfig, ...]:
    """The layouts to size: those of the parallel flags (or of ``--gpu-gib`` alone: one GPU),
    or none (GPUs that each hold their own sessions)."""
    flags = (args.tensor_parallel_size, args.layouts, args.expert_parallel,
             args.data_parallel_attention, args.gpu_gib)  # fmt: skip
    if all(f is None for f in flags):
        return ()
    n = args.tensor_parallel_size if args.tensor_parallel_size is not None else 1
    return layouts_of(
        n, args.layouts, bool(args.expert_parallel), bool(args.data_parallel_attention)
    )


def _weights(args: argparse.Namespace, layouts: tuple[ParallelConfig, ...]) -> ModelWeights | None:
    """The model's weights as the worker would hold them, for the layouts (None: no layouts,
    or a profile without a model's weights)."""
    given = args.dtype is not None or args.weight_dtype != "auto"
    if not layouts:
        if given:
            raise ValueError(
                "--dtype and --weight-dtype size the weights of a layout: give "
                "--tensor-parallel-size N or --gpu-gib"
            )
        return None
    weights = model_weights_of(
        args.model or args.profile, weight_dtype=args.weight_dtype, dtype=args.dtype,
        mtp=_mtp(args),
    )  # fmt: skip
    if weights is None and given:
        raise ValueError(
            "--dtype and --weight-dtype size a model's weights: give --model DIR (DeepSeek-V3.2, "
            "GLM-5) or a family preset"
        )
    return weights


def _deployment(args: argparse.Namespace, layouts: tuple[ParallelConfig, ...]) -> Deployment:
    dep = default_deployment(args.profile) if args.profile else Deployment()
    pool = _bytes(args.pool_gib, GIB)
    if args.reserve_gib is not None and args.gpu_gib is None:
        raise ValueError("--reserve-gib is taken from --gpu-gib: give both")
    gpus = args.gpus
    if layouts and gpus is None:
        gpus = layouts[0].world_size  # one worker
    dep = dep.with_overrides(
        pool_bytes=pool,
        gpus=gpus,
        fixed_bytes=_bytes(args.fixed_gib, GIB),
        slots=args.slots,
        host_bytes=_bytes(args.host_gib, GIB) or _bytes(args.host_tb, TB),
        note="" if pool is not None else None,  # a given pool is no longer the implied one
    )
    if args.gpu_gib is None:
        return dep
    return replace(
        dep,
        pool_bytes=None,
        hbm_bytes=_bytes(args.gpu_gib, GIB),
        reserve_bytes=_bytes(args.reserve_gib, GIB) or 0,
        note="",
    )


def _bytes(value: float | None, unit: int) -> int | None:
    return None if value is None else round(value * unit)
