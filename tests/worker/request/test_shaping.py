"""``Request.shape_logits`` against a plain per-token reference, exactly: min_tokens bans,
logit_bias, the repetition penalty and the frequency and presence penalties over random logits,
prompts, outputs and draft blocks, with the output growing between calls as an engine grows it
(one token a decode step, several a verify round)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from services.worker.request.request import Request, SamplingParams

V = 48
EOS = (7,)
F32 = torch.float32


def reference(
    logits: torch.Tensor,
    prompt: Sequence[int],
    output: Sequence[int],
    drafts: Sequence[int],
    p: SamplingParams,
) -> torch.Tensor:
    """One token at a time, in plain Python over 0-d fp32 tensors."""
    out = logits.clone()
    bias = dict(p.logit_bias)
    banned = {*p.stop_token_ids, *(() if p.ignore_eos else EOS)}
    for i in range(out.shape[0]):
        history = [*output, *drafts[:i]]
        for t in range(out.shape[1]):
            x = out[i, t]
            if len(history) < p.min_tokens and t in banned:
                x = torch.tensor(float("-inf"))
            if t in bias:
                x = x + torch.tensor(bias[t], dtype=F32)
            c = history.count(t)
            r = p.repetition_penalty
            if r != 1.0 and (c > 0 or t in prompt):
                x = x / r if x > 0 else x * r
            if p.frequency_penalty != 0.0:
                x = x - torch.tensor(p.frequency_penalty, dtype=F32) * torch.tensor(c, dtype=F32)
            if p.presence_penalty != 0.0 and c > 0:
                x = x - torch.tensor(p.presence_penalty, dtype=F32)
            out[i, t] = x
    return out


def random_params(g: torch.Generator, case: int) -> SamplingParams:
    def u(lo: float, hi: float) -> float:
        return lo + (hi - lo) * float(torch.rand((), generator=g))

    on = [bool(b) for b in torch.randint(0, 2, (4,), generator=g)] if case > 0 else [True] * 4
    ids = torch.randperm(V, generator=g)[:5].tolist()
    return SamplingParams(
        max_tokens=64,
        min_tokens=int(torch.randint(0, 12, (), generator=g)),
        stop_token_ids=(3, 11),
        ignore_eos=case % 3 == 0,
        logit_bias=tuple((t, u(-100, 100)) for t in ids) if on[0] else (),
        repetition_penalty=u(0.5, 2.0) if on[1] else 1.0,
        frequency_penalty=u(-2, 2) if on[2] else 0.0,
        presence_penalty=u(-2, 2) if on[3] else 0.0,
    )


def tokens(g: torch.Generator, n: int) -> list[int]:
    # a small alphabet, so tokens repeat and counts exceed one
    return torch.randint(0, V // 3, (n,), generator=g).tolist()


@pytest.mark.parametrize("case", range(12))
def test_shaping_equals_the_per_token_reference(case: int) -> None:
    g = torch.Generator().manual_seed(case)
    params = random_params(g, case)
    req = Request(f"r{case}", tokens(g, 9), params, text=None)  # type: ignore[arg-type]
    for _ in range(6):  # decode steps and verify rounds, the output growing between them
        n = int(torch.randint(1, 6, (), generator=g))
        drafts = tokens(g, n - 1)
        logits = torch.randn(n, V, generator=g) * 4
        want = reference(logits, req.prompt_ids, req.output_ids, drafts, params)
        got = logits.clone()
        req.shape_logits(got, drafts, EOS)
        assert torch.equal(got, want)
        req.output_ids.extend([*drafts[: int(torch.randint(0, n, (), generator=g))], 1])


def test_a_request_without_bias_or_penalties_builds_nothing() -> None:
    g = torch.Generator().manual_seed(0)
    req = Request("plain", tokens(g, 9), SamplingParams(min_tokens=2), text=None)  # type: ignore[arg-type]
    req.output_ids = [4]
    logits = torch.randn(3, V, generator=g)
    got = logits.clone()
    req.shape_logits(got, [5, 6], EOS)
    assert req.penalties is None
    want = logits.clone()
    want[0, list(EOS)] = float("-inf")  # output position 1 < min_tokens; row 1 is position 2
    assert torch.equal(got, want)


def test_counts_follow_output_that_was_there_before_the_first_shaping() -> None:
    """A resumed or preempted request's first shaping counts its whole output so far."""
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3)
    req = Request("resumed", tokens(g, 5), params, text=None)  # type: ignore[arg-type]
    req.output_ids = tokens(g, 30)
    logits = torch.randn(1, V, generator=g)
    got = logits.clone()
    req.shape_logits(got, [], EOS)
    assert torch.equal(got, reference(logits, req.prompt_ids, req.output_ids, [], params))
    assert req.penalties is not None and req.penalties.in_prompt is None  # no repetition


def test_the_drafts_must_match_the_rows() -> None:
    req = Request("r", [1, 2], SamplingParams(), text=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 drafts for 2 rows"):
        req.shape_logits(torch.zeros(2, V), [1, 2], EOS)
