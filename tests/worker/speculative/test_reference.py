"""The key end-to-end property: speculative decoding with greedy sampling emits exactly the
tokens of plain greedy decoding, for every drafter on both topologies — whether the drafter is
an untrained one (almost everything rejected) or an oracle that is right most of the time
(long accepted prefixes, bonuses, and rejected rows left behind in the KV cache)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from services.worker.request.request import SamplingParams
from services.worker.speculative import ConfidenceScheduler, DFlashDrafter, DrafterConfig, Proposal
from services.worker.speculative.reference import plain_generate, speculative_generate
from tests.worker.speculative.helpers import KINDS, PRESETS, drafter, target

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
PROMPT = list(b"def spec(x):\n    return x")


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_equals_plain_decoding(kind: str, name: str) -> None:
    want = plain_generate(target(name), PROMPT, 24, GREEDY)
    got = speculative_generate(target(name), drafter(kind, name), PROMPT, 24, GREEDY)
    assert got.tokens == want
    assert got.stats.drafts >= 1 and got.stats.draft_tokens > 0


@pytest.mark.parametrize("name", PRESETS)
def test_greedy_output_with_confidence_scheduled_widths(name: str) -> None:
    """DSpark's scheduler varies K_r from round to round; the output does not change."""
    d = drafter("dspark", name)
    d.scheduler = ConfidenceScheduler(min_survival=0.3)
    got = speculative_generate(target(name), d, PROMPT, 24, GREEDY)
    assert got.tokens == plain_generate(target(name), PROMPT, 24, GREEDY)
    assert got.stats.draft_tokens < got.stats.drafts * (d.block_size - 1)  # some narrowed


class OracleDrafter(DFlashDrafter):
    """Proposes the true greedy continuation, each proposal wrong with probability ``error``
    (a DFlash pass still runs, so the ring is exercised)."""

    truth: list[int]
    error: float
    rng: torch.Generator

    def propose(
        self,
        slots: Sequence[int],
        anchors,
        num_committed: Sequence[int],
        widths: Sequence[int] | None = None,
        temperatures=0.0,
        generators=None,
    ) -> Proposal:
        prop = super().propose(slots, anchors, num_committed, widths, temperatures, generators)
        tokens = prop.tokens.clone()
        n = num_committed[0]
        for j in range(prop.widths[0] - 1):
            if n + 1 + j < len(self.truth):
                right = self.truth[n + 1 + j]
                wrong = float(torch.rand((), generator=self.rng)) < self.error
                tokens[0, j] = (right + 1) % 256 if wrong else right
        return replace(prop, tokens=tokens)


def oracle(name: str, truth: list[int], error: float, **overrides) -> OracleDrafter:
    t = target(name)
    d = OracleDrafter(DrafterConfig.for_target(t.cfg, "dflash", window=16, **overrides), t)
    d.truth, d.error, d.rng = truth, error, torch.Generator().manual_seed(0)
    return d.eval()


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("width", [8, 3])
def test_greedy_output_with_long_accepted_prefixes(name: str, width: int) -> None:
    t = target(name)
    n = 48
    want = plain_generate(t, PROMPT, n, GREEDY)
    d = oracle(name, PROMPT + want, error=0.15)
    got = speculative_generate(t, d, PROMPT, n, GREEDY, width=width)
    assert got.tokens == want
    s = got.stats
    assert s.per_position[width - 2] > 0  # some rounds accepted every proposal (a bonus)
    assert s.drafts > s.per_position[width - 2]  # and some rejected one
    assert s.acceptance_length > 1.5
    assert len(got.tokens) == n  # and it stops exactly at max_tokens


def test_sampling_is_reproducible_and_valid() -> None:
    t = target("tiny-glm")
    params = SamplingParams(temperature=0.9, top_k=50, ignore_eos=True)
    outs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(123)
        outs.append(speculative_generate(t, drafter("dspark"), PROMPT, 20, params, generator=g))
    assert outs[0].tokens == outs[1].tokens
    assert len(outs[0].tokens) == 20 and all(0 <= x < t.cfg.vocab_size for x in outs[0].tokens)
