"""The MLA training forward (``training.target.mla_forward``) computes what transformers and the
serving path compute, on tiny random checkpoints of both real families with an MTP layer
(GLM-5.2's IndexShare, V3.2's YaRN): logits, selections and MTP logits; the indexer learns only
from its KL, which equals the dense reference and is estimated without bias on a subset of
queries; the MoE's unchosen experts get no gradient and the bias update balances the load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.kv.config import KVCacheConfig
from services.worker.model.mla_decoder import MLADecoder
from services.worker.serving.cache import KVCache
from services.worker.weights.model_io import load_model
from tests import hf_tiny
from tests.worker.helpers import run_chunks
from tests.worker.mtp_fixture import FAMILIES, mtp_checkpoint
from tests.worker.mtp_reference import MTPReference
from training.target.forward import lm_loss
from training.target.indexer_loss import (
    attention_target,
    batched_index_scores,
    causal_mask,
    indexer_kl,
    select_rows,
)
from training.target.mla_forward import MLATrainOutput, mla_train_forward
from training.target.mla_indexer import draw_queries
from training.target.mla_moe import moe_layers, update_expert_bias

TOPK = 16  # the fixtures' index_topk
LENGTHS = {"dense": TOPK, "sparse": 40}  # dense: T <= index_topk; sparse: T > index_topk


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[MTPReference, Path]:
    return mtp_checkpoint(request.param, tmp_path_factory)


def _model(path: Path) -> MLADecoder:
    model = load_model(path, mtp=True)
    assert isinstance(model, MLADecoder) and model.mtp is not None
    return model


def _tokens(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, hf_tiny.VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().abs().max() / want.abs().max())


def _producers(model: MLADecoder) -> list[int]:
    return [*model.cfg.index_producers]  # the MTP layer is one (the last)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_logits_and_selections_equal_transformers(family, mode: str) -> None:
    ref, path = family
    model = _model(path)
    tokens = _tokens(2, LENGTHS[mode], seed=11)
    with torch.no_grad():
        out = mla_train_forward(model, tokens, mode)
    assert out.logits.shape == (2, LENGTHS[mode], hf_tiny.VOCAB)
    for b in range(2):
        assert _rel(out.logits[b], hf_tiny.reference_logits(ref.target, tokens[b])) <= 1e-4
    if mode == "dense":
        assert out.selections == {}
        return
    assert sorted(out.selections) == list(range(model.cfg.n_layers))
    for i, spec in enumerate(model.cfg.layers):
        if spec.index == "follower":  # IndexShare: the leader's very selection
            assert out.selections[i] is out.selections[spec.leader]
    for b in range(2):
        want = hf_tiny.reference_selections(ref.target, tokens[b])
        assert sorted(want) == [i for i in _producers(model) if i != model.mtp_layer]
        for layer, sel in want.items():
            for t in range(tokens.shape[1]):
                ours = {int(p) for p in out.selections[layer][b, t] if p >= 0}
                assert ours == {int(p) for p in sel[t] if p <= t}, (layer, t)


def test_sparse_mode_equals_the_inference_prefill(family) -> None:
    """Against the serving path over a KV cache (absorbed MLA, the per-chunk selection): the
    same logits and each layer's selection, in order."""
    _, path = family
    model = _model(path)
    tokens = _tokens(2, 40, seed=12)
    with torch.no_grad():
        out = mla_train_forward(model, tokens, "sparse")
    for b in range(2):
        kv = KVCache(model.cfg, KVCacheConfig(max_slots=1, max_model_len=40))
        trace = []
        with torch.no_grad():
            want = model.logits(run_chunks(model, kv, tokens[b], [25, 15], trace=trace))
        kv.close()
        assert _rel(out.logits[b], want) <= 1e-4
        layers = list(range(model.family.num_layers))
        assert [tr.layer for tr in trace] == layers * 2  # two prefill chunks
        sel = {i: torch.cat([tr.selection for tr in trace if tr.layer == i]) for i in layers}
        # the first layer sees bit-identical inputs; later ones' differ by rounding (expanded
        # against absorbed attention), which may reorder near-equal scores
        assert torch.equal(out.selections[0][b], sel[0])
        for i in layers[1:]:
            torch.testing.assert_close(out.selections[i][b].sort(-1).values, sel[i].sort(-1).values)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_mtp_logits_equal_the_reference(family, mode: str) -> None:
    """mtp_logits[:, i] fuses embed(tokens[i+1]) with the target's final-norm hidden state at
    i: the reference's MTP pass over the whole sequence (sparse: over 39 positions, more than
    index_topk, by the MTP layer's own indexer)."""
    ref, path = family
    model = _model(path)
    t = LENGTHS[mode] + 1 if mode == "dense" else LENGTHS[mode]  # dense: T - 1 <= index_topk
    tokens = _tokens(2, t, seed=13)
    with torch.no_grad():
        out = mla_train_forward(model, tokens, mode)
    assert out.mtp_logits is not None and out.mtp_logits.shape == (2, t - 1, hf_tiny.VOCAB)
    for b in range(2):
        u = ref.fuse(tokens[b, 1:], ref.target_hidden(tokens[b, :-1]))
        _, want, _ = ref.run(u)
        assert _rel(out.mtp_logits[b], want) <= 1e-4
    with torch.no_grad():
        off = mla_train_forward(model, tokens, mode, mtp=False)
        plain = mla_train_forward(load_model(path), tokens, mode)
    for o in (off, plain):
        assert o.mtp_logits is None and model.mtp_layer not in o.expert_load
        assert model.mtp_layer not in o.query_kl
        assert _rel(o.logits, out.logits) <= 1e-6


def _losses(out: MLATrainOutput, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert out.mtp_logits is not None
    ce = lm_loss(out.logits[:, :-1], tokens[:, 1:]) + lm_loss(out.mtp_logits[:, :-1], tokens[:, 2:])
    return ce, out.index_kl


def test_gradients_reach_every_parameter_from_its_own_loss(family) -> None:
    """loss = CE (target and MTP) + KL: every parameter gets a finite gradient; the indexers'
    only from the KL, the rest only from CE; an expert no token chose gets zero."""
    _, path = family
    model = _model(path)
    moes = moe_layers(model)
    last, mtp = max(i for i in moes if i != model.mtp_layer), model.mtp_layer
    with torch.no_grad():  # never chosen: the choice adds the bias, the weights do not
        moes[last].gate.e_score_correction_bias[3] = -100.0
        moes[mtp].gate.e_score_correction_bias[5] = -100.0
    tokens = _tokens(2, 40, seed=14)
    out = mla_train_forward(model, tokens, "sparse")
    assert out.expert_load[last][3] == 0 and out.expert_load[mtp][5] == 0
    ce, kl = _losses(out, tokens)
    assert kl > 0
    named = dict(model.named_parameters())
    g_ce = torch.autograd.grad(ce, list(named.values()), allow_unused=True, retain_graph=True)
    g_kl = torch.autograd.grad(kl, list(named.values()), allow_unused=True)
    indexers = {n for n in named if ".indexer." in n}
    assert {n.split(".indexer.")[0] for n in indexers} == {
        f"layers.{i}" if i != mtp else "mtp" for i in _producers(model)
    }
    for n, a, k in zip(named, g_ce, g_kl, strict=True):
        own, other = (k, a) if n in indexers else (a, k)
        assert own is not None and torch.isfinite(own).all(), n
        assert other is None or not other.any(), n
        if "experts.gate_up_proj" not in n and "experts.down_proj" not in n:
            assert own.abs().sum() > 0, n
    for layer, expert in ((last, 3), (mtp, 5)):
        prefix = "mtp" if layer == mtp else f"layers.{layer}"
        for proj in ("gate_up_proj", "down_proj"):
            g = g_ce[list(named).index(f"{prefix}.mlp.experts.{proj}")]
            chosen = out.expert_load[layer] > 0
            assert not g[expert].any() and not g[~chosen].any()
            assert all(g[e].abs().sum() > 0 for e in chosen.nonzero().flatten().tolist())
    # no index loss: the same logits, no KL, and no gradient path into the indexers
    with torch.no_grad():
        plain = mla_train_forward(model, tokens, "sparse", index_loss=False)
    assert plain.index_kl == 0 and plain.query_kl == {}
    assert torch.equal(plain.logits, out.logits.detach())


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_the_kl_equals_the_dense_reference(family, mode: str) -> None:
    """Each producer's KL against ``indexer_loss``'s on the layer's own input (captured): the
    target from the absorbed queries over the stored rows, the scores and (sparse) selection
    over the whole [B, T, T]. Chunks of 7 queries give the same."""
    _, path = family
    model = _model(path)
    b, t = 2, 40
    tokens = _tokens(b, t, seed=15)
    inputs: dict[int, torch.Tensor] = {}
    norms = {i: model.layers[i].attn_norm for i in _producers(model) if i != model.mtp_layer}
    norms[model.mtp_layer] = model.mtp.attn_norm
    hooks = [
        m.register_forward_hook(lambda _m, _a, x, i=i: inputs.__setitem__(i, x))
        for i, m in norms.items()
    ]
    try:
        with torch.no_grad():
            out = mla_train_forward(model, tokens, mode)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        chunked = mla_train_forward(model, tokens, mode, chunk=7)
    refs = []
    for i, x in inputs.items():
        layer = model.mtp if i == model.mtp_layer else model.layers[i]
        n = t - 1 if i == model.mtp_layer else t
        rotary = model.rotary(torch.arange(n).repeat(b))
        q, q_latent = layer.attn.queries(x, rotary)
        rows = layer.attn.token_rows(x, rotary)
        iq, iw = layer.indexer.queries(x, q_latent, rotary)
        keys = layer.indexer.keys(x, rows, rotary)
        iq, iw, keys = iq.view(b, n, *iq.shape[1:]), iw.view(b, n, -1), keys.view(b, n, -1)
        scores = batched_index_scores(iq, iw, keys)
        allowed = causal_mask(n, scores.device).unsqueeze(0)
        if mode == "sparse":
            sel, allowed = select_rows(scores, TOPK)
            assert torch.equal(sel, out.selections[i])
        q = q.view(b, n, *q.shape[1:]).transpose(1, 2)  # [B, H, T, kv_lora + rope]
        target = attention_target(q, rows.view(b, n, -1), allowed, layer.attn.scale)
        refs.append(indexer_kl(target, scores, allowed))
        got = out.query_kl[i]
        assert torch.equal(got.positions, torch.arange(n).expand(b, n))
        torch.testing.assert_close(got.kl.mean(), refs[-1], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(chunked.query_kl[i].kl, got.kl, rtol=1e-5, atol=1e-7)
    assert sorted(out.query_kl) == sorted(inputs)
    torch.testing.assert_close(out.index_kl, torch.stack(refs).mean(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(chunked.logits, out.logits, rtol=0, atol=1e-5)


def test_the_kl_on_drawn_queries_is_their_mean(family) -> None:
    """kl_queries=9: per sequence 9 distinct positions drawn by the generator (the target's
    layers share a draw of 0..39, the MTP layer draws from 0..38), each query's KL as in the
    all-query pass, and the estimate their mean over queries and layers; with a gradient."""
    _, path = family
    model = _model(path)
    tokens = _tokens(2, 40, seed=16)
    with torch.no_grad():
        full = mla_train_forward(model, tokens, "sparse")
    g = torch.Generator().manual_seed(3)
    sub = mla_train_forward(model, tokens, "sparse", kl_queries=9, gen=g)
    g = torch.Generator().manual_seed(3)
    drawn = {40: draw_queries(2, 40, 9, g), 39: draw_queries(2, 39, 9, g)}
    assert not torch.equal(drawn[40][0], drawn[40][1])
    means = []
    for i, got in sub.query_kl.items():
        pos = drawn[39 if i == model.mtp_layer else 40]
        assert torch.equal(got.positions, pos)
        assert all(len(set(row.tolist())) == 9 for row in pos)
        want = full.query_kl[i].kl.gather(1, pos)
        torch.testing.assert_close(got.kl, want, rtol=1e-5, atol=1e-7)
        means.append(want.mean())
    assert torch.isfinite(sub.index_kl)
    torch.testing.assert_close(sub.index_kl.detach(), torch.stack(means).mean())
    sub.index_kl.backward()
    assert model.layers[0].indexer.wq_b.weight.grad.abs().sum() > 0
    assert torch.equal(draw_queries(2, 40, None), torch.arange(40).expand(2, 40))
    assert torch.equal(draw_queries(2, 40, 50), torch.arange(40).expand(2, 40))


def test_the_expert_bias_moves_toward_balance(family) -> None:
    _, path = family
    model = _model(path)
    moes = moe_layers(model)
    assert model.mtp_layer in moes
    tokens = _tokens(4, 40, seed=17)
    with torch.no_grad():
        out = mla_train_forward(model, tokens, "dense", index_loss=False)
    assert sorted(out.expert_load) == sorted(moes)
    top_k = model.family.moe.top_k
    for i, load in out.expert_load.items():
        assert load.sum() == top_k * 4 * (39 if i == model.mtp_layer else 40)
    # one update: sign(mean - load) steps of the rate; the weights' formula is untouched
    layer = next(iter(moes))
    gate = moes[layer].gate
    load = torch.tensor([9.0, 1.0, 4.0, 4.0, 4.0, 4.0, 3.0, 3.0])  # mean 4
    x = torch.randn(6, model.family.hidden_size, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([[0, 1]] * 3 + [[2, 7]] * 3)
    w_before = gate(x, idx)[0]
    bias = gate.e_score_correction_bias.clone()
    shares = update_expert_bias(model, {layer: load}, rate=0.01)
    step = gate.e_score_correction_bias - bias
    torch.testing.assert_close(step, 0.01 * torch.tensor([-1.0, 1, 0, 0, 0, 0, 1, 1]))
    assert shares[layer] == (1 / 32, 9 / 32)
    assert torch.equal(gate(x, idx)[0], w_before)
    # a closed loop over a fixed batch: the most loaded expert's share falls in every layer
    first = None
    for _ in range(30):
        with torch.no_grad():
            out = mla_train_forward(model, tokens, "dense", index_loss=False)
        shares = update_expert_bias(model, out.expert_load, rate=0.01)
        first = first or shares
    for i in moes:
        assert shares[i].max < first[i].max, (i, first[i], shares[i])
