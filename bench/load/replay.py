"""Replayed selections (bench only): the rows a decode step's producers select follow the
shipped model's recorded selections (``bench census --trace``, ``docs/results/census_trace.npz``:
per decode step and index producer, the k0 positions the trained model selected after a prompt
of n0 tokens), mapped onto the served model's producers, top-k and context.

The producers still run (their keys are written and their scores computed, so a step costs
what it costs); ``ReplayPayload`` wraps an engine's payload backend (``KVCache.payload``, the
one the model resolves selections through) and hands it the replayed rows in place of the
selection of every query at or past the prompt's end (decode steps and verify rounds), for
each producer and the followers that share its selection. Nothing in ``services/`` changes:
the engine serves exactly the rows it is given, as it serves the indexer's.

The mapping (``replay_table``), for a served model with top-k ``k``, P producers and prompts of
L tokens, from a trace of T0 steps, P0 producers, top-k k0 at context n0:

- **expansion** e = max(1, k // k0): each trace row stands for e served rows;
- **history rows** (trace row r < n0): r -> the e rows ``floor(r * s) + i`` (i < e) with
  s = A / n0 and A = L - e * T0 (the absolute region ends where the recent one can begin).
  One trace row always maps to the same served rows, so every recurrence of a row in the trace
  (which steps it is selected at, hence its reuse distances) is a recurrence of its e rows.
  With s >= e the images are disjoint; with s < e (a short served context) rows that fall
  together are selected once (the trace is contracted);
- **recent rows** (trace rows the trace's decode wrote, r = n0 + g, selected at step t at
  distance d = t - g behind the query): the e rows at distances ``d * e + i`` behind the served
  query, so they move with it as they did (they are the tail's);
- **order and size**: a step's recent rows first, then its history rows in the trace's order
  (score descending), duplicates dropped, cut at k; -1 pads a shorter selection;
- **layers**: served producer j replays trace producer ``j mod P0``, ``j // P0`` steps later
  (so producers that share a trace producer do not select in lockstep); followers take their
  producer's, as always; a drafter's layer over a lagged source (the MTP layer, its own
  indexer) comes after the target's producers and replays as they do, its recent rows counted
  behind the last row its pass completes (``position - lag``): a random model's MTP indexer
  selects without the trained model's locality, and a round's host reads would be its own;
- **steps**: served decode offset u = query position - L; the trace's steps are walked forth
  and back (0, 1, ..., T0-1, T0-2, ..., 0, 1, ...), so every pair of consecutive served steps is
  a pair of consecutive trace steps: the step-to-step overlap is the trace's exactly, reuse
  distances up to T0 - 1 steps are the trace's, longer ones fold.

What it preserves: per producer, which rows recur from step to step and after how many steps
(the reuse distance distribution of selected rows, up to T0 - 1 steps; hence an LRU hot cache
of e·B rows hits as the trace's does with B: ``lru_census``, ``trace_census``), the share
selected in each fraction of the history (positions scale with the context) and the recent
rows' distances (times e: with e·T0 at most the tail ring's rows they resolve direct, as the
trace's did). What it does not keep: reuse over more than T0 - 1 steps (a 1K-token output
walks a 32-step trace forth and back 33 times: its longer reuse is the walk's, not the
model's); the share served direct (the trace's tail ring covers its prompt's last rows during
its first steps; served, those rows are history rows, hot or host); differences between
sessions (every session replays the same table; its position decides its step); and, with
k < k0 (a tiny preset), the trace's reuse (a step keeps its recent rows and its best-ranked
history rows only). ``tests/bench/test_load_replay.py`` checks the real dimensions' step-to-step
overlap and hit rate against the trace's, ``lru_census`` against the engine's committed census,
and a tiny engine's census against ``lru_census`` over the rows it was given.

``trace_for`` picks the trace's context: the largest recorded n0 whose spread s is at least e,
else the smallest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dhisparse.family.config import ModelConfig
from services.worker.kv.batch import ForwardBatch

PAD = np.iinfo(np.uint16).max  # bench/census.py's padding of a trace
TRACE = Path(__file__).resolve().parents[2] / "docs" / "results" / "census_trace.npz"
WEIGHTS = "trained"  # the shipped model's selections (not its random twin's)


@dataclass(frozen=True)
class SelectionTrace:
    """One recorded trace: ``rows`` [T0, P0, k0] int64 positions (-1 pads) after a prompt of
    ``context`` tokens; step t's query is at position ``context + t``."""

    context: int
    rows: np.ndarray
    source: str  # file and key

    @property
    def steps(self) -> int:
        return self.rows.shape[0]

    def __post_init__(self) -> None:
        if self.rows.ndim != 3 or self.rows.shape[0] < 2:
            raise ValueError("a trace has [steps >= 2, producers, k] positions")

    @property
    def k(self) -> int:
        return self.rows.shape[2]


def load_traces(path: Path = TRACE, weights: str = WEIGHTS) -> list[SelectionTrace]:
    """Every context's trace of ``weights`` in ``path``, by context."""
    with np.load(path) as z:
        out = []
        for key in z.files:
            name, _, ctx = key.rpartition("_")
            if name == weights:
                raw = z[key].astype(np.int64)
                out.append(SelectionTrace(int(ctx), np.where(raw == PAD, -1, raw),
                                          f"{path.name}:{key}"))  # fmt: skip
    if not out:
        raise ValueError(f"no {weights!r} trace in {path}")
    return sorted(out, key=lambda t: t.context)


def expansion(k: int, trace: SelectionTrace) -> int:
    return max(1, k // trace.k)


def absolute_end(context: int, k: int, trace: SelectionTrace) -> int:
    """A: history rows map below it; recent rows lie at or above it at every decode step."""
    end = context - expansion(k, trace) * trace.steps
    if end <= 0:
        raise ValueError(f"a context of {context} leaves no history for the trace's rows")
    return end


def trace_for(context: int, k: int, traces: list[SelectionTrace]) -> SelectionTrace:
    """The largest recorded context whose rows spread at least e apart (module docstring)."""
    fits = [t for t in traces if absolute_end(context, k, t) >= expansion(k, t) * t.context]
    return fits[-1] if fits else traces[0]


def replay_table(trace: SelectionTrace, producers: int, k: int, context: int) -> np.ndarray:
    """[producers, T0, k] int32: entry >= 0 a row, -1 a pad, <= -2 the row ``-(entry + 2)``
    behind the query (module docstring)."""
    e = expansion(k, trace)
    n0, t0 = trace.context, trace.steps
    spread = absolute_end(context, k, trace) / n0
    out = np.full((producers, t0, k), -1, dtype=np.int32)
    lanes = np.arange(e)
    for j in range(producers):
        src = j % trace.rows.shape[1]
        for t in range(t0):
            sel = trace.rows[t, src]
            sel = sel[sel >= 0]
            recent = sel[sel >= n0]
            dist = (t - (recent - n0))[:, None] * e + lanes  # behind the query
            old = sel[sel < n0]
            rows = (np.floor(old * spread).astype(np.int64)[:, None] + lanes).reshape(-1)
            _, first = np.unique(rows, return_index=True)  # contracted rows selected once
            rows = rows[np.sort(first)]
            entries = np.concatenate([-(dist.reshape(-1) + 2), rows])[:k]
            out[j, t, : len(entries)] = entries
    return out


def trace_step(u, producer: int, p0: int, t0: int):
    """The trace step of served decode offset ``u`` (an int array or tensor) for served
    producer ``producer``: forth and back over T0 steps, ``producer // p0`` steps later."""
    period = 2 * (t0 - 1)
    v = (u + producer // p0) % period
    if isinstance(v, torch.Tensor):
        return torch.where(v >= t0, period - v, v)
    return np.where(v >= t0, period - v, v)


def decode_rows(table: np.ndarray, producer: int, p0: int, position: int,
                context: int) -> np.ndarray:  # fmt: skip
    """The rows served producer ``producer`` selects for a query at ``position`` (>= context),
    -1 pads: what ``Replay.rows`` computes on the device, for references."""
    step = int(trace_step(np.asarray(position - context), producer, p0, table.shape[1]))
    entry = table[producer, step].astype(np.int64)
    return np.where(entry >= 0, entry, np.where(entry <= -2, position + entry + 2, -1))


def lru_census(steps: list[tuple[int, np.ndarray]], capacity: int, tail: int) -> dict:
    """How one source's selections are served (the resolver's census, DESIGN §3), simulated:
    ``steps`` [(query position p, selected rows)], rows above ``p - tail`` direct (the tail
    ring), the others hot when an LRU of ``capacity`` rows holds them, else read from the host
    and cached (victims: the least recently used rows not selected in the step).
    Returns {direct, hot, host} row counts."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    out = {"direct": 0, "hot": 0, "host": 0}
    for p, rows in steps:
        rows = rows[rows >= 0]
        older = rows[rows <= p - tail]
        out["direct"] += len(rows) - len(older)
        hits = [int(r) for r in older if int(r) in cache]
        misses = [int(r) for r in older if int(r) not in cache]
        out["hot"] += len(hits)
        out["host"] += len(misses)
        used = set(hits)
        for r in hits:
            cache.move_to_end(r)
        for r in misses:
            if len(cache) >= capacity:
                victim = next((x for x in cache if x not in used), None)
                if victim is None:
                    continue  # every entry holds a row of this step
                del cache[victim]
            used.add(r)
            cache[r] = None
    return out


def mapped_census(traces: list[SelectionTrace], context: int, k: int, hot_rows: int, tail: int,
                  warmup: int) -> dict:  # fmt: skip
    """The census a session alone shows at ``context`` under the replay (``trace_for``'s
    trace, every trace producer once), over the trace's steps after ``warmup`` steps from an
    empty cache: shares {direct, hot, host} and where they come from."""
    trace = trace_for(context, k, traces)
    p0 = trace.rows.shape[1]
    table = replay_table(trace, p0, k, context)
    total = {"direct": 0, "hot": 0, "host": 0}
    for j in range(p0):
        seq = [(context + u, decode_rows(table, j, p0, context + u, context))
               for u in range(trace.steps)]  # fmt: skip
        warm, every = lru_census(seq[:warmup], hot_rows, tail), lru_census(seq, hot_rows, tail)
        for key in total:
            total[key] += every[key] - warm[key]
    rows = sum(total.values())
    return {key: v / rows for key, v in total.items()} | {
        "trace": trace.source, "expansion": expansion(k, trace), "hot_rows": hot_rows,
        "tail_rows": tail, "steps": trace.steps - warmup,
    }  # fmt: skip


def trace_census(trace: SelectionTrace, capacity: int, tail: int, steps: int) -> dict:
    """``lru_census`` over the trace itself (its first ``steps`` steps, every producer's own
    cache), summed: the locality a replay at expansion e shows with ``capacity * e`` hot rows
    and a ``tail * e`` row tail."""
    total = {"direct": 0, "hot": 0, "host": 0}
    for j in range(trace.rows.shape[1]):
        seq = [(trace.context + t, trace.rows[t, j]) for t in range(steps)]
        for key, v in lru_census(seq, capacity, tail).items():
            total[key] += v
    return total


class Replay:
    """Replayed selections for prompts of ``context`` tokens: the rows each layer attends for a
    query at or past the prompt's end (module docstring)."""

    def __init__(self, cfg: ModelConfig, trace: SelectionTrace, context: int,
                 device: torch.device | str) -> None:  # fmt: skip
        lag = {i: cfg.sources[cfg.layers[i].source].lag for i in cfg.index_producers}
        # the target's producers, then a drafter's over a lagged source (the MTP layer's)
        target = [i for i in cfg.index_producers if not lag[i]]
        drafts = [i for i in cfg.index_producers if lag[i]]
        if any(cfg.sources[cfg.layers[i].source].compress != 1 for i in target + drafts):
            raise ValueError("replayed selections cover uncompressed sources only")
        self.context = context
        self.trace = trace
        self.targets = len(target)  # producers a target pass resolves; drafts' come after
        self.producer = {layer: j for j, layer in enumerate(target + drafts)}
        self.lag = {layer: lag[layer] for layer in self.producer}
        # every layer that resolves a selection of a replayed producer -> that producer
        self.leader = {i: (i if spec.index == "producer" else spec.leader)
                       for i, spec in enumerate(cfg.layers)
                       if spec.index in ("producer", "follower")}  # fmt: skip
        self.leader = {i: p for i, p in self.leader.items() if p in self.producer}
        self.p0 = trace.rows.shape[1]
        self.spread = absolute_end(context, cfg.index_topk, trace) / trace.context
        self.table_np = replay_table(trace, len(self.producer), cfg.index_topk, context)
        self.table = torch.from_numpy(self.table_np).to(device=device, dtype=torch.int64)

    def rows(self, layer: int, batch: ForwardBatch, own: torch.Tensor) -> torch.Tensor:
        """[N, k] the rows ``layer`` attends: the replay's for queries at or past the prompt's
        end, ``own`` (the model's selection) for the others and for layers not replayed.
        Tensor operations only: a captured decode graph replays them."""
        lead = self.leader.get(layer)
        if lead is None:
            return own
        j = self.producer[lead]
        pos = batch.positions.to(torch.int64)
        u = (pos - self.context).clamp(min=0)
        entry = self.table[j][trace_step(u, j, self.p0, self.table.shape[1])]  # [N, k]
        last = pos[:, None] - self.lag[lead]  # the last row this pass completes
        rows = torch.where(entry >= 0, entry, torch.where(entry <= -2, last + entry + 2,
                                                          torch.full_like(entry, -1)))  # fmt: skip
        return torch.where((pos >= self.context)[:, None], rows, own)


class ReplayPayload:
    """An engine's payload backend (``KVCache.payload``) whose resolutions take the replay's
    rows instead of the selection the model computed: the model still runs its indexer (its
    keys written, its scores and top-k computed), and the backend serves exactly the rows it
    is given, as it serves the indexer's. Everything else is the backend's own."""

    def __init__(self, inner, replay: Replay) -> None:
        self._inner = inner
        self._replay = replay

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def resolve(self, layer: int, source: int, batch: ForwardBatch,
                selection: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return self._inner.resolve(layer, source, batch, self._replay.rows(layer, batch,
                                                                           selection))  # fmt: skip

    def prefetch(self, layers: list[tuple[int, int]], batch: ForwardBatch,
                 selection: torch.Tensor) -> None:  # fmt: skip
        """Followers of one producer share its selection: the replay's, when it has one."""
        rows = self._replay.rows(layers[0][0], batch, selection) if layers else selection
        self._inner.prefetch(layers, batch, rows)


def predicted_census(replay: Replay, cfg: ModelConfig, hot_rows: int, tail: int,
                     steps: int) -> dict:  # fmt: skip
    """The census one session alone shows over its first ``steps`` decode steps under
    ``replay`` (``lru_census`` per layer's source, each over its producer's rows), as shares of
    the rows resolved: what a hierarchy engine with ``hot_rows`` hot rows and a ``tail``-row
    ring should count (a decode step's: the target's producers, no drafter's)."""
    layers = {j: 0 for j in replay.producer.values() if j < replay.targets}
    for i, spec in enumerate(cfg.layers):
        lead = i if spec.index == "producer" else spec.leader
        if spec.index in ("producer", "follower") and replay.producer.get(lead, -1) in layers:
            layers[replay.producer[lead]] += 1
    total = {"direct": 0, "hot": 0, "host": 0}
    for j, n in layers.items():
        seq = [(replay.context + u, decode_rows(replay.table_np, j, replay.p0,
                                                replay.context + u, replay.context))
               for u in range(steps)]  # fmt: skip
        for key, v in lru_census(seq, hot_rows, tail).items():
            total[key] += n * v
    rows = sum(total.values())
    return {key: v / rows for key, v in total.items()} | {"steps": steps, "hot_rows": hot_rows,
                                                          "tail_rows": tail}  # fmt: skip


def install(eng, replay: Replay) -> None:
    """Serves ``eng``'s decode steps the replay's rows (before its first pass: captured graphs
    hold the replay)."""
    if isinstance(eng.kv.payload, ReplayPayload):
        raise ValueError("a replay is installed already")
    eng.kv.payload = ReplayPayload(eng.kv.payload, replay)


def replay_for(model, context: int, traces: list[SelectionTrace]) -> Replay:
    """The replay of ``trace_for``'s trace for ``model`` at prompts of ``context`` tokens."""
    trace = trace_for(context, model.cfg.index_topk, traces)
    return Replay(model.cfg, trace, context, next(model.parameters()).device)
