"""Bench only: speculation with the acceptance of a trained model on a model of random weights.

A random model's MTP layer proposes what its target almost never accepts, so speculation at
real dimensions (``python -m bench scaled --drafter mtp``) would measure the MTP layer's cost
against no gain. ``AcceptanceControl`` wraps the engine's drafter: the MTP layer runs as
always (its cost is real), then its proposals are replaced by the target's own greedy
continuation (``truth``: a plain greedy run of the same prompt on the same model, made before),
corrupted so that proposal i is accepted with probability ``rates[i - 1]`` given that the ones
before it were: at the first position the draw rejects, the true token is replaced by another.
Verification stays the engine's own, so the output stays the target's greedy output, and the
acceptance the verifier measures is the configured one. Default rates: the shipped model's
MTP layer (``docs/results/acceptance.json``, greedy), ``shipped_rates``.

``force`` is the control for random models at real dimensions, where a reference cannot be
followed: their logits are nearly flat, so the last bits of a verify pass of another shape than
the reference's flip a token within a few rounds, and every later round misses. It leaves the
MTP layer's own proposals in place and decides instead how many of them each verify round
accepts: before verification reads a round's logits it draws ``a`` from the rates as above,
lifts proposal ``i``'s logit above its row's maximum for ``i <= a`` and bans proposal ``a + 1``
(the row's token is then the target's own best other token). Every pass runs as it would (the
MTP steps, a verify pass of K queries per request); the acceptance is the configured one
exactly; the output is the forced tokens, not the target's greedy continuation.

Nothing in the worker imports this module: no serving flag reaches it."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.engine.engine import Engine
from services.worker.speculative.drafters.runtime import RuntimeDrafter
from services.worker.speculative.proposal import Proposal, finish

SHIPPED = Path(__file__).resolve().parents[1] / "docs" / "results" / "acceptance.json"


def acceptance_length(rates: Sequence[float], width: int) -> float:
    """Tokens a round at ``width`` emits per request: ``1 + sum_{j<K} prod_{i<=j} c_i``."""
    total, reach = 1.0, 1.0
    for c in rates[: width - 1]:
        reach *= c
        total += reach
    return total


def rates_from_lengths(lengths: Mapping[int, float]) -> tuple[float, ...]:
    """Conditional acceptance by draft position from acceptance lengths measured at widths
    K_1 < K_2 < ...: positions K_{j-1} .. K_j - 1 share one rate, the one that gives the
    length measured at K_j after the rates before them (K_0 = 1)."""
    rates: list[float] = []
    for width in sorted(lengths):
        n = width - 1 - len(rates)
        if n < 1:
            raise ValueError(f"widths must grow: {sorted(lengths)}")
        lo, hi = 0.0, 1.0
        if (
            not acceptance_length(rates, width)
            <= lengths[width]
            <= acceptance_length(rates + [1.0] * n, width)
        ):
            raise ValueError(f"no rates give length {lengths[width]} at width {width}")
        for _ in range(60):  # bisection: the length grows with the rate
            mid = (lo + hi) / 2
            if acceptance_length(rates + [mid] * n, width) < lengths[width]:
                lo = mid
            else:
                hi = mid
        rates += [(lo + hi) / 2] * n
    return tuple(rates)


def shipped_rates(path: Path = SHIPPED) -> tuple[float, ...]:
    """The shipped model's MTP layer: its greedy acceptance lengths at K = 2, 4, 8 as rates."""
    results = json.loads(path.read_text())["results"]
    lengths = {
        r["width"]: r["acceptance_length"]
        for r in results
        if r["drafter"] == "mtp" and r["temperature"] == 0.0
    }
    if not lengths:
        raise ValueError(f"{path}: no greedy MTP acceptance lengths")
    return rates_from_lengths(lengths)


def accepted_prefix(rates: Sequence[float], proposals: int, rng: random.Random) -> int:
    """How many of ``proposals`` the round accepts: position i with probability
    ``rates[i - 1]`` once the ones before it were."""
    for i in range(proposals):
        if rng.random() >= rates[i]:
            return i
    return proposals


class AcceptanceControl:
    """The engine's drafter with its proposals under control (see the module's docstring).
    ``truth(slot)``: the token sequence (prompt and plain greedy continuation) of the request
    in ``slot``. Greedy requests only. Counters: ``rounds`` controlled, ``planned`` proposals
    planned to be accepted in them, ``misses``: rounds whose anchor was not the reference's
    (this run left the reference: its proposals stay the drafter's own)."""

    def __init__(
        self,
        inner: RuntimeDrafter,
        truth: Callable[[int], Sequence[int]],
        rates: Sequence[float],
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        if len(rates) < inner.block_size - 1 or not all(0.0 <= c <= 1.0 for c in rates):
            raise ValueError(f"need {inner.block_size - 1} rates in [0, 1], got {list(rates)}")
        self.inner = inner
        self.kind = f"{inner.kind}+control"
        self.truth = truth
        self.rates = tuple(rates)
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.rounds = self.planned = self.misses = 0

    # ---- the inner drafter's contract, unchanged --------------------------------------------
    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.inner.target_layers

    @property
    def context_window(self) -> int:
        return self.inner.context_window

    def init_ring(self, max_slots: int, page_size: int = 16) -> object:
        return self.inner.init_ring(max_slots, page_size)

    def begin(self, slot: int) -> None:
        self.inner.begin(slot)

    def release(self, slot: int) -> None:
        self.inner.release(slot)

    def append_context(self, slots, positions, features, per_slot=None) -> None:
        self.inner.append_context(slots, positions, features, per_slot)

    @torch.no_grad()
    def propose(
        self,
        slots: Sequence[int],
        anchors: torch.Tensor | Sequence[int],
        num_committed: Sequence[int],
        widths: Sequence[int] | None = None,
        temperatures: float | Sequence[float] = 0.0,
        generators: Sequence[torch.Generator | None] | None = None,
        run: object = None,
    ) -> Proposal:
        temps = [temperatures] * len(slots) if isinstance(temperatures, float) else temperatures
        if any(t > 0.0 for t in temps):
            raise ValueError("the acceptance control is for greedy requests (temperature 0)")
        prop = self.inner.propose(
            slots, anchors, num_committed, widths, temperatures, generators, run
        )
        tokens = prop.tokens.tolist()
        heads = anchors.tolist() if isinstance(anchors, torch.Tensor) else list(anchors)
        for r, slot in enumerate(slots):
            n, k = num_committed[r], prop.widths[r] - 1
            if k < 1:
                continue
            seq = self.truth(slot)
            if len(seq) < n + 1 + k:
                raise ValueError(f"slot {slot}: the reference ends at {len(seq)}, before {n + k}")
            if seq[n] != heads[r]:
                self.misses += 1
                continue
            a = accepted_prefix(self.rates, k, self.rng)
            row = list(seq[n + 1 : n + 1 + a])
            if a < k:  # any other token: the verifier rejects it
                row.append(
                    (seq[n + 1 + a] + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
                )
            tokens[r][: len(row)] = row
            self.rounds += 1
            self.planned += a
        return finish(torch.tensor(tokens, device=prop.tokens.device), None, prop.widths)


def control(
    eng: Engine,
    references: Mapping[tuple[int, ...], Sequence[int]],
    rates: Sequence[float],
    seed: int = 0,
) -> AcceptanceControl:
    """Puts ``eng``'s drafter under control; ``references``: prompt -> its plain greedy
    sequence (prompt and continuation) on the same model, for every prompt ``eng`` serves."""
    spec = eng.speculator
    if spec is None:
        raise ValueError("the engine does not speculate")

    found: dict[str, Sequence[int]] = {}  # request id -> its reference: a long prompt is
    # hashed once per request, not once per round

    def truth(slot: int) -> Sequence[int]:
        req = next(r for r in eng.scheduler.running if r.slot == slot)
        ref = found.get(req.request_id)
        if ref is None:
            ref = found[req.request_id] = references[tuple(req.prompt_ids)]
        return ref

    wrapped = AcceptanceControl(spec.drafter, truth, rates, eng.model_cfg.vocab_size, seed)
    spec.drafter = wrapped
    return wrapped


@dataclass
class ForcedAcceptance:
    """``force``'s counters: verify blocks forced, proposals forced accepted in them, and
    ``misses`` as ``AcceptanceControl`` counts them (always 0: no reference to leave)."""

    rates: tuple[float, ...]
    rng: random.Random
    rounds: int = 0
    planned: int = 0
    misses: int = 0

    def shape(self, logits: torch.Tensor, drafts: Sequence[int]) -> None:
        """A verify block's logits [K, V] (row i after the anchor and ``drafts[:i]``), in place:
        the first ``a`` proposals win their rows, proposal ``a + 1`` is banned from its row."""
        k = len(drafts)
        if k < 1:
            return
        a = accepted_prefix(self.rates, k, self.rng)
        for i in range(a):
            logits[i, drafts[i]] = logits[i].max() + 1.0
        if a < k:
            logits[a, drafts[a]] = float("-inf")
        self.rounds += 1
        self.planned += a


def force(eng: Engine, rates: Sequence[float], seed: int = 0) -> ForcedAcceptance:
    """Forces the acceptance of ``eng``'s verify rounds to ``rates`` (see the module's
    docstring) for every request added from now on; greedy requests only."""
    if eng.speculator is None:
        raise ValueError("the engine does not speculate")
    if len(rates) < eng.speculator.k_max - 1 or not all(0.0 <= c <= 1.0 for c in rates):
        raise ValueError(f"need {eng.speculator.k_max - 1} rates in [0, 1], got {list(rates)}")
    forced = ForcedAcceptance(tuple(rates), random.Random(seed))
    add = eng.add_request

    def add_request(request_id, prompt_ids, params, rank=None):
        if params.temperature > 0.0:
            raise ValueError("the acceptance control is for greedy requests (temperature 0)")
        req = add(request_id, prompt_ids, params, rank)
        own = req.shape_logits

        def shape_logits(logits, drafts, eos_token_ids):
            own(logits, drafts, eos_token_ids)
            forced.shape(logits, drafts)

        req.shape_logits = shape_logits  # type: ignore[method-assign]
        return req

    eng.add_request = add_request  # type: ignore[method-assign]
    return forced
