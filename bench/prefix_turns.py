"""A growing conversation through the real stack as ``make run`` starts it, with and without
prefix reuse (``python -m bench prefix-turns``): kv-host-store, worker and gateway as processes,
the worker with ``dhisparse up``'s CPU defaults (the shipped model, adaptive mode with durable
sessions, its MTP layer drafting), beside the same stack with ``--no-prefix-cache``, in lockstep
(turn i of each variant back to back). ``--mode resident --drafter none``: pages shared on the
device instead of imported from the host store.

    python -m bench prefix-turns --out docs/results/prefix_turns.json
    python -m bench prefix-turns --mode resident --drafter none \
        --out docs/results/prefix_turns_resident.json

Turn 1's prompt is ``--history`` ids of the held-out files (``bench/heldout.py``); each later
turn sends the whole conversation back, as an agent does: the previous prompt, the answer's text
encoded again by the model's tokenizer, and ``--question`` new held-out ids. Every answer is
``--new-tokens`` greedy tokens with ``ignore_eos``, streamed from ``/v1/completions``. Per turn
and variant: prompt tokens, the prompt tokens the worker computed (its
``dhisparse:prefill_tokens_computed``, read before and after the request), time to first token
and whether the text equals the other variant's. Goals (issue 43): a later turn computes at most
10% of its prompt; its time to first token against turn 1's."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from bench.cpu_stream import MODEL, make_run_config
from bench.heldout import heldout_prompts
from bench.serving.http_loop import samples_of, total
from bench.serving.stack import Stack
from dhisparse import metrics as names
from dhisparse.tokenizer import load_tokenizer
from dhisparse.up import DEFAULT_DRAFTER
from services.worker.engine.config import EngineConfig
from services.worker.engine.kernel_builds import WHILE_SERVING
from services.worker.speculative.width_policy import WIDTH_POLICIES

WITH, WITHOUT = "prefix cache (make run)", "no prefix cache"
GOAL_COMPUTED_SHARE = 0.10


# where the worker's time went: its engine's phases, prefix reuse's operations (within those
# phases), and its decode passes by path (replayed graph, capture, eager)
WORKER_COUNTERS = {
    **{
        f"engine_{p}_s": (names.ENGINE_SECONDS, "phase", p)
        for p in ("schedule", "prefill", "decode")
    },
    **{f"prefix_{op}_s": (names.PREFIX_CACHE_SECONDS, "op", op) for op in ("import", "leave")},
    **{f"passes_{p}": (names.DECODE_PASSES, "path", p) for p in ("graph", "capture", "eager")},
    # how the selected rows resolved (a row read from host went through the hot cache's miss),
    # the bytes read from host, and the optional pages refilled from host (adaptive)
    **{f"rows_{p}": (names.RESOLVER_ROWS, "path", p) for p in ("direct", "hot", "host")},
    "host_read_bytes": (names.HOST_READ_BYTES, None, None),
    "repopulated_pages": (names.REPOPULATED_PAGES, None, None),
    # Triton kernels the worker built (a first launch of a specialization) and their seconds
    "kernel_builds": (names.KERNEL_BUILDS, None, None),
    "kernel_build_s": (names.KERNEL_BUILD_SECONDS, None, None),
}


def worker_counters(samples: dict) -> dict[str, float]:
    """``WORKER_COUNTERS`` in the worker's metric ``samples`` (``samples_of``)."""
    return {
        k: total(samples, name + "_total", **({label: value} if label else {}))
        for k, (name, label, value) in WORKER_COUNTERS.items()
    }


def worker_delta(metrics_url: str, before: dict[str, float] | None = None) -> dict[str, float]:
    """The worker's ``WORKER_COUNTERS`` and prompt tokens computed (``computed``) so far, or
    since ``before`` (an earlier call's)."""
    samples = samples_of(httpx.get(metrics_url, timeout=30).text)
    now = {"computed": total(samples, names.PREFILL_TOKENS_COMPUTED + "_total")}
    now |= worker_counters(samples)
    return now if before is None else {k: round(now[k] - before[k], 4) for k in now}


@dataclass(frozen=True)
class Answer:
    """One streamed completion: its text, its tokens' ids, the time to its first token and
    its wall time (s)."""

    text: str
    ids: list[int]
    ttft_s: float
    wall_s: float


def stream_turn(client: httpx.Client, model: str, prompt: list[int], new_tokens: int) -> Answer:
    """One streamed greedy completion of ``new_tokens`` tokens (``ignore_eos``) through
    ``client`` (a client of the gateway), with its ids (``return_token_ids``): its first token
    is the first chunk that carries one, readable text or not."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
        "stream": True, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    first, text, ids = None, [], []
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices") or ():
                if ch.get("token_ids"):
                    first = first or time.perf_counter()
                    ids += ch["token_ids"]
                text.append(ch.get("text") or "")
    if first is None:
        raise RuntimeError("no tokens came back")
    return Answer("".join(text), ids, first - t0, time.perf_counter() - t0)


def one_turn(stack: Stack, model: str, prompt: list[int], new_tokens: int) -> dict:
    """One streamed greedy completion of ``prompt``: its text, time to first token and the
    prompt tokens the worker computed for it."""
    before = worker_delta(stack.worker_metrics)
    with httpx.Client(base_url=stack.base, timeout=600) as c:
        answer = stream_turn(c, model, prompt, new_tokens)
    worker = worker_delta(stack.worker_metrics, before)
    computed = worker.pop("computed")
    return {
        "prompt_tokens": len(prompt),
        "computed_tokens": int(computed),
        "computed_share": computed / len(prompt),
        "ttft_s": answer.ttft_s,
        "wall_s": answer.wall_s,
        # the worker's wall seconds by phase, and its decode passes by path, over the turn
        "worker": worker,
        "text": answer.text,
    }


def add_stack_arguments(ap: argparse.ArgumentParser) -> None:
    """The stack's options: ``make run``'s CPU worker unless changed (``stack_config``)."""
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER, help="make run's (its default)")
    ap.add_argument(
        "--mode", default=None, choices=("resident", "hisparse", "adaptive"),
        help="serving mode (default make run's, adaptive: reuse through the host store; "
        "resident shares device pages, without the MTP layer: --drafter none)",
    )  # fmt: skip
    ap.add_argument("--device", default="cpu", help="the worker's device (cpu, cuda)")
    ap.add_argument(
        "--width-policy", default=None, choices=WIDTH_POLICIES,
        help="the drafter's width policy (default make run's, online: it speculates where "
        "that pays on this machine; fixed: every round at the width, for acceptance)",
    )  # fmt: skip
    ap.add_argument("--kv-pool-mib", type=float, default=None, help="default make run's")
    ap.add_argument("--max-model-len", type=int, default=None, help="default make run's")


def stack_config(args: argparse.Namespace) -> EngineConfig:
    """The worker's engine: ``make run``'s on a CPU, with the options' changes."""
    drafter = None if args.drafter == "none" else args.drafter
    changes: dict = {"device": args.device}
    for field in ("mode", "kv_pool_mib", "max_model_len"):
        if getattr(args, field) is not None:
            changes[field] = getattr(args, field)
    cfg = replace(make_run_config(args.model, drafter), **changes)
    if args.width_policy is not None and drafter is not None:
        cfg = replace(cfg, speculation=replace(cfg.speculation, width_policy=args.width_policy))
    return cfg


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_stack_arguments(ap)
    ap.add_argument("--history", type=int, default=2048, help="turn 1's prompt, ids")
    ap.add_argument("--question", type=int, default=48, help="new ids each later turn adds")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--out", default="docs/results/prefix_turns.json")


def run(args: argparse.Namespace) -> dict:
    if args.turns < 2:
        raise SystemExit("--turns: at least 2 (turn 1 has nothing to reuse)")
    history, *questions = heldout_prompts(args.model, args.turns, args.history, args.seed)
    questions = [q[: args.question] for q in questions]
    tok = load_tokenizer(args.model)
    base = stack_config(args)
    need = args.history + (args.turns - 1) * (args.question + 2 * args.new_tokens) + 64
    if need > base.max_model_len:
        raise SystemExit(f"the conversation may reach {need} tokens, past {base.max_model_len}")
    cached = WITH if args.mode is None else f"prefix cache ({base.mode})"
    variants = {cached: base, WITHOUT: replace(base, prefix_cache=False)}
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    prompts = {v: list(history) for v in variants}
    name = Path(args.model).name
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as up:
        stacks = {
            v: up.enter_context(Stack(cfg, args.model, 1 << 30, logs))
            for v, cfg in variants.items()
        }
        # the first requests compile and map: a short one, then one of the history's length
        # (other tokens: nothing of it is cached for turn 1), so turn 1 pays no compilation
        warm = heldout_prompts(args.model, 1, args.history, args.seed + 1)[0]
        for s in stacks.values():
            one_turn(s, name, warm[:64], 8)
            one_turn(s, name, warm, 8)
        for turn in range(args.turns):
            for v, s in stacks.items():
                row = one_turn(s, name, prompts[v], args.new_tokens)
                rows[v].append(row)
                if turn + 1 < args.turns:
                    prompts[v] += tok.encode(row["text"]) + questions[turn]
                shown = {k: row[k] for k in ("prompt_tokens", "computed_tokens", "ttft_s")}
                print(f"turn {turn + 1} {v}: {json.dumps(shown)}", flush=True)
        # what a turn's kernel builds were (the worker warns of each once it serves)
        built = {v: s.log_lines(WHILE_SERVING) for v, s in stacks.items()}
    later = {v: rs[1:] for v, rs in rows.items()}
    summary = {
        v: {
            "max_later_computed_share": max(r["computed_share"] for r in later[v]),
            "median_later_ttft_s": statistics.median(r["ttft_s"] for r in later[v]),
            "first_ttft_s": rows[v][0]["ttft_s"],
            "later_ttft_over_first": [r["ttft_s"] / rows[v][0]["ttft_s"] for r in later[v]],
        }
        for v in variants
    }
    same_text = [a["text"] == b["text"] for a, b in zip(rows[cached], rows[WITHOUT], strict=True)]
    ttft_ratio = [
        a["ttft_s"] / b["ttft_s"] for a, b in zip(later[cached], later[WITHOUT], strict=True)
    ]
    share = summary[cached]["max_later_computed_share"]
    print(f"later turns compute at most {share:.1%} of their prompt with the cache "
          f"({summary[WITHOUT]['max_later_computed_share']:.0%} without); time to first token "
          f"with / without: {', '.join(f'{x:.2f}' for x in ttft_ratio)}")  # fmt: skip
    return {
        "benchmark": "prefix-turns",
        "machine": platform.machine(),
        "model": args.model,
        "device": args.device,
        "drafter": args.drafter,
        "mode": base.mode,
        "history": args.history,
        "question": args.question,
        "new_tokens": args.new_tokens,
        "turns": args.turns,
        "goal_computed_share": GOAL_COMPUTED_SHARE,
        "meets_goal": share <= GOAL_COMPUTED_SHARE,
        "ttft_with_over_without": ttft_ratio,
        "same_text": same_text,
        "summary": summary,
        "per_turn": rows,
        "kernels_built_while_serving": built,
    }
