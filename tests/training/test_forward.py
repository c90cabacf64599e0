"""The training forward computes what serving computes: with random fp32 weights its logits
equal the inference path's (through a KV cache) in dense and sparse mode, and its sparse
mode attends to exactly the rows the inference path selects. The indexer learns only from
its KL, which is >= 0 and 0 when the indexer matches the attention."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.presets import preset_topology
from services.worker.model.preset_decoder import DSAModel
from services.worker.ops import index_scores, select_topk
from tests.training.helpers import inference_pass, random_model, random_tokens
from training.target.forward import lm_loss, train_forward
from training.target.indexer_loss import (
    batched_index_scores,
    causal_mask,
    indexer_kl,
    select_rows,
)

ATOL = 1e-4


@pytest.mark.parametrize("name", ["tiny-indexshare", "tiny-dsv4"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_logits_equal_inference_when_topk_covers_the_sequence(mode: str, name: str) -> None:
    model = random_model(index_topk=128, seed=1, name=name)
    tokens = random_tokens(2, 96, seed=2)
    ref, _ = inference_pass(model, tokens)
    with torch.no_grad():
        out = train_forward(model, tokens, mode)
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=ATOL)


def sparse_matches_inference(
    model: DSAModel, tokens: torch.Tensor, selection_matters: float
) -> list[dict[int, torch.Tensor]]:
    """Sparse training logits equal the inference path's, dense ones differ by more than
    ``selection_matters`` (the selection is doing something), and every producer selects the
    rows inference selects. Returns inference's selections per sequence."""
    ref, ref_sel = inference_pass(model, tokens)
    with torch.no_grad():
        sparse = train_forward(model, tokens, "sparse")
        dense = train_forward(model, tokens, "dense")
    torch.testing.assert_close(sparse.logits, ref, rtol=0, atol=ATOL)
    assert (dense.logits - ref).abs().max() > selection_matters
    assert set(sparse.selections) == set(model.cfg.index_producers)
    for b in range(tokens.shape[0]):
        # The first producer sees bit-identical inputs: the very same ordered selection.
        assert torch.equal(sparse.selections[0][b], ref_sel[b][0])
        for layer, sel in sparse.selections.items():
            # Later producers' inputs differ by float rounding (SDPA vs the reference
            # attention), which may reorder near-equal scores; the selected rows are equal.
            torch.testing.assert_close(sel[b].sort(-1).values, ref_sel[b][layer].sort(-1).values)
    return ref_sel


@pytest.mark.parametrize("seed", [3, 4])
def test_sparse_mode_selects_and_computes_what_inference_does(seed: int) -> None:
    model = random_model(index_topk=16, seed=seed)
    ref_sel = sparse_matches_inference(model, random_tokens(2, 96, seed=seed + 10), 0.1)
    for b in range(2):
        for layer in model.cfg.index_producers:
            for follower in (1, 2) if layer == 0 else (4, 5):
                assert torch.equal(ref_sel[b][follower], ref_sel[b][layer])


@pytest.mark.parametrize("seed", range(4))
def test_batched_index_scores_equal_the_per_sequence_op(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, t, h, d = (int(x) for x in torch.randint(1, 9, (4,), generator=g))
    t, d = 8 * t, 4 * d
    q, w, keys = torch.randn(b, t, h, d), torch.randn(b, t, h), torch.randn(b, t, d)
    got = batched_index_scores(q, w, keys)
    for i in range(b):
        torch.testing.assert_close(got[i], index_scores(q[i], w[i], keys[i]), rtol=0, atol=0)
    k = int(torch.randint(1, t + 4, (1,), generator=g))
    sel, mask = select_rows(got, k)
    vis = torch.arange(1, t + 1)
    for i in range(b):
        assert torch.equal(sel[i], select_topk(got[i], vis, k))
        want = torch.zeros(t, t, dtype=torch.bool)
        for r in range(t):
            want[r, sel[i, r][sel[i, r] >= 0]] = True
        assert torch.equal(mask[i], want)
        assert not (mask[i] & ~causal_mask(t, mask.device)).any()


def test_indexer_kl_is_nonnegative_and_zero_when_distributions_match() -> None:
    g = torch.Generator().manual_seed(0)
    b, t = 3, 40
    allowed = causal_mask(t, torch.device("cpu")).unsqueeze(0) & (
        torch.rand(b, t, t, generator=g) < 0.6
    )
    allowed |= torch.eye(t, dtype=torch.bool)  # every query keeps a row
    logits = torch.randn(b, t, t, generator=g) * 3
    target = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    for _ in range(5):
        scores = torch.randn(b, t, t, generator=g) * 3
        assert indexer_kl(target, scores, allowed) > 0
    # The indexer's scores equal the attention logits up to a per-query shift (and anything
    # outside the allowed rows): the same distribution.
    matching = logits + torch.randn(b, t, 1, generator=g) + (~allowed) * 1e3
    kl = indexer_kl(target, matching, allowed)
    assert kl.abs() < 1e-5
    assert torch.isfinite(kl)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_the_indexer_learns_only_from_its_kl(mode: str) -> None:
    model = random_model(index_topk=8, seed=5)
    tokens = random_tokens(2, 33, seed=6)
    out = train_forward(model, tokens[:, :-1], mode)
    lm_loss(out.logits, tokens[:, 1:]).backward(retain_graph=True)
    named = dict(model.named_parameters())
    indexer = {n for n in named if ".indexer." in n}
    assert all(named[n].grad is None for n in indexer)
    model.zero_grad(set_to_none=True)
    assert out.index_kl > 0
    out.index_kl.backward()
    assert all(named[n].grad is not None and named[n].grad.abs().sum() > 0 for n in indexer)
    assert all(p.grad is None for n, p in named.items() if n not in indexer)


@pytest.mark.parametrize("seed", [3, 4])
def test_compressed_windowed_sources_select_and_compute_what_inference_does(seed: int) -> None:
    """tiny-dsv4: a source packing 4 tokens per row with a local window of 8, read by its
    owner, a Reuse and a Reindex layer, then an uncompressed source. T = 97 leaves an
    incomplete last group, and the first queries see no compressed row, only their window."""
    model = random_model(index_topk=12, seed=seed, name="tiny-dsv4")
    assert set(model.cfg.index_producers) == {0, 2, 3}
    ref_sel = sparse_matches_inference(model, random_tokens(2, 97, seed=seed + 20), 0.05)
    for b in range(2):
        assert torch.equal(ref_sel[b][1], ref_sel[b][0])  # Reuse: the leader's positions


def test_the_indexer_kl_skips_queries_that_see_no_row() -> None:
    """Before a compressed source's first complete group a query has no row to select: its KL
    does not count, and no NaN reaches the loss or the indexer's gradient."""
    model = random_model(index_topk=8, seed=5, name="tiny-dsv4")
    tokens = random_tokens(2, 41, seed=6)
    for mode in ("dense", "sparse"):
        model.zero_grad(set_to_none=True)
        out = train_forward(model, tokens[:, :-1], mode)
        assert torch.isfinite(out.index_kl) and out.index_kl > 0
        out.index_kl.backward()
        grads = [p.grad for n, p in model.named_parameters() if ".indexer." in n]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_glm_10m_has_the_tiny_glm_topology_and_about_10m_parameters() -> None:
    cfg, tiny = preset_topology("glm-10m"), preset_topology("tiny-glm")
    assert cfg.layers == tiny.layers and cfg.sources == tiny.sources and cfg.vocab_size == 264
    n = sum(p.numel() for p in DSAModel(cfg).parameters())
    print(f"glm-10m: {n:,} parameters")
    assert 8e6 <= n <= 10e6
