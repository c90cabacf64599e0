"""A multi-turn agent trace through the real stack, with and without prefix reuse
(``python -m bench agent-trace``): ``--sessions`` conversations that share one system prompt,
each run turn after turn by a closed-loop client that sends the whole history back every turn
(the previous prompt, the answer's text encoded again, a new message), ``--concurrency``
conversations at a time; the same trace against the same stack with ``--no-prefix-cache``.
The stacks are ``make run``'s (``bench prefix-turns``'s: kv-host-store, worker, gateway as
processes; ``--mode``, ``--drafter``, ``--device`` as there).

    python -m bench agent-trace --out docs/results/agent_trace.json

Each repeat draws a fresh trace (its own system prompt and messages: nothing an earlier repeat
left is cached) and runs the two variants back to back, alternating which goes first (A B, B A,
...), so that drift on the machine hits both; the spread of one variant's repeats is the
run-to-run noise. Per variant and repeat: the trace's wall time, output tokens and turns per
second, prompt tokens computed ÷ sent (the worker's ``dhisparse:prefill_tokens_computed``),
time to first token of first turns and of later ones, time per output token, the drafter's
acceptance (its counters), and the share of turns whose text equals the other variant's
(greedy: batches of another composition may tip a near tie, and the histories then differ). Goals (issue 43): throughput with ÷ without reuse ≥ 2 (H200, 32
sessions); acceptance with ÷ without ≥ 0.98."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from bench.cpu_stream import MODEL as SHIPPED
from bench.heldout import heldout_prompts, prompt_source
from bench.prefix_turns import (
    WORKER_COUNTERS,
    add_stack_arguments,
    stack_config,
    stream_turn,
    worker_counters,
)
from bench.serving.http_loop import samples_of, total
from bench.serving.stack import Stack
from dhisparse import metrics as names
from dhisparse.tokenizer import load_tokenizer
from services.worker.engine.kernel_builds import WHILE_SERVING

WITH, WITHOUT = "prefix cache", "no prefix cache"
GOAL_THROUGHPUT_RATIO = 2.0


@dataclass(frozen=True)
class Trace:
    """One repeat's conversations: the shared ``system`` prompt, each session's first message
    and the messages of its later turns (ids)."""

    system: list[int]
    firsts: list[list[int]]
    questions: list[list[list[int]]]  # [session][turn - 1]

    @classmethod
    def draw(cls, source: str, args: argparse.Namespace, seed: int) -> Trace:
        """Messages of held-out ids of ``source`` (a model directory)."""
        n, later = args.sessions, args.turns - 1
        system = heldout_prompts(source, 1, args.system, seed)[0]
        firsts = heldout_prompts(source, n, args.first, seed + 1)
        flat = heldout_prompts(source, n * later, args.question, seed + 2) if later else []
        return cls(system, firsts, [flat[s * later : (s + 1) * later] for s in range(n)])


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    wall_s: float
    text: str


# The worker's counters a trace reads before and after it
COUNTERS = {
    "computed": names.PREFILL_TOKENS_COMPUTED,
    "drafts": names.SPEC_DRAFTS,
    "accepted": names.SPEC_ACCEPTED_TOKENS,
}
POSITIONS = 4  # the draft positions whose acceptance rate a run reports
MIN_ROUNDS = 100  # verify rounds per variant below which acceptance is not compared


def counters(metrics_url: str) -> dict[str, float]:
    """The worker's ``COUNTERS``, ``WORKER_COUNTERS`` and its accepted tokens per draft
    position, so far."""
    samples = samples_of(httpx.get(metrics_url, timeout=30).text)
    got = {k: total(samples, name + "_total") for k, name in COUNTERS.items()}
    got |= worker_counters(samples)
    for i in range(POSITIONS):
        got[f"accepted_{i}"] = total(
            samples, names.SPEC_ACCEPTED_PER_POS + "_total", position=str(i)
        )
    return got


def run_trace(stack: Stack, model: str, trace: Trace, args, encode) -> dict:
    """Every session of ``trace`` against ``stack``, ``args.concurrency`` at a time; the
    trace's totals and its turns."""
    turns: list[Turn] = []
    lock = threading.Lock()

    def session(s: int) -> None:
        prompt = trace.system + trace.firsts[s]
        with httpx.Client(base_url=stack.base, timeout=3600) as client:
            for t in range(args.turns):
                a = stream_turn(client, model, prompt, args.new_tokens)
                with lock:
                    turns.append(Turn(s, t, len(prompt), a.ttft_s, a.wall_s, a.text))
                if t + 1 < args.turns:
                    answer = a.ids if args.answers == "ids" else encode(a.text)
                    prompt = prompt + answer + trace.questions[s][t]

    before = counters(stack.worker_metrics)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for f in [pool.submit(session, s) for s in range(args.sessions)]:
            f.result()
    wall = time.perf_counter() - t0
    after = counters(stack.worker_metrics)
    got = {k: after[k] - before[k] for k in after}
    computed, drafts = got["computed"], got["drafts"]
    turns.sort(key=lambda x: (x.session, x.turn))
    sent = sum(x.prompt_tokens for x in turns)
    firsts = [x.ttft_s for x in turns if x.turn == 0]
    later = [x.ttft_s for x in turns if x.turn > 0]
    return {
        "wall_s": wall,
        "turns": len(turns),
        "output_tokens": len(turns) * args.new_tokens,
        "output_tok_per_s": len(turns) * args.new_tokens / wall,
        "turns_per_s": len(turns) / wall,
        "prompt_tokens": sent,
        "computed_tokens": int(computed),
        "computed_share": computed / sent,
        "first_ttft_p50_s": statistics.median(firsts),
        "later_ttft_p50_s": statistics.median(later) if later else None,
        "later_ttft_p90_s": _quantile(later, 0.9) if later else None,
        # time per output token after the first, over every turn
        "tpot_p50_s": statistics.median(
            (x.wall_s - x.ttft_s) / max(1, args.new_tokens - 1) for x in turns
        ),
        # speculation (a drafter on): tokens a round yields (1 + accepted per draft), and the
        # share of rounds whose draft position i was accepted
        "drafts": int(drafts),
        "acceptance_length": 1 + got["accepted"] / drafts if drafts else None,
        "accepted_per_position": [got[f"accepted_{i}"] / drafts for i in range(POSITIONS)]
        if drafts
        else None,
        # the worker's wall seconds by phase, and its decode passes by path, over the trace
        "worker": {k: round(got[k], 4) for k in WORKER_COUNTERS},
        "texts": [x.text for x in turns],
    }


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_stack_arguments(ap)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4, help="conversations at a time")
    ap.add_argument("--system", type=int, default=1024, help="the shared system prompt, ids")
    ap.add_argument("--first", type=int, default=128, help="each session's first message, ids")
    ap.add_argument("--question", type=int, default=48, help="each later turn's new message")
    ap.add_argument("--new-tokens", type=int, default=24, help="each answer's tokens")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="fresh traces, variants alternating")
    ap.add_argument(
        "--warmup-traces", type=int, default=1,
        help="untimed traces of the same shape each stack runs first (compilations, graphs)",
    )  # fmt: skip
    ap.add_argument(
        "--answers", default="text", choices=("text", "ids"),
        help="what a client sends back of an answer: its text encoded again (as agents do) or "
        "its ids as the server returned them (a model with random weights, whose ids the "
        "byte tokenizer cannot write as text)",
    )  # fmt: skip
    ap.add_argument(
        "--prompts-from", default=None,
        help="the model directory whose held-out ids the messages are (default --model, or "
        f"{SHIPPED} for a preset)",
    )  # fmt: skip
    ap.add_argument(
        "--one-stack", action="store_true",
        help="one variant's stack up at a time (a device that holds one copy of the model): "
        "each variant's warm-up and repeats in turn, not alternating",
    )  # fmt: skip
    ap.add_argument("--host-gib", type=float, default=4.0, help="the node's host KV store")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--out", default="docs/results/agent_trace.json")


def run(args: argparse.Namespace) -> dict:
    if args.sessions < 1 or args.concurrency < 1 or args.turns < 1 or args.repeats < 1:
        raise SystemExit("--sessions, --concurrency, --turns and --repeats: at least 1")
    base = stack_config(args)
    need = args.system + args.first + (args.turns - 1) * (args.question + 2 * args.new_tokens)
    if need + args.new_tokens > base.max_model_len:
        raise SystemExit(f"a conversation may reach {need} tokens, past {base.max_model_len}")
    variants = {WITH: base, WITHOUT: replace(base, prefix_cache=False)}
    encode = load_tokenizer(args.model).encode
    name = Path(args.model).name
    source = prompt_source(args.model, args.prompts_from)
    warm = heldout_prompts(source, 1, 64, args.seed - 1)[0]
    warmups = [
        Trace.draw(source, args, args.seed - 100 * (w + 1)) for w in range(args.warmup_traces)
    ]
    traces = [Trace.draw(source, args, args.seed + 10 * r) for r in range(args.repeats)]
    runs: dict[str, list[dict]] = {v: [] for v in variants}

    def warm_up(v: str, stack: Stack) -> None:
        """The first requests compile and map; then traces of the timed ones' shape capture
        the graphs and compile the prefill shapes the timed traces meet (their prompts are
        their own: none of the timed traces' pages is cached by them but what every trace's
        shape shares)."""
        with httpx.Client(base_url=stack.base, timeout=600) as c:
            stream_turn(c, name, warm, 8)
        for w, trace in enumerate(warmups):
            got = run_trace(stack, name, trace, args, encode)
            print(f"warm-up {w + 1} {v}: {got['wall_s']:.1f} s", flush=True)

    def timed(v: str, stack: Stack, r: int) -> None:
        got = run_trace(stack, name, traces[r], args, encode)
        runs[v].append(got)
        shown = {
            k: round(got[k], 3)
            for k in ("wall_s", "output_tok_per_s", "computed_share", "first_ttft_p50_s")
        }
        print(f"repeat {r + 1} {v}: {json.dumps(shown)}", flush=True)
        print(f"  worker: {json.dumps(got['worker'])}", flush=True)

    built: dict[str, list[str]] = {}  # the kernels each worker built once it served
    with tempfile.TemporaryDirectory() as logs:
        if args.one_stack:  # each variant whole while its stack is up
            for v, cfg in variants.items():
                with Stack(cfg, args.model, int(args.host_gib * 2**30), logs) as stack:
                    warm_up(v, stack)
                    for r in range(args.repeats):
                        timed(v, stack, r)
                    built[v] = stack.log_lines(WHILE_SERVING)
        else:  # both up; the variants alternate which goes first (A B, B A, ...)
            with contextlib.ExitStack() as up:
                stacks = {
                    v: up.enter_context(Stack(cfg, args.model, int(args.host_gib * 2**30), logs))
                    for v, cfg in variants.items()
                }
                for v, stack in stacks.items():
                    warm_up(v, stack)
                for r in range(args.repeats):
                    for v in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                        timed(v, stacks[v], r)
                built.update({v: stack.log_lines(WHILE_SERVING) for v, stack in stacks.items()})
    summary = _summary(runs)
    ratio = summary["throughput_with_over_without"]
    noise = summary["noise"]
    print(f"throughput with / without prefix reuse: {ratio:.2f} (goal {GOAL_THROUGHPUT_RATIO}); "
          f"noise (spread of repeats) {'-' if noise is None else f'{noise:.1%}'}; prompt computed "
          f"{summary['computed_share'][WITH]:.1%} with, {summary['computed_share'][WITHOUT]:.0%} "
          f"without; texts equal {summary['same_text']:.0%}; acceptance with / without "
          f"{summary['acceptance_with_over_without']}")  # fmt: skip
    return {
        "benchmark": "agent-trace",
        "machine": platform.machine(),
        "model": args.model,
        "device": args.device,
        "mode": base.mode,
        "drafter": args.drafter,
        "trace": {k: getattr(args, k) for k in ("sessions", "concurrency", "system", "first",
                                                "question", "new_tokens", "turns", "repeats",
                                                "warmup_traces", "answers", "one_stack", "host_gib")},
        "prompts_from": source,
        "goal_throughput_ratio": GOAL_THROUGHPUT_RATIO,
        "meets_goal": ratio >= GOAL_THROUGHPUT_RATIO,
        "summary": summary,
        "runs": {v: [{k: x for k, x in r.items() if k != "texts"} for r in rs]
                 for v, rs in runs.items()},
        "kernels_built_while_serving": built,
    }  # fmt: skip


def _summary(runs: dict[str, list[dict]]) -> dict:
    """Throughput with ÷ without (means of the repeats, and per repeat), the noise (the largest
    spread of one variant's repeats, relative to their mean), the shares of prompt computed, the
    later turns' time to first token and the share of equal texts."""
    tput = {v: statistics.mean(r["output_tok_per_s"] for r in rs) for v, rs in runs.items()}
    tputs = [[r["output_tok_per_s"] for r in rs] for rs in runs.values()]
    # one repeat gives no spread to state
    spread = (
        max((max(x) - min(x)) / statistics.mean(x) for x in tputs)
        if all(len(x) > 1 for x in tputs)
        else None
    )
    pairs = [
        (a, b)
        for ra, rb in zip(runs[WITH], runs[WITHOUT], strict=True)
        for a, b in zip(ra["texts"], rb["texts"], strict=True)
    ]
    return {
        "throughput_with_over_without": tput[WITH] / tput[WITHOUT],
        "per_repeat": [
            a["output_tok_per_s"] / b["output_tok_per_s"]
            for a, b in zip(runs[WITH], runs[WITHOUT], strict=True)
        ],
        "output_tok_per_s": tput,
        "noise": spread,
        "computed_share": {
            v: statistics.mean(r["computed_share"] for r in rs) for v, rs in runs.items()
        },
        "tpot_p50_s": {v: statistics.mean(r["tpot_p50_s"] for r in rs) for v, rs in runs.items()},
        "later_ttft_p50_s": {v: _mean_of(rs, "later_ttft_p50_s") for v, rs in runs.items()},
        "same_text": sum(a == b for a, b in pairs) / len(pairs),
        # acceptance with ÷ without reuse (goal: ≥ 0.98), where a drafter verified enough
        # rounds in both variants
        "verify_rounds": {v: sum(r["drafts"] for r in rs) for v, rs in runs.items()},
        "acceptance_with_over_without": _acceptance_ratio(runs),
    }


def _mean_of(rs: list[dict], key: str) -> float | None:
    """The mean of the runs' ``key``; None when a run has none (one turn: no later turn)."""
    xs = [r[key] for r in rs]
    return None if any(x is None for x in xs) else statistics.mean(xs)


def _acceptance_ratio(runs: dict[str, list[dict]]) -> float | None:
    """Acceptance length with ÷ without reuse over each variant's rounds pooled; None where a
    variant verified fewer than ``MIN_ROUNDS`` rounds (the online policy speculates only where
    that pays: too few rounds to compare; ``--width-policy fixed`` verifies every step)."""
    pooled = []
    for v in (WITH, WITHOUT):
        drafts = sum(r["drafts"] for r in runs[v])
        if drafts < MIN_ROUNDS:
            return None
        accepted = sum((r["acceptance_length"] - 1) * r["drafts"] for r in runs[v])
        pooled.append(1 + accepted / drafts)
    return pooled[0] / pooled[1]
