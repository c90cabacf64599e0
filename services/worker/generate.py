"""``dhisparse generate``: offline generation straight on the engine, no servers.

Prompts run as one continuous batch. ``--json`` prints one object per prompt."""

from __future__ import annotations

import argparse
import json
import sys
import time

from services.worker.cli import add_engine_arguments, settings_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sample-seed", dest="sample_seed", type=int, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")


def main(args: argparse.Namespace) -> int:
    from dhisparse.family.parallel_layout import LayoutError
    from services.worker.engine.engine import Engine

    # offline generation keeps its host backups in this process: the node's store is for
    # serving workers (and a group's ranks must agree on it: ``group.follow``)
    settings = settings_from_args(args).model_copy(update={"kv_store": ""})
    try:
        if settings.tensor_parallel_size > 1:
            from services.worker.group import launch

            return launch(settings, generate_rank, args)
        return run(args, Engine(settings.engine_config()))
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def generate_rank(settings, comm, args: argparse.Namespace) -> int:
    """Rank 0 of a group (``group.launch``): the prompts through the group's engine."""
    from services.worker.engine.engine import Engine

    engine = Engine(settings.engine_config(comm.rank), comm=comm)
    try:
        return run(args, engine)
    finally:
        engine.group.stop()
        engine.close()


def run(args: argparse.Namespace, engine) -> int:
    """The prompts of ``args`` through ``engine``, printed."""
    from dhisparse.family.presets import PRESETS
    from dhisparse.paths import resolve_path
    from dhisparse.tokenizer import chat_formatter
    from services.worker.request.request import SamplingParams

    cfg = engine.cfg
    tok = engine.tokenizer
    chat = chat_formatter(tok, None if cfg.model in PRESETS else resolve_path(cfg.model))
    prompts = []
    for text in args.prompt:
        if args.chat:  # the chat format places the BOS itself
            prompts.append(chat.encode([{"role": "user", "content": text}]))
        else:
            prompts.append(tok.encode_prompt(text))
    params = [
        SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=None if args.sample_seed is None else args.sample_seed + i,
            max_tokens=args.max_tokens,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
        for i in range(len(prompts))
    ]
    try:
        for p, sp in zip(prompts, params, strict=True):
            engine.validate_request(p, sp)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for prompt, req in zip(args.prompt, reqs, strict=True):
        text = _final_text(req)
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": text,
                        "token_ids": req.output_ids,
                        "finish_reason": req.finish_reason.value if req.finish_reason else None,
                    }
                )
            )
        else:
            print(
                f"--- {prompt!r}\n{text}\n[{req.finish_reason.value if req.finish_reason else ''}]"
            )
    ntok = sum(len(r.output_ids) for r in reqs)
    print(
        f"{len(reqs)} prompts, {ntok} tokens in {elapsed:.2f}s ({ntok / elapsed:.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def _final_text(req) -> str:
    """The released text (stop strings already cut)."""
    return req.text.detok.text[: req.text.emitted]
