"""Speculative sampling of a request with penalties, a logit bias, min_tokens and min-p keeps
the law of plain sampling: a toy target over V tokens and a block of K = 3, each verify block
shaped by ``Request.shape_logits`` with its proposals as drafts and verified by
``verify_batch``, against plain sampling's law (one token at a time, the output grown by the
tokens before). Pearson's chi-square at α = 1e-3 over 20,000 rounds with fixed seeds."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.request.request import Request, SamplingParams
from services.worker.request.sampling import sampling_probs
from services.worker.speculative.verify import verify_batch
from tests.worker.speculative.stats import chi2_test

ALPHA = 1e-3
V = 8
TRIALS = 20_000
EOS = (7,)
PROMPT = [0, 1, 1, 3]
OUTPUT = [3, 4, 4]
PARAMS = SamplingParams(
    temperature=0.9, min_p=0.04, repetition_penalty=1.5, frequency_penalty=0.6,
    presence_penalty=0.4, logit_bias=((2, 1.0), (5, -1.5)), min_tokens=4, stop_token_ids=(6,),
    max_tokens=16,
)  # fmt: skip

# (request, logits [K, V], drafts) -> None: shapes a verify block in place
Shaper = Callable[[Request, torch.Tensor, list[int]], None]


def request(output: list[int]) -> Request:
    return Request("r", list(PROMPT), PARAMS, text=None, output_ids=list(output))  # type: ignore[arg-type]


def shape_block(req: Request, logits: torch.Tensor, drafts: list[int]) -> None:
    req.shape_logits(logits, drafts, EOS)


def shape_rows_alone(req: Request, logits: torch.Tensor, drafts: list[int]) -> None:
    """A wrong rule: each row shaped as if no proposal came before it."""
    for i in range(logits.shape[0]):
        req.shape_logits(logits[i : i + 1], [], EOS)


class World:
    """The target's raw logits of the first, second and third token given the earlier ones
    (l0, l1[x1], l2[x1, x2]) and the drafter's proposal laws (q1, q2[x1])."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.l0 = torch.randn(V, generator=g) * 1.5
        self.l1 = torch.randn(V, V, generator=g) * 1.5
        self.l2 = torch.randn(V, V, V, generator=g) * 1.5
        self.q1 = torch.softmax(torch.randn(V, generator=g), -1)
        self.q2 = torch.softmax(torch.randn(V, V, generator=g), -1)

    def plain(self, ys: list[int]) -> torch.Tensor:
        """[V] the law plain sampling draws the token after ``ys`` from."""
        raw = [self.l0, self.l1[ys[0]] if ys else None, None]
        if len(ys) == 2:
            raw[2] = self.l2[ys[0], ys[1]]
        row = raw[len(ys)].clone().unsqueeze(0)  # type: ignore[union-attr]
        request([*OUTPUT, *ys]).shape_logits(row, [], EOS)
        return sampling_probs(row[0], PARAMS)

    def run(self, shape: Shaper, trials: int, seed: int) -> list[list[int]]:
        gd = torch.Generator().manual_seed(seed)
        gv = torch.Generator().manual_seed(seed + 1)
        req = request(OUTPUT)
        x1 = torch.multinomial(self.q1, trials, replacement=True, generator=gd)
        x2 = torch.multinomial(self.q2[x1], 1, generator=gd).squeeze(1)
        out = []
        for a, b in zip(x1.tolist(), x2.tolist(), strict=True):
            logits = torch.stack([self.l0, self.l1[a], self.l2[a, b]])
            shape(req, logits, [a, b])
            q = torch.stack([self.q1, self.q2[a]]).unsqueeze(0)
            (v,) = verify_batch(logits, [3], torch.tensor([[a, b]]), q, [PARAMS], [gv])
            out.append([*[a, b][: v.num_accepted], v.next_token])
        return out

    def fit(self, emitted: list[list[int]]) -> dict[str, float]:
        """p-values of the first token, the second given the first, the third given both."""
        first = torch.zeros(V)
        second = torch.zeros(V, V)
        third = torch.zeros(V, V, V)
        for ys in emitted:
            first[ys[0]] += 1
            if len(ys) >= 2:
                second[ys[0], ys[1]] += 1
            if len(ys) == 3:
                third[ys[0], ys[1], ys[2]] += 1
        pairs = [(a, b) for a in range(V) for b in range(V)]
        return {
            "first": chi2_test([(first, self.plain([]))])[0],
            "second": chi2_test([(second[a], self.plain([a])) for a in range(V)])[0],
            "third": chi2_test([(third[a, b], self.plain([a, b])) for a, b in pairs])[0],
        }


def test_speculative_sampling_with_shaping_keeps_the_plain_law() -> None:
    world = World(seed=3)
    emitted = world.run(shape_block, TRIALS, seed=5)
    pvals = world.fit(emitted)
    assert min(pvals.values()) > ALPHA, pvals
    assert {len(ys) for ys in emitted} == {1, 2, 3}  # every stage was exercised
    # min_tokens bans the stop token at the first position only; min-p cuts some tokens
    assert all(ys[0] != 6 for ys in emitted)
    assert any(len(ys) >= 2 and ys[1] == 6 for ys in emitted)
    assert (world.plain([]) == 0).sum() > 1


def test_the_law_test_rejects_rows_shaped_without_their_drafts() -> None:
    """Power check: the same test, same seeds, catches penalties that ignore the proposals
    before a row (and min_tokens bans applied to every row)."""
    world = World(seed=3)
    pvals = world.fit(world.run(shape_rows_alone, 5000, seed=5))
    assert pvals["second"] < ALPHA, pvals
