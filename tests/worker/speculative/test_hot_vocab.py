"""The MTP drafter's hot vocabulary (``model.hot_vocab``, FR-Spec): the hot head against a
plain-torch reference; the MTP layer's draft steps with a hot head against the full head's
logits restricted to the hot ids (both families and DeepSeek-V4, norms perturbed); sampled
proposals' q, zero outside the hot set, and the target's law kept by speculative sampling with
such a q (chi-square, α = 1e-3); and in the engine, speculative greedy output equal to
transformers' greedy with a hot set that leaves out tokens greedy decoding emits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig, ResidencyConfig
from services.worker.model.hot_vocab import HotHead
from services.worker.model.v4_serving import V4Model
from services.worker.request.request import SamplingParams
from services.worker.serving.cache import KVCache
from services.worker.speculative.config import SpeculationConfig
from services.worker.speculative.drafters.mtp import MTPDrafter
from services.worker.speculative.verify import verify_sampling
from services.worker.weights.model_io import load_model
from tests import hf_tiny
from tests.worker.model import serving
from tests.worker.mtp_fixture import FAMILIES, mtp_checkpoint, record_drafts, v4_mtp_checkpoint
from tests.worker.speculative.stats import chi2_test

ALPHA = 1e-3
STEPS = 4


@pytest.fixture(scope="module", params=[*sorted(FAMILIES), "deepseek_v4"])
def family(request, tmp_path_factory) -> tuple[object, Path]:
    if request.param == "deepseek_v4":
        return v4_mtp_checkpoint(tmp_path_factory)
    return mtp_checkpoint(request.param, tmp_path_factory)


def _ids(n: int, seed: int) -> list[int]:
    """Random token ids, the two lowest (DeepSeek-V4's BOS and EOS) left out."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, hf_tiny.VOCAB, (n,), generator=g).tolist()


def _hot(vocab: int, n: int, seed: int) -> torch.Tensor:
    """n of ``vocab`` ids, sorted, drawn at random."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n].sort().values


# ---- the hot head against plain torch ------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_the_hot_head_is_the_heads_rows_of_its_ids(seed: int) -> None:
    """Random shapes: the logits are the whole head's at the hot ids, the tokens the vocabulary
    ids of their argmax, and q spread over the vocabulary is q at the hot ids, zero elsewhere;
    the copy has the head's dtype and N rows."""
    g = torch.Generator().manual_seed(seed)
    vocab, d, r = int(torch.randint(2, 400, (), generator=g)), 16 * (1 + seed % 3), 1 + seed
    n = int(torch.randint(1, vocab + 1, (), generator=g))
    head = torch.randn(vocab, d, generator=g)
    ids = _hot(vocab, n, seed)
    hidden = torch.randn(r, d, generator=g)
    hot = HotHead(head, ids)
    assert hot.size == n and hot.weight.shape == (n, d) and hot.weight.dtype == head.dtype
    want = (hidden @ head.t())[:, ids]
    logits = hot.logits(hidden)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(hot.tokens(logits), ids[want.argmax(-1)])
    q = torch.softmax(torch.randn(r, n, generator=g), -1)
    spread = hot.probs(q)
    assert spread.shape == (r, vocab) and torch.equal(spread[:, ids], q)
    out = torch.ones(vocab, dtype=torch.bool)
    out[ids] = False
    assert (spread[:, out] == 0).all()


def test_hot_ids_must_be_sorted_unique_and_in_range() -> None:
    head = torch.zeros(10, 4)
    for bad in ([3, 1], [1, 1], [-1, 2], [2, 10], []):
        with pytest.raises(ValueError, match="hot ids"):
            HotHead(head, torch.tensor(bad, dtype=torch.int64))


# ---- draft steps: hot logits are the full head's at the hot ids ---------------------------
def _kv(model, slots: int) -> KVCache:
    return KVCache(
        model.cfg,
        KVCacheConfig(max_slots=slots, max_model_len=256, spec_block=STEPS + 1,
                      dtype=torch.float32),
    )  # fmt: skip


def _prefilled(model, kv: KVCache, prompts: list[list[int]]) -> None:
    for slot, ids in enumerate(prompts):
        n = len(ids)
        assert kv.admit(slot, f"r{slot}", n, n + STEPS + 1) and kv.ensure(slot, n + STEPS + 1)
        batch = ForwardBatch.build([slot], [0], [n], "cpu", prefill=True)
        model(torch.tensor(ids), batch, kv)
        kv.commit(batch, [n])


def _perturb_norms(model, seed: int) -> None:
    """The MTP layer's norms scaled by 1 + N(0, 0.3^2): its logits are not the head's at a
    norm of ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.mtp.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))


def _head_input(model, hidden: torch.Tensor) -> torch.Tensor:
    """[R, d] what the head reads from a draft step's hidden state: the state itself
    (``shared_head.norm``'s output), or DeepSeek-V4's streams through the hyper head and norm."""
    if not isinstance(model, V4Model):
        return hidden
    c = model.family
    return model.mtp.final(hidden.view(-1, c.hc_mult, c.hidden_size))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_draft_steps_tokens_are_the_full_heads_argmax_over_the_hot_ids(family, seed) -> None:
    """Three requests of random prompts, four teacher-forced draft steps each run with the full
    head and with a hot head of half the vocabulary (a fresh random set per seed): the hot
    logits equal the full logits at the hot ids and a plain-torch product of what the head reads
    with the head's rows; the step's tokens are the hot ids of their argmax."""
    _, path = family
    model = load_model(path, mtp=True)
    _perturb_norms(model, seed)
    vocab = model.cfg.vocab_size
    hot = HotHead(model.mtp_head, _hot(vocab, vocab // 2, 100 + seed))
    prompts = [_ids(n, 10 * seed + n) for n in (40, 17, 63)]
    kv = _kv(model, len(prompts))
    _prefilled(model, kv, prompts)
    src = model.cfg.layers[model.mtp_layer].source
    share = model.mtp_index_share
    tokens = torch.tensor(_ids(3, seed))
    hidden, first = None, None
    for i in range(STEPS):
        batch = ForwardBatch.build([0, 1, 2], [len(p) + i for p in prompts], [1, 1, 1], "cpu",
                                   sources=(src,))  # fmt: skip
        given = first if share and i else None
        full = model.mtp_step(tokens, batch, kv, hidden, given)
        step = model.mtp_step(tokens, batch, kv, hidden, given, hot=hot)  # the same rows again
        torch.testing.assert_close(step.hidden, full.hidden, rtol=0, atol=0)
        want = full.logits[:, hot.ids]
        torch.testing.assert_close(step.logits, want, rtol=1e-5, atol=1e-5)
        ref = _head_input(model, step.hidden).float() @ model.mtp_head.float().t()
        torch.testing.assert_close(step.logits, ref[:, hot.ids], rtol=1e-5, atol=1e-5)
        assert torch.equal(step.tokens, hot.ids[want.argmax(-1)]), i
        assert torch.equal(full.tokens, full.logits.argmax(-1))
        tokens = torch.tensor(_ids(3, 1000 * seed + i))  # fresh inputs for the next step
        hidden, first = step.hidden, step.selection if first is None else first
    kv.close()


# ---- sampling ------------------------------------------------------------------------------
def test_sampled_proposals_draw_from_a_q_zero_outside_the_hot_set(family) -> None:
    """Over 1,280 identical requests (sixteen slots, each request its own generator) with a hot
    set of a third of the vocabulary: every q sums to one and is zero outside the hot set, the
    proposals are hot ids, and the first proposals fit their q (chi-square, α = 1e-3). Greedy
    requests in the same batches propose the hot argmax."""
    _, path = family
    model = load_model(path, mtp=True)
    vocab = model.cfg.vocab_size
    hot = HotHead(model.mtp_head, _hot(vocab, vocab // 3, 5))
    prompt = _ids(29, 3)
    kv = _kv(model, 16)
    _prefilled(model, kv, [prompt] * 16)
    src = model.cfg.layers[model.mtp_layer].source
    drafter = MTPDrafter(
        lambda t, b, h, sel: model.mtp_step(t, b, kv, h, sel, hot=hot), src, vocab, 3,
        model.mtp_index_share, torch.device("cpu"), hot=hot,
    )  # fmt: skip
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[hot.ids] = False
    tokens, probs = [], []
    temps = [0.8] * 15 + [0.0]
    for call in range(80):
        gens = [torch.Generator().manual_seed(16 * call + j) for j in range(16)]
        prop = drafter.propose(list(range(16)), [prompt[-1]] * 16, [29] * 16, None, temps, gens)
        assert prop.probs is not None
        tokens.append(prop.tokens[:15])
        probs.append(prop.probs[:15])
        greedy = prop.tokens[15, 0]
        assert prop.probs[15, 0, greedy] == 1 and bool(torch.isin(greedy, hot.ids))
    toks, q = torch.cat(tokens), torch.cat(probs)
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[:-1]), rtol=0, atol=1e-5)
    assert (q[..., outside] == 0).all()
    assert torch.isin(toks, hot.ids).all()
    first = torch.bincount(toks[:, 0], minlength=vocab).float()
    assert chi2_test([(first, q[0, 0])])[0] > ALPHA
    kv.close()


class HotWorld:
    """A toy target over V = 8 tokens and a block of K = 3 (its laws of the first token and of
    the second given the first) and a drafter whose q is a hot head's: the softmax of logits
    over five hot ids, zero at the other three. ``wrong_q``: the drafter reports instead the
    softmax over every id of logits equal at the hot ids (what a hot drafter that forgot its
    set would claim)."""

    V = 8
    HOT = (0, 2, 3, 5, 6)

    def __init__(self, seed: int) -> None:
        v, g = self.V, torch.Generator().manual_seed(seed)
        self.p0 = torch.softmax(torch.randn(v, generator=g) * 1.5, -1)
        self.p1 = torch.softmax(torch.randn(v, v, generator=g) * 1.5, -1)
        self.p2 = torch.softmax(torch.randn(v, v, v, generator=g) * 1.5, -1)
        self.hot = HotHead(torch.eye(v), torch.tensor(self.HOT))
        self.l1 = torch.randn(v, generator=g)
        self.l2 = torch.randn(v, v, generator=g)

    def q(self, logits: torch.Tensor, wrong: bool) -> torch.Tensor:
        """[..., V] the proposal law of ``logits`` [..., V]: the hot head's, or ``wrong``."""
        if wrong:
            return torch.softmax(logits, -1)
        return self.hot.probs(torch.softmax(self.hot.logits(logits), -1))

    def run(self, trials: int, seed: int, wrong_q: bool = False) -> dict[str, float]:
        """p-values of the emitted first token against p0, of the second given the first
        against p1[y1] and of the third (the bonus token, emitted when both proposals are
        accepted) given the first two against p2[y1, y2], proposals drawn from the hot q
        whatever q is reported; sets ``cold_emitted``: the fewest times a token outside the
        hot set came first."""
        v = self.V
        q1, q2 = self.q(self.l1, False), self.q(self.l2, False)
        told1, told2 = self.q(self.l1, wrong_q), self.q(self.l2, wrong_q)
        gd, gv = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
        x1 = torch.multinomial(q1, trials, replacement=True, generator=gd)
        x2 = torch.multinomial(q2[x1], 1, generator=gd).squeeze(1)
        first, second, third = torch.zeros(v), torch.zeros(v, v), torch.zeros(v, v, v)
        for a, b in zip(x1.tolist(), x2.tolist(), strict=True):
            probs = torch.stack([self.p0, self.p1[a], self.p2[a, b]])
            told = torch.stack([told1, told2[a]])
            n, nxt = verify_sampling(probs, torch.tensor([a, b]), told, gv)
            ys = [*[a, b][:n], nxt]
            first[ys[0]] += 1
            if len(ys) >= 2:
                second[ys[0], ys[1]] += 1
            if len(ys) == 3:
                third[ys[0], ys[1], ys[2]] += 1
        self.cold_emitted = int(first[[t for t in range(v) if t not in self.HOT]].min())
        return {
            "first": chi2_test([(first, self.p0)])[0],
            "second": chi2_test([(second[a], self.p1[a]) for a in range(v)])[0],
            "third": chi2_test([(third[a, b], self.p2[a, b]) for a in range(v) for b in range(v)])[
                0
            ],
        }


def test_speculative_sampling_with_a_hot_q_keeps_the_targets_law() -> None:
    """H0: the emitted tokens follow the target's law, the first, the second given the first
    and the bonus token given both (Pearson's chi-square at α = 1e-3 over 20,000 rounds with
    fixed seeds), though the drafter never proposes three of the tokens the target emits."""
    world = HotWorld(seed=11)
    pvals = world.run(20_000, seed=5)
    assert min(pvals.values()) > ALPHA, pvals
    assert world.cold_emitted > 0  # each token outside the hot set was emitted first


def test_the_law_test_rejects_a_q_that_is_not_the_hot_one() -> None:
    """Power check: the same test, same seeds, catches proposals from the hot q verified
    against a q that spreads mass over the ids it never proposes."""
    pvals = HotWorld(seed=11).run(20_000, seed=5, wrong_q=True)
    assert min(pvals.values()) < ALPHA, pvals


# ---- the engine ----------------------------------------------------------------------------
def _greedy(target, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``, ``n`` tokens (uncached forwards)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_tiny.reference_logits(target, torch.tensor(ids))[-1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("mode", ["hisparse", "adaptive"])
def test_greedy_with_a_hot_head_is_transformers_greedy(family, mode: str, tmp_path) -> None:
    """Five requests, two arriving while the first three speculate: a token map ranks two
    thirds of the tokens greedy decoding emits first, then tokens it does not emit, then the
    rest of what it emits; ``--draft-vocab-size`` cuts the map before that rest. Every output
    is transformers' greedy continuation, holds tokens outside the hot set, and every draft is a
    hot id."""
    ref, path = family
    prompts = [_ids(n, 700 + n) for n in (150, 61, 197, 90, 40)]
    want = [_greedy(ref.target, p, 16) for p in prompts]
    emitted = sorted({t for w in want for t in w})
    cold = emitted[::3]
    kept = [t for t in emitted if t not in cold]
    others = [t for t in range(hf_tiny.VOCAB) if t not in emitted][:40]
    token_map = tmp_path / "hot.txt"
    token_map.write_text("".join(f"{t}\n" for t in [*kept, *others, *cold]))
    spec = SpeculationConfig(
        "mtp", 4, "fixed", token_map=str(token_map), draft_vocab_size=len(kept) + len(others)
    )
    kw: dict = {"speculation": spec, "kv_pool_mib": 48, "hot_cache_rows": 16}
    if mode == "adaptive":
        kw |= dict(kv_pool_mib=serving.tight_pool_mib(path, **kw),
                   residency=ResidencyConfig(populate_pages=4))  # fmt: skip
    eng: Engine = serving.engine(path, mode, **kw)
    hot = eng.passes.hot_head
    assert hot is not None and hot.ids.tolist() == sorted([*kept, *others])
    drafts: dict[tuple[int, int], list[int]] = {}
    record_drafts(eng, drafts)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reqs = []
    for i, p in enumerate(prompts):
        if i == 3:
            for _ in range(10):
                eng.step()
        reqs.append(eng.add_request(f"r{i}", p, params))
    while eng.has_work():
        eng.step()
    assert [r.output_ids for r in reqs] == want
    proposed = {t for d in drafts.values() for t in d}
    assert proposed and proposed <= set(hot.ids.tolist())
    assert eng.speculator.counters.drafts > 0
    eng.close()
