"""What a decode step's grammar work takes from the engine's thread (``python -m bench
grammar-host``): the host work of ``GrammarMasks`` and of the requests' matchers for ``--batch``
constrained requests, without a model, so that it is measured apart from a step it hides in.

    python -m bench grammar-host --out docs/results/grammar_host.json

The requests are the shipped model's, under ``grammar_cost.SCHEMA`` (an array of strings), each
inside a string, every step appending a token that keeps it there. A step: every request's
matcher accepts its token (``GrammarState.accept_each``, as ``emission.decoded_tokens`` calls
it), the next rows are filled ahead (``prefetch``), the engine's own work while the filler runs
(``--torch-ops`` small torch ops, which let the interpreter's lock go as a pass's do; not
counted), the pass's rows asked for (``fill_decode``) and applied (``apply``). Reported: each phase's median over ``--steps`` steps
after ``--warmup`` and their sum; ``apply`` includes xgrammar's kernel, which on a CPU is a
computation and on a GPU a launch, so the kernel alone on the same rows is reported too and the
sum without it is what the thread keeps on a GPU. ``grammar-cost`` measures the whole step on
a device; this is its host share, measurable on any machine."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import xgrammar as xgr

from bench.grammar_cost import MODEL, SCHEMA
from services.worker.engine.config import EngineConfig
from services.worker.engine.loading import tokenizer_and_ends
from services.worker.request.grammar import GrammarCompiler
from services.worker.request.grammar_masks import GrammarMasks
from services.worker.request.grammar_state import GrammarState
from services.worker.request.request import Grammar, Request, SamplingParams
from services.worker.weights.model_io import load_model

PHASES = ("accept", "prefetch", "fill", "apply")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--torch-ops", type=int, default=200, help="the engine's own work a step")
    ap.add_argument(
        "--threads", type=int, default=None, help="the filler's (default: the engine's)"
    )


def run(args: argparse.Namespace) -> dict:
    model = load_model(args.model)  # the engine's vocabulary width and ends, as it reads them
    tok, ends = tokenizer_and_ends(EngineConfig(model=args.model, device="cpu"), model, None)
    vocab = model.cfg.vocab_size
    grammars = GrammarCompiler(tok, vocab, ends)
    grammar = Grammar("json_schema", SCHEMA)
    opening, inside = tok.encode('["'), tok.encode("ab")
    reqs = []
    for i in range(args.batch):
        req = Request(f"r{i}", [1], SamplingParams(), text=None)  # type: ignore[arg-type]
        req.grammar = grammars.state(grammar, opening)
        reqs.append(req)
    masks = GrammarMasks(vocab, torch.device("cpu"), args.batch, args.batch, args.threads)
    logits = torch.zeros(args.batch, vocab)
    work = torch.zeros(16)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    masks.fill_decode(reqs)  # starts the filler
    masks.apply(logits)
    for step in range(args.warmup + args.steps):
        token = inside[step % len(inside)]
        t0 = time.perf_counter()
        taken = GrammarState.accept_each([r.grammar for r in reqs], [token] * len(reqs))
        t1 = time.perf_counter()
        assert all(taken), "the walk left the string"
        masks.prefetch(reqs, ahead=True)
        t2 = time.perf_counter()
        for _ in range(args.torch_ops):
            torch.add(work, 1)
        t3 = time.perf_counter()
        masks.fill_decode(reqs)
        t4 = time.perf_counter()
        masks.apply(logits)
        t5 = time.perf_counter()
        if step >= args.warmup:
            for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t4 - t3, t5 - t4), strict=True):
                times[p].append(dt)
    masks.close()
    # the kernel alone, on the masks the requests have now (as the loop's were)
    mask = torch.zeros(args.batch, xgr.get_bitmask_shape(1, vocab)[1], dtype=torch.int32)
    xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask(
        [r.grammar.matcher for r in reqs if r.grammar is not None], mask
    )
    rows = list(range(args.batch))
    kernel = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)
        kernel.append(time.perf_counter() - t0)
    median = {p: statistics.median(v) for p, v in times.items()}
    total = sum(median.values())
    kernel_s = statistics.median(kernel)
    print(
        f"batch {args.batch}: "
        + ", ".join(f"{p} {median[p] * 1e6:.0f} us" for p in PHASES)
        + f"; {total * 1e6:.0f} us a step, {(total - kernel_s) * 1e6:.0f} us without the "
        f"apply kernel ({kernel_s * 1e6:.0f} us on this CPU)"
    )
    return {
        "benchmark": "grammar-host",
        "model": args.model,
        "batch": args.batch,
        "steps": args.steps,
        "torch_ops": args.torch_ops,
        "threads": masks.threads,
        "host_cores": os.cpu_count(),
        "schema": SCHEMA,
        "median_s": median,
        "spread_s": {p: [min(v), max(v)] for p, v in times.items()},
        "step_s": total,
        "apply_kernel_s": kernel_s,
        "step_without_kernel_s": total - kernel_s,
    }
