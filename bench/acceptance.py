"""Acceptance length of the shipped drafters against the shipped target, measured with the
project's own engine (issue 10).

    python -m bench acceptance --model models/glm-dsa-mini --out docs/results/acceptance.json

Prompts are windows of the model's held-out files (never trained on; ``bench/heldout.py``).
A kind is a drafter directory under ``--drafters``, or ``mtp``: the checkpoint's own MTP layer,
or ``mtp+vocabN``: the MTP layer whose draft steps score only the first N ids of ``--token-map``
(its hot vocabulary, ``python -m training.corpus.token_map``; default MODEL/token_map.txt). For each drafter, width
K (target queries per verify round, anchor included) and temperature, the prompts decode
``--decode-tokens`` tokens together in one engine; the acceptance length is the tokens a verify
round emits on average, ``1 + accepted / drafts`` (1 = no gain, K = every draft accepted). At
temperature 0 the speculative output must equal plain greedy decoding token for token; the
run records whether it did for every prompt.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from bench.core import UsageError
from bench.core.output import write_result
from bench.core.progress import progress
from bench.heldout import heldout_prompts
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig

DRAFTERS = ("mtp", "dflash2")  # what the shipped model has
VOCAB = "mtp+vocab"  # a kind: the MTP layer over the token map's first N ids (mtp+vocabN)
TOKEN_MAP = "token_map.txt"  # a model directory's token map, where it ships one


def drafter_arg(drafters: str, kind: str | None) -> str | None:
    """The engine's drafter for ``kind``: none, ``mtp``, or the directory under ``drafters``."""
    if kind is None or kind == "mtp":
        return kind
    return str(Path(drafters) / kind)


def speculation(args, kind: str | None, width: int) -> SpeculationConfig:
    """The engine's speculation for ``kind``: none, ``mtp``, ``mtp+vocabN`` (``--token-map``'s
    first N ids), or the drafter directory under ``--drafters``; raises UsageError on a bad N."""
    if kind is not None and kind.startswith(VOCAB):
        n = kind.removeprefix(VOCAB)
        if not n.isdigit() or int(n) < 1:
            raise UsageError(f"--kinds: mtp+vocabN takes a size N >= 1, got {kind!r}")
        token_map = args.token_map or str(Path(args.model) / TOKEN_MAP)
        return SpeculationConfig("mtp", width, "fixed", token_map, int(n))
    return SpeculationConfig(drafter_arg(args.drafters, kind), width, "fixed")


def measure(args, drafter: str | None, width: int, temperature: float, prompts) -> dict:
    cfg = EngineConfig(
        model=args.model, device=args.device, mode=args.mode, kv_pool_mib=args.pool_mib,
        host_arena_mib=args.pool_mib, max_num_seqs=len(prompts),
        max_model_len=args.prompt_len + args.decode_tokens + 64,
        max_prefill_tokens=max(4096, args.prompt_len), page_size=16,
        speculation=speculation(args, drafter, width),
    )  # fmt: skip
    eng = Engine(cfg)
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=args.decode_tokens, ignore_eos=True, seed=1000 + i
        )
        for i in range(len(prompts))
    ]
    eng.generate(prompts[:2], params[0])  # warm-up: kernels compiled before timing
    spec = eng.speculator
    c0 = (spec.counters.drafts, spec.counters.accepted) if spec else (0, 0)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    row: dict = {
        "drafter": drafter or "none",
        "width": width if drafter else 1,
        "temperature": temperature,
        "output_tokens_per_s": sum(len(o.output_ids) for o in outs) / wall,
        "acceptance_length": 1.0,
    }
    if cfg.speculation.hot_vocab:
        row["token_map"] = cfg.speculation.token_map
    if spec is not None:
        drafts = spec.counters.drafts - c0[0]
        row["acceptance_length"] = 1.0 + (spec.counters.accepted - c0[1]) / max(drafts, 1)
        row["verify_rounds"] = drafts
    eng.close()
    return row | {"_outputs": [o.output_ids for o in outs]}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="models/glm-dsa-mini")
    ap.add_argument("--drafters", default=None, help="default: MODEL/drafters")
    ap.add_argument(
        "--kinds", default=",".join(DRAFTERS),
        help="drafter directories under --drafters, mtp, and mtp+vocabN (the MTP layer over "
        "the first N ids of --token-map)",
    )  # fmt: skip
    ap.add_argument("--token-map", default=None, help=f"mtp+vocabN's (default MODEL/{TOKEN_MAP})")
    ap.add_argument("--widths", default="2,4,8")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--mode", default="resident")
    ap.add_argument("--pool-mib", type=float, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="docs/results/acceptance.json")
    ap.add_argument("--table", default=None, help="also write the markdown table here")


def run(args: argparse.Namespace) -> int:
    args.drafters = args.drafters or str(Path(args.model) / "drafters")
    prompts = heldout_prompts(args.model, args.prompts, args.prompt_len, args.seed)
    temps = [float(t) for t in args.temperatures.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    runs = [(None, 1, t) for t in temps]
    runs += [(d, w, t) for d in args.kinds.split(",") for w in widths for t in temps]
    rows, greedy = [], None
    for drafter, width, temp in progress(runs, "acceptance"):
        row = measure(args, drafter, width, temp, prompts)
        outputs = row.pop("_outputs")
        if temp == 0 and drafter is None:
            greedy = outputs
        elif temp == 0:
            row["equals_plain_greedy"] = outputs == greedy
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {
        "benchmark": "acceptance",
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
        "model": args.model,
        "mode": args.mode,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "decode_tokens": args.decode_tokens,
        "results": rows,
    }
    print(f"wrote {write_result(out, args.out)}")
    table = markdown(rows)
    print(table)
    if args.table:
        Path(args.table).write_text(table)
    return 0


def markdown(rows: list[dict]) -> str:
    temps = sorted({r["temperature"] for r in rows})
    head = "| drafter | K | " + " | ".join(f"τ at T={t:g} | tok/s at T={t:g}" for t in temps)
    lines = [head + " |", "|---|---|" + "---|---|" * len(temps)]
    keys = sorted({(r["drafter"], r["width"]) for r in rows}, key=lambda k: (k[0] != "none", k))
    for d, w in keys:
        cells = []
        for t in temps:
            r = next(x for x in rows if (x["drafter"], x["width"], x["temperature"]) == (d, w, t))
            cells.append(f"{r['acceptance_length']:.2f} | {r['output_tokens_per_s']:.0f}")
        lines.append(f"| {d} | {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
