"""The law a sampled request draws from: temperature, min-p, top-k, top-p (vLLM's order),
against a per-row reference over sets, on random logits; rows of a block as single rows."""

from __future__ import annotations

import pytest
import torch

from services.worker.request.request import SamplingParams
from services.worker.request.sampling import sample_token, sampling_probs
from services.worker.speculative.verify import target_probs

V = 40


def reference(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] -> [V]: the kept set built step by step over Python sets, then softmax over it."""
    x = row.double() / p.temperature
    probs = torch.softmax(x, -1)
    kept = [t for t in range(V) if probs[t] >= p.min_p * probs.max()]
    if 0 < p.top_k < len(kept):
        kth = sorted((float(x[t]) for t in kept), reverse=True)[p.top_k - 1]
        kept = [t for t in kept if x[t] >= kth]
    if p.top_p < 1.0:
        q = torch.softmax(x[kept], -1)
        ranked = sorted(range(len(kept)), key=lambda j: -float(q[j]))
        covered, nucleus = 0.0, []
        for j in ranked:
            if nucleus and covered > p.top_p:
                break
            nucleus.append(kept[j])
            covered += float(q[j])
        kept = nucleus
    out = torch.zeros(V, dtype=torch.float64)
    out[kept] = torch.softmax(x[kept], -1)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_sampling_probs_equal_the_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for min_p, top_k, top_p in [(0.1, -1, 1.0), (0.02, 12, 1.0), (0.05, 20, 0.8), (0.0, 8, 0.7)]:
        params = SamplingParams(temperature=0.6 + seed / 8, min_p=min_p, top_k=top_k, top_p=top_p)
        logits = torch.randn(5, V, generator=g) * 3
        got = sampling_probs(logits, params)
        want = torch.stack([reference(row, params) for row in logits])
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
        # a verify block's rows are the rows plain sampling would draw from, exactly
        assert torch.equal(target_probs(logits, params), got)
        assert all(torch.equal(sampling_probs(row, params), got[i]) for i, row in enumerate(logits))


def test_min_p_keeps_the_tokens_near_the_mode() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03]))
    params = SamplingParams(temperature=1.0, min_p=0.2)  # floor 0.1: the first three stay
    probs = sampling_probs(logits, params)
    assert (probs > 0).tolist() == [True, True, True, False, False]
    g = torch.Generator().manual_seed(0)
    assert {sample_token(logits, params, g) for _ in range(200)} == {0, 1, 2}
