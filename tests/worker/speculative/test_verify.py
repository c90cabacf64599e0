"""Verification (Leviathan et al., 2023): greedy prefixes, corrections and bonuses exactly;
with sampling, the law of the emitted tokens, tested for goodness of fit at α = 1e-3."""

from __future__ import annotations

import pytest
import torch

from services.worker.request.request import SamplingParams
from services.worker.speculative.verify import (
    Verdict,
    target_probs,
    verify,
    verify_batch,
    verify_greedy,
    verify_sampling,
)
from tests.worker.speculative.stats import chi2_test

ALPHA = 1e-3
V = 8
TRIALS = 20_000


# ---- greedy ---------------------------------------------------------------------------------
def _logits_with_argmax(best: list[int], vocab: int = 10) -> torch.Tensor:
    x = torch.randn(len(best), vocab, generator=torch.Generator().manual_seed(0))
    x[torch.arange(len(best)), torch.tensor(best)] = 100.0
    return x


@pytest.mark.parametrize(
    ("drafts", "want"),
    [
        ([1, 2, 3], Verdict(3, 4)),  # all accepted: the bonus is the last argmax
        ([1, 2, 9], Verdict(2, 3)),  # a mismatch at the last proposal: its argmax corrects it
        ([5, 2, 3], Verdict(0, 1)),  # a mismatch first: later matches do not count
        ([1, 7, 3], Verdict(1, 2)),
        ([], Verdict(0, 1)),  # no proposals: plain decoding
    ],
)
def test_greedy_accepts_the_matching_prefix(drafts: list[int], want: Verdict) -> None:
    logits = _logits_with_argmax([1, 2, 3, 4][: len(drafts) + 1])
    drafts_t = torch.tensor(drafts, dtype=torch.int64)
    assert verify_greedy(logits, drafts_t) == want
    assert verify(logits, drafts_t, None, SamplingParams(temperature=0.0), None) == want


def test_verify_checks_the_block_size() -> None:
    with pytest.raises(ValueError):
        verify(torch.zeros(3, V), torch.zeros(3, dtype=torch.int64), None, SamplingParams(), None)


# ---- sampling: the emitted tokens follow the target ----------------------------------------
def _dist(shape: tuple[int, ...], g: torch.Generator, scale: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, V, generator=g, dtype=torch.float64) * scale, -1)


class World:
    """A toy target and drafter over V tokens and a block of K = 3: the target's laws of the
    first, second and third token given the earlier ones (p0, p1[x1], p2[x1, x2]) and the
    drafter's proposal laws (q1, q2[x1])."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.p0, self.p1, self.p2 = _dist((), g), _dist((V,), g), _dist((V, V), g)
        self.q1, self.q2 = _dist((), g), _dist((V,), g)

    def run(self, verifier, trials: int, seed: int, deterministic: bool = False):
        """-> emitted tokens per trial (1 to 3 of them)."""
        gd = torch.Generator().manual_seed(seed)
        gv = torch.Generator().manual_seed(seed + 1)
        if deterministic:  # a drafter that always proposes its mode: q is one-hot
            x1 = torch.full((trials,), int(self.q1.argmax()))
            x2 = self.q2.argmax(-1)[x1]
        else:
            x1 = torch.multinomial(self.q1, trials, replacement=True, generator=gd)
            x2 = torch.multinomial(self.q2[x1], 1, generator=gd).squeeze(1)
        out = []
        for a, b in zip(x1.tolist(), x2.tolist(), strict=True):
            probs = torch.stack([self.p0, self.p1[a], self.p2[a, b]]).float()
            q = None if deterministic else torch.stack([self.q1, self.q2[a]]).float()
            n, nxt = verifier(probs, torch.tensor([a, b]), q, gv)
            out.append([*[a, b][:n], nxt])
        return out

    def fit(self, emitted: list[list[int]]) -> dict[str, float]:
        """p-values of: the first token ~ p0; the second given the first ~ p1[y1] (rounds that
        emitted at least two tokens); the third given both ~ p2[y1, y2] (the bonus)."""
        first = torch.zeros(V)
        second = torch.zeros(V, V)
        third = torch.zeros(V, V, V)
        for ys in emitted:
            first[ys[0]] += 1
            if len(ys) >= 2:
                second[ys[0], ys[1]] += 1
            if len(ys) == 3:
                third[ys[0], ys[1], ys[2]] += 1
        return {
            "first": chi2_test([(first, self.p0)])[0],
            "second": chi2_test([(second[a], self.p1[a]) for a in range(V)])[0],
            "third": chi2_test([(third[a, b], self.p2[a, b]) for a in range(V) for b in range(V)])[
                0
            ],
        }


@pytest.mark.parametrize("deterministic", [False, True], ids=["q-sampled", "q-one-hot"])
def test_sampling_emits_the_target_law(deterministic: bool) -> None:
    """H0: the emitted tokens are distributed as the target's. Pearson's chi-square test at
    α = 1e-3 over 20,000 rounds with fixed seeds (so the verdict is deterministic)."""
    world = World(seed=11)
    emitted = world.run(verify_sampling, TRIALS, seed=5, deterministic=deterministic)
    pvals = world.fit(emitted)
    assert min(pvals.values()) > ALPHA, pvals
    # Some rounds end at each stage, so each law was actually exercised.
    lengths = {len(ys) for ys in emitted}
    assert lengths == {1, 2, 3}


def _biased(probs, drafts, q, g) -> Verdict:
    """A wrong rule: on rejection, resample from p instead of the residual."""
    k = probs.shape[0]
    for i, x in enumerate(drafts.tolist()):
        if float(torch.rand((), generator=g, dtype=torch.float64)) * float(q[i, x]) > float(
            probs[i, x]
        ):
            return Verdict(i, int(torch.multinomial(probs[i], 1, generator=g)))
    return Verdict(k - 1, int(torch.multinomial(probs[k - 1], 1, generator=g)))


def test_the_law_test_rejects_a_wrong_rule() -> None:
    """Power check: the same test, same seeds, catches resampling from p on rejection."""
    world = World(seed=11)
    pvals = world.fit(world.run(_biased, 3000, seed=5))
    assert pvals["first"] < ALPHA and pvals["second"] < ALPHA, pvals


def test_top_k_top_p_filters_the_target() -> None:
    """Sampled verification runs on temperature -> top-k/top-p -> softmax (whose law the test
    above checks), so a proposal outside the kept set is never emitted."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=g) * 0.5
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    p = target_probs(logits, params)
    assert (p > 0).sum(-1).tolist() == [4, 4]
    q = torch.full((1, V), 1.0 / V)
    ga, gb = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    seen = torch.zeros(V)
    for x in range(V):
        for _ in range(40):
            v = verify(logits, torch.tensor([x]), q, params, ga)
            assert v == verify_sampling(p, torch.tensor([x]), q, gb)
            seen[x if v.num_accepted == 1 else v.next_token] += 1
    assert seen[p[0] == 0].sum() == 0
    assert (seen[p[0] > 0] > 0).all()


def test_residual_falls_back_to_p_when_empty() -> None:
    """p == q, yet the proposal has q(x) = 0 (an inconsistent drafter): rejected, and the
    correction comes from p rather than from an all-zero residual."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    v = verify_sampling(p, torch.tensor([2]), p[:1].clone(), torch.Generator().manual_seed(0))
    assert v.num_accepted == 0 and v.next_token in (0, 1)


def test_identical_draft_and_target_accept_everything() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, V, generator=g), -1)
    for _ in range(50):
        drafts = torch.multinomial(p[:3], 1, generator=g).squeeze(1)
        assert verify_sampling(p, drafts, p[:3], g).num_accepted == 3


# ---- a batch of requests --------------------------------------------------------------------
def test_verify_batch_equals_verify_per_request() -> None:
    g = torch.Generator().manual_seed(9)
    widths = [3, 1, 5, 4]
    kmax = 5
    logits = torch.randn(sum(widths), V, generator=g)
    tokens = torch.randint(0, V, (4, kmax - 1), generator=g)
    probs = torch.softmax(torch.randn(4, kmax - 1, V, generator=g), -1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=3),
        SamplingParams(temperature=1.2, top_p=0.8),
    ]
    for i, k in enumerate(widths):
        tokens[i, k - 1 :] = -1
    # make the greedy request accept its first proposal
    tokens[0, 0] = int(logits[0].argmax())
    gens = [torch.Generator().manual_seed(100 + i) for i in range(4)]
    got = verify_batch(logits, widths, tokens, probs, params, gens)
    gens = [torch.Generator().manual_seed(100 + i) for i in range(4)]
    want, start = [], 0
    for i, k in enumerate(widths):
        want.append(
            verify(
                logits[start : start + k], tokens[i, : k - 1], probs[i, : k - 1], params[i], gens[i]
            )
        )
        start += k
    assert got == want
    assert got[0].num_accepted >= 1
    with pytest.raises(ValueError):
        verify_batch(logits, [3, 1, 5], tokens[:3], probs[:3], params[:3], gens[:3])
