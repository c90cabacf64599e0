"""The router's Triton kernel (``moe_route_triton``) under the interpreter against the torch
form (``Router.forward`` on the CPU, where ``fused`` is False), on fresh random weights,
activations and correction bias, over the released configs' groupings and smaller ones.

Sets: the kernel and the torch form rank the same fp32 choice scores, except that the kernel
evaluates sigmoid itself (a few ulps apart); random inputs have no ties that close, so the
chosen sets are equal. Weights: each is s / sum(s) * scale with s within a few ulps and the sum
of top_k terms in another order, so ``WEIGHT_REL = 16 * 2**-23`` relative (2 for sigmoid, 7
for the sum, 1 each for the division and the scale, with room)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from dhisparse.family.hf_config import MoESpec
from services.worker.model.mla_moe import Router
from services.worker.ops.moe_route_triton import route_triton, router_logits

WEIGHT_REL = 16 * 2.0**-23
D = 48
# (E, top_k, n_group, topk_group, tokens): DeepSeek-V3.2 (8 groups, top 4), GLM-5 (one group),
# the scaled presets' 64 experts, groups of 3 experts, one group kept, every group kept
CASES = [
    (256, 8, 8, 4, 5),
    (256, 8, 1, 1, 3),
    (64, 8, 8, 4, 9),
    (64, 8, 1, 1, 4),
    (12, 3, 4, 2, 6),
    (64, 6, 4, 1, 2),
    (16, 4, 4, 4, 3),
    (6, 1, 3, 2, 1),
]


def _router(seed: int, e: int, k: int, n_group: int, topk_group: int, norm: bool) -> Router:
    router = Router(MoESpec(e, 1, k, n_group, topk_group, norm, 2.5, 16), D)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, D, generator=g) * D**-0.5)
        # large enough to move choices away from the unbiased scores' top-k
        router.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.1)
    return router


def _route(router: Router, x: torch.Tensor, given: torch.Tensor | None = None):
    sp = router.spec
    logits = router_logits(x, router.weight)
    return route_triton(
        logits, router.e_score_correction_bias, sp.top_k, sp.n_group, sp.topk_group,
        sp.norm_topk_prob, sp.routed_scaling, given,
    )  # fmt: skip


def _by_expert(w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = idx.sort(dim=1)
    return w.gather(1, order), ids


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(("e", "k", "n_group", "topk_group", "n"), CASES)
def test_route_matches_the_torch_form(e, k, n_group, topk_group, n, norm) -> None:
    for seed, dtype in enumerate((torch.float32, torch.bfloat16)):
        router = _router(seed + e, e, k, n_group, topk_group, norm)
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(n, D, generator=g) * 3).to(dtype)
        router.weight.data = router.weight.data.to(dtype)
        with torch.no_grad():
            w_ref, idx_ref = router(x)
            w, idx = _route(router, x)
        assert w.dtype == torch.float32 and idx.dtype == torch.int64 and idx.shape == (n, k)
        w, ids = _by_expert(w, idx)
        w_ref, ids_ref = _by_expert(w_ref, idx_ref)
        assert torch.equal(ids, ids_ref)
        assert ((w - w_ref).abs() <= WEIGHT_REL * w_ref.abs()).all()
        # the emitted order: best choice score first
        choice = (
            F.linear(x.float(), router.weight.float()).sigmoid() + router.e_score_correction_bias
        )
        picked = choice.gather(1, idx)
        assert (picked[:, :-1] >= picked[:, 1:]).all()


def test_the_bias_changes_the_choice() -> None:
    """The correction bias ranks the choice only: with it the sets differ from the unbiased
    top-k (so the tests above exercise it), and the weights are the unbiased scores."""
    router = _router(1, 64, 8, 1, 1, False)
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        w, idx = _route(router, x)
        s = F.linear(x, router.weight).sigmoid()
    assert not torch.equal(idx.sort(1).values, s.topk(8, dim=1).indices.sort(1).values)
    assert torch.allclose(w, s.gather(1, idx) * 2.5, rtol=WEIGHT_REL, atol=0)


def test_given_experts_are_weighed_in_their_order() -> None:
    for e, k, n_group, topk_group, n in CASES[:4]:
        router = _router(e, e, k, n_group, topk_group, True)
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(e))
        perm = torch.randperm(e, generator=torch.Generator().manual_seed(k))
        given = perm[:k].repeat(n, 1)  # the same (not chosen) experts for every token
        with torch.no_grad():
            w_ref, idx_ref = router(x, given)
            w, idx = _route(router, x, given)
        assert torch.equal(idx, given) and torch.equal(idx_ref, given)
        assert ((w - w_ref).abs() <= WEIGHT_REL * w_ref.abs()).all()


def test_ties_take_the_lower_group_and_expert_first() -> None:
    """Equal logits and no bias: every expert ties, so the lowest groups and, within them, the
    lowest ids are chosen, in ascending order, each weighing 1 / top_k of the scale."""
    for e, k, n_group, topk_group in ((16, 4, 4, 2), (16, 4, 1, 1), (64, 8, 8, 4)):
        logits = torch.zeros(3, e)
        w, idx = route_triton(logits, torch.zeros(e), k, n_group, topk_group, True, 2.0)
        assert torch.equal(idx, torch.arange(k).repeat(3, 1))
        assert torch.equal(w, torch.full((3, k), 2.0 / k))
    # one better expert in the last group: its group ties the first on the top-2 sum no more
    logits = torch.zeros(2, 16)
    logits[:, 15] = 1.0
    _, idx = route_triton(logits, torch.zeros(16), 4, 4, 2, True, 1.0)
    assert torch.equal(idx, torch.tensor([[15, 0, 1, 2]] * 2))


def test_no_tokens_and_bad_shapes() -> None:
    w, idx = route_triton(torch.zeros(0, 64), torch.zeros(64), 8, 8, 4, True, 1.0)
    assert w.shape == idx.shape == (0, 8)
    for args in ((8, 3, 2), (8, 8, 9), (40, 8, 4), (8, 64, 4)):  # ragged groups, too few
        with pytest.raises(ValueError):
            route_triton(torch.zeros(2, 64), torch.zeros(64), *args, True, 1.0)
    with pytest.raises(ValueError):
        route_triton(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(64), 8, 8, 4, True, 1)
