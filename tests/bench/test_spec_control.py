"""The bench's acceptance control (``bench/spec_control.py``): rates derived from the shipped
model's acceptance lengths, the planner's per-position statistics, and, on the CPU over a
shrunk scaled preset with its MTP layer, speculation under control: greedy output unchanged
(the reference control), the verifier accepting exactly what the control planned, and the
measured acceptance length that of the configured rates (both controls)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from bench.spec_control import (
    ForcedAcceptance,
    acceptance_length,
    accepted_prefix,
    control,
    force,
    rates_from_lengths,
    shipped_rates,
)
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from services.worker.weights.model_io import build_model
from tests.worker.scaled_shrunk import VOCAB, engine, shrunk


def test_rates_reproduce_the_shipped_lengths() -> None:
    rates = shipped_rates()
    assert len(rates) == 7 and all(0.0 < c < 1.0 for c in rates)
    for k, tau in {2: 1.85, 4: 2.96, 8: 3.76}.items():  # docs/results/acceptance.json, greedy
        assert acceptance_length(rates, k) == pytest.approx(tau, abs=0.01)
    assert rates_from_lengths({3: 2.0}) == pytest.approx((1.0 / 1.618034,) * 2, abs=1e-6)
    with pytest.raises(ValueError):
        rates_from_lengths({2: 2.5})  # one proposal cannot add 1.5 tokens


def test_shipped_rates_read_the_greedy_mtp_rows(tmp_path) -> None:
    rows = [
        {"drafter": "mtp", "width": 2, "temperature": 0.0, "acceptance_length": 1.5},
        {"drafter": "mtp", "width": 2, "temperature": 1.0, "acceptance_length": 1.1},
        {"drafter": "dflash2", "width": 4, "temperature": 0.0, "acceptance_length": 1.9},
    ]
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps({"results": rows}))
    assert shipped_rates(path) == pytest.approx((0.5,))


def test_the_planner_accepts_each_position_at_its_rate() -> None:
    rates = (0.9, 0.6, 0.3)
    rng = random.Random(0)
    draws = [accepted_prefix(rates, 3, rng) for _ in range(20000)]
    reached = len(draws)
    for i, c in enumerate(rates):
        hits = sum(a > i for a in draws)
        assert hits / reached == pytest.approx(c, abs=4 * math.sqrt(c * (1 - c) / reached))
        reached = hits
    assert accepted_prefix((1.0, 1.0), 2, rng) == 2 and accepted_prefix((0.0,), 1, rng) == 0


def test_under_control_greedy_output_is_unchanged_and_acceptance_is_configured() -> None:
    d = shrunk("v32-scaled", num_hidden_layers=2)  # a dense layer and a MoE one
    model = build_model(d, seed=4, mtp=True)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (20, 37, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True)
    plain = engine(d.name, model, "resident", None)
    references = {
        tuple(p): [*p, *r.output_ids]
        for p, r in zip(prompts, plain.generate(prompts, params), strict=True)
    }
    plain.close()
    rates = (0.85, 0.6, 0.5)
    eng = engine(d.name, model, "resident", SpeculationConfig("mtp", 4, "fixed"))
    ctl = control(eng, references, rates, seed=1)
    got = [r.output_ids for r in eng.generate(prompts, params)]
    assert got == [references[tuple(p)][len(p) :] for p in prompts]
    c = eng.speculator.counters
    assert ctl.misses == 0 and c.drafts - len(prompts) <= ctl.rounds <= c.drafts
    assert ctl.rounds > 70  # a last round of one query per request proposes nothing
    assert c.accepted == ctl.planned  # the verifier accepts exactly the planned prefixes
    # within 3 standard deviations of the mean over these rounds (about 0.12); rounds near a
    # request's end verify fewer proposals, a little below K = 4's length
    want = acceptance_length(rates, 4)
    assert want - 0.45 < c.acceptance_length < want + 0.35
    eng.close()


def test_the_control_is_for_greedy_requests_with_rates_for_every_position() -> None:
    d = shrunk("glm5-scaled")
    model = build_model(d, seed=4, mtp=True)
    eng = engine(d.name, model, "resident", SpeculationConfig("mtp", 4, "fixed"))
    with pytest.raises(ValueError, match="need 3 rates"):
        control(eng, {}, (0.5, 0.5))
    ctl = control(eng, {}, (0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="greedy"):
        ctl.propose([0], [5], [3], [4], [1.0])
    eng.close()


def test_forced_acceptance_is_the_configured_one_with_the_mtp_layers_own_proposals() -> None:
    """``force``: no reference; each verify round accepts exactly the prefix drawn, whatever the
    random MTP layer proposed, and a round that rejects emits the target's own best token
    other than the rejected proposal."""
    d = shrunk("v32-scaled", num_hidden_layers=2)
    model = build_model(d, seed=4, mtp=True)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (20, 37, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True)
    rates = (0.85, 0.6, 0.5)
    eng = engine(d.name, model, "resident", SpeculationConfig("mtp", 4, "fixed"))
    forced = force(eng, rates, seed=1)
    outs = eng.generate(prompts, params)
    assert all(len(r.output_ids) == 72 for r in outs)
    c = eng.speculator.counters
    assert c.drafts - len(prompts) <= forced.rounds <= c.drafts and forced.rounds > 70
    assert c.accepted == forced.planned  # every forced prefix, and nothing more
    want = acceptance_length(rates, 4)
    assert want - 0.45 < c.acceptance_length < want + 0.35
    with pytest.raises(ValueError, match="greedy"):
        eng.add_request("sampled", prompts[0], SamplingParams(temperature=1.0, max_tokens=4))
    with pytest.raises(ValueError, match="need 3 rates"):
        force(eng, (0.5, 0.5))
    eng.close()


def test_a_forced_block_accepts_its_prefix_and_bans_the_next_proposal() -> None:
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(3))
    drafts = [7, 2, 9]
    forced = ForcedAcceptance((1.0, 0.0, 1.0), random.Random(0))
    shaped = logits.clone()
    forced.shape(shaped, drafts)  # rate 1 then 0: one accepted, the second banned
    assert shaped[0].argmax() == 7 and shaped[1, 2] == float("-inf")
    assert shaped[1].argmax() == logits[1].masked_fill(torch.arange(11) == 2, -1e9).argmax()
    assert torch.equal(shaped[2:], logits[2:])
    assert (forced.rounds, forced.planned) == (1, 1)
    forced.shape(shaped[:1], [])  # a decode step: nothing to force
    assert forced.rounds == 1
