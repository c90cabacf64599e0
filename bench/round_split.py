"""Bench only: a speculating engine's verify rounds timed whole, and their drafting apart, so a
benchmark can set a round's drafts and its verify pass and host work beside a plain step
(issue 41: the round's time split). Nothing in the worker imports this module."""

from __future__ import annotations

import time

import torch

from services.worker.engine.engine import Engine


class RoundSplit:
    """Bench only: a speculating engine's verify rounds timed whole, and their drafting apart
    (the drafter's ``propose`` until its proposals are on the device: the round reads them back
    right after, so waiting for them there moves no time), so a row can set a round's drafts and
    its verify pass and host work beside a plain step. Rounds at width 0 or 1 (a plain pass
    the online policy chose) are not counted."""

    def __init__(self, eng: Engine) -> None:
        spec = eng.speculator
        assert spec is not None, "an engine that speculates"
        self.rounds, self.round_s, self.draft_s = 0, 0.0, 0.0
        self._draft = 0.0
        cuda = eng.device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(eng.device)) if cuda else (lambda: None)
        propose, play = spec.drafter.propose, spec.round

        def timed_propose(*args, **kw):
            t0 = time.perf_counter()
            out = propose(*args, **kw)
            sync()
            self._draft += time.perf_counter() - t0
            return out

        def timed_round(reqs, memory_waits=0):
            self._draft = 0.0
            t0 = time.perf_counter()
            out = play(reqs, memory_waits)
            sync()
            if spec.counters.width > 1:
                self.rounds += 1
                self.round_s += time.perf_counter() - t0
                self.draft_s += self._draft
            return out

        spec.drafter.propose = timed_propose  # type: ignore[method-assign]
        spec.round = timed_round  # type: ignore[method-assign]

    def reset(self) -> None:
        self.rounds, self.round_s, self.draft_s = 0, 0.0, 0.0

    def row(self) -> dict:
        """Per speculative round: ms in all, drafting, and the rest (verify pass, host)."""
        n = max(self.rounds, 1)
        return {
            "rounds": self.rounds,
            "round_ms": 1e3 * self.round_s / n,
            "draft_ms": 1e3 * self.draft_s / n,
            "verify_and_host_ms": 1e3 * (self.round_s - self.draft_s) / n,
        }
