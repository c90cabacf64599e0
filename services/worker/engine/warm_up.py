"""Warming a worker up before it serves: a short synthetic conversation through the engine, so
that what the first requests of each kind would wait for happens at start-up instead.

On a GPU a pass that meets a kernel specialization first waits for its build (tens to hundreds
of milliseconds each: ``kernel_builds``), and a decode key is captured as a CUDA graph at its
second sighting. A fresh worker's first request paid seconds of builds, and a conversation's
second turn (a short prefill over a history imported from a cached prefix) one more build.
The warm-up runs what those requests run:

1. a prompt longer than one prefill chunk (a first chunk, and a chunk that continues one),
   then a few greedy decode steps (a decode key seen twice: captured);
2. the same conversation's next turn: its prompt, answer and a few pages more, which imports
   the first turn's pages where prefix reuse is on (from the host store in the hierarchy
   modes, shared device pages in resident mode) and prefills only the rest, then decodes
   under a grammar (``json_object``): the grammar compiler's tokenizer tables, the mask
   thread and the masks' kernel are built before a client's structured output needs them.

The requests are the engine's own, with a drafter where one is configured (its rounds warm
too). Their ids are seeded pseudo-random tokens: nothing a client sends is a hit for the
prefixes they leave behind, which the caches evict as any other (least recently used). The
engine's counters include them; the worker's metrics start after them
(``WorkerMetrics.start_after``).

It runs only on an engine with no request: a worker that resumed a dead predecessor's sessions
serves them at once instead (their clients are waiting)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.worker.engine.engine import Engine
from services.worker.engine.kernel_builds import KernelBuilds
from services.worker.request.request import Grammar, SamplingParams

DECODE_TOKENS = 4  # per turn: a decode key's second sighting is captured
SEED = 20261207


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up ran and cost."""

    requests: int
    prompt_tokens: int
    seconds: float
    kernel_builds: int  # Triton kernels built while it ran (this process's first launches)


def turn_lengths(engine: Engine) -> tuple[int, int] | None:
    """(first turn's prompt, tokens the next turn adds after the answer), or None when the
    context (or the KV pool) is too short for a conversation of two pages a turn. The first
    turn spans a prefill chunk and three pages more, where the context allows; the next adds
    two pages and a bit (a prefill past a page boundary)."""
    cfg = engine.cfg
    page = cfg.page_size
    chunk = cfg.pass_prefill_tokens
    room = min(cfg.max_model_len, engine.kv.tokens_capacity) - 2 * DECODE_TOKENS
    added = 2 * page + 7
    first = min(chunk + 3 * page + 5, room - added)
    if first < 2 * page + 1:
        return None
    return first, added


def skip_reason(engine: Engine) -> str | None:
    """Why the warm-up cannot run on ``engine`` (None: it can)."""
    if engine.request_ids():
        return "sessions resumed"
    if turn_lengths(engine) is None:
        return "the context is too short"
    return None


def warm_up(engine: Engine) -> WarmUp | None:
    """Runs the conversation through ``engine`` to completion; None when it cannot
    (``skip_reason``)."""
    lengths = turn_lengths(engine)
    if skip_reason(engine) is not None or lengths is None:
        return None
    first, added = lengths
    builds = KernelBuilds.process()
    built = builds.total
    g = torch.Generator().manual_seed(SEED)
    vocab = engine.model_cfg.vocab_size
    ids = torch.randint(0, vocab, (first + added,), generator=g).tolist()
    plain = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=DECODE_TOKENS, grammar=Grammar("json_object")
    )
    t0 = time.perf_counter()
    prompt = ids[:first]
    sent = 0
    for turn, params in enumerate((plain, constrained)):
        req = engine.add_request(f"warm-up-{turn}-{time.monotonic_ns()}", prompt, params)
        sent += len(prompt)
        while engine.has_work():
            engine.step()
        prompt = prompt + list(req.output_ids) + ids[first:]
    return WarmUp(2, sent, time.perf_counter() - t0, builds.total - built)
