"""How many passes of ``python -m bench spec``'s closed loop would replay a CUDA graph, capture
one, or run eagerly: counted on the CPU, with the engine's own graph keys and capture schedule.

    python -m bench graph-keys --concurrency 16,64 --configs none,dflash/paper

For each configuration and C it runs the benchmark's closed loop (its warm-up, then the measured
loop) with every pass eager, while ``pass_key``/``draft_key`` and a ``CaptureSchedule`` (a key
captured at its second sighting, as many held as the engine holds) stand in for the engine's
CUDA graphs. It counts decode and verify passes and the drafter's block passes over the window
the benchmark's rate is measured in (while some client still has a request to send). A short GPU run pays for
every capture there, which long serving spreads thin.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from bench import spec
from bench.core.lockstep import lockstep
from bench.core.output import write_result
from services.worker.engine.engine import Engine
from services.worker.graphs.cuda_graph import (
    CaptureSchedule,
    DecodeGraphs,
    draft_key,
    eager_logits,
    graph_limit,
    mtp_key,
    pass_key,
)


class KeyCounter:
    """Stands in for an engine's ``DecodeGraphs`` and its drafter's ``DraftGraphs``: runs every
    pass eagerly, counting what the graphs would have done (the MTP layer's draft steps as
    their own kind, ``mtp``; the decode graphs hold them beside the passes)."""

    def __init__(self, eng: Engine, max_width: int) -> None:
        self.model, self.kv = eng.model, eng.kv
        self.max_batch, self.max_width = eng.cfg.max_num_seqs, max_width  # by ``covers``
        self.drafter = eng.speculator.drafter if eng.speculator is not None else None
        # as the engine: decode and verify passes share their graphs' schedule and limit with
        # the MTP layer's draft steps; the drafter's block passes have their own
        decode = CaptureSchedule(graph_limit(self.max_batch), 2, False)
        self.schedules = {
            "pass": decode,
            "draft": CaptureSchedule(max(64, 2 * self.max_batch), 2, False),
            "mtp": decode,
        }
        self.counts = {kind: Counter() for kind in self.schedules}
        self.counting = False
        self.mtp_blocks = False  # the MTP layer's draft steps counted one by one

    @property
    def _distinct(self) -> list[CaptureSchedule]:
        """The schedules, each once (passes and MTP steps share one)."""
        return list({id(s): s for s in self.schedules.values()}.values())

    @property
    def captures(self) -> int:
        """Keys captured so far, over every schedule (the speculator's cold rounds read it)."""
        return sum(s.captures for s in self._distinct)

    @property
    def eager(self) -> int:
        """Passes run eagerly before their key was captured, over every schedule."""
        return sum(s.eager for s in self._distinct)

    def _count(self, kind: str, key: tuple) -> None:
        sched = self.schedules[kind]
        graph, capture = sched.lookup(key)
        if capture:
            sched.store(key, True)
        if self.counting:
            self.counts[kind]["replay" if graph else "capture" if capture else "eager"] += 1

    covers = DecodeGraphs.covers

    def logits(self, tokens, batch, features=None):
        self.kv.payload.begin(batch)
        self._count("pass", pass_key(self.kv.payload.pass_state, batch, features))
        return eager_logits(self.model, self.kv, tokens, batch, features)

    def mtp_step(self, tokens, batch, hidden, selection, hot=None):
        self.kv.payload.begin(batch)
        state = self.kv.payload.pass_state
        self._count("mtp", mtp_key(state, batch, hidden is not None, selection is not None))
        return self.model.mtp_step(tokens, batch, self.kv, hidden, selection, False, hot)

    def draft(self, slots, num_committed, anchors, temperatures, noise):
        self._count("draft", draft_key(slots, noise))
        assert self.drafter is not None
        return self.drafter.draft(slots, num_committed, anchors, temperatures, noise)


def count(args, name: str, c: int, prompts: list[list[int]]) -> dict:
    drafter, policy = (None, "fixed") if name == "none" else name.split("/")
    eng = Engine(spec.config(args, drafter, policy, 1 if drafter is None else 8))
    keys = KeyCounter(eng, eng.speculator.k_max if eng.speculator is not None else 1)
    eng.passes.graphs = keys  # type: ignore[assignment]
    if eng.speculator is not None:
        eng.speculator.graphs = keys  # type: ignore[assignment]
    lockstep([spec.closed_loop(eng, prompts[:c], args, args.warmup_per_client)])
    loop = spec.closed_loop(eng, prompts[:c], args, args.requests_per_client)
    step = loop.step

    def counted_step() -> None:  # only the steps the benchmark's rate counts
        keys.counting = loop._sending(loop.clock.now())
        step()

    loop.step = counted_step  # type: ignore[method-assign]
    lockstep([loop])
    row = {"config": name, "concurrency": c, **spec.measured(loop)}
    for kind, counts in keys.counts.items():
        row.update(
            {f"{kind}_graph_{what}": counts[what] for what in ("replay", "capture", "eager")}
        )
    eng.close()
    return row


def add_arguments(ap: argparse.ArgumentParser) -> None:
    spec.add_loop_arguments(ap, "16,64")
    ap.add_argument("--configs", default="none,dflash/paper", help="none, or DRAFTER/POLICY")
    ap.add_argument("--out", default=None, help="JSON rows")
    ap.add_argument("--device", default="cpu", choices=["cpu"], help="every pass runs eagerly")


def run(args: argparse.Namespace) -> int:
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.drafter_dir = args.drafter_dir or str(Path(args.model) / "drafters")
    prompts = spec.make_prompts(args, max(args.concurrency))
    rows = []
    for c in args.concurrency:
        for name in args.configs.split(","):
            rows.append(count(args, name, c, prompts))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        doc = {"benchmark": "graph-keys", "rows": rows}
        print(f"wrote {write_result(doc, args.out)}")
    return 0
