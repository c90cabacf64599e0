"""Drafters: valid proposals (shapes, widths, q rows that are distributions, q(x) > 0 for
every proposed x), sampling from q, save/load, and the ring path equal to the training path."""

from __future__ import annotations

import pytest
import torch

from services.worker.speculative import ConfidenceScheduler, load_drafter, save_drafter
from tests.worker.speculative.helpers import KINDS, drafter, target, with_context
from tests.worker.speculative.stats import chi2_test
from training.drafter.data import Blocks, context_index, run_target

SLOTS = [0, 2, 1]
LENGTHS = [30, 5, 1]


def _propose(d, temps, widths=None, seed=0):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(SLOTS))]
    return d.propose(SLOTS, [10, 20, 30], LENGTHS, widths, temps, gens)


@pytest.mark.parametrize("kind", KINDS)
def test_proposals_are_valid(kind: str) -> None:
    d = with_context(drafter(kind), SLOTS, LENGTHS)
    kmax, vocab = d.block_size, d.cfg.vocab_size
    assert d.device == torch.device("cpu")  # where its block passes' graphs live
    prop = _propose(d, [0.0, 1.0, 0.7], widths=[8, 5, 1])
    assert prop.widths == [8, 5, 1] or kind == "dspark"
    assert prop.tokens.shape == (3, kmax - 1) and prop.probs is not None
    assert prop.probs.shape == (3, kmax - 1, vocab)
    for r, k in enumerate(prop.widths):
        x = prop.tokens[r, : k - 1]
        q = prop.probs[r, : k - 1]
        assert ((x >= 0) & (x < vocab)).all()
        assert (prop.tokens[r, k - 1 :] == -1).all()
        assert (prop.probs[r, k - 1 :] == 0).all()
        torch.testing.assert_close(q.sum(-1), torch.ones(k - 1), rtol=0, atol=1e-5)
        assert (q.gather(-1, x.unsqueeze(-1)) > 0).all()  # lossless: x was drawable from q
    # The greedy request's q is one-hot on its proposals.
    assert torch.equal(prop.probs[0].argmax(-1), prop.tokens[0])
    assert (prop.probs[0].max(-1).values == 1).all()
    if kind == "dflash2":  # q lives on the lattice: at most C candidates per slot
        assert ((prop.probs > 0).sum(-1) <= d.cfg.num_candidates).all()
    if kind == "dspark":
        c = prop.confidence
        assert c is not None and c.shape == (3, kmax - 1) and ((c > 0) & (c < 1)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_proposals_are_deterministic_and_need_no_q(kind: str) -> None:
    d = with_context(drafter(kind), SLOTS, LENGTHS)
    a, b = _propose(d, 0.0, seed=0), _propose(d, 0.0, seed=7)
    assert a.probs is None and torch.equal(a.tokens, b.tokens)
    s1, s2 = _propose(d, 1.0, seed=3), _propose(d, 1.0, seed=3)
    assert torch.equal(s1.tokens, s2.tokens) and torch.equal(s1.probs, s2.probs)


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_proposals_follow_q(kind: str) -> None:
    """Lossless verification assumes x ~ q: the first two slots' proposals of many identical
    requests fit q (chi-square, α = 1e-3; the second slot's law given the first)."""
    d = with_context(drafter(kind), [0], [20])
    n = 3000
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    # T = 0.4 concentrates the (near-uniform, untrained) q enough to test slot 2 by slot 1.
    prop = d.propose([0] * n, [65] * n, [20] * n, None, [0.4] * n, gens)
    first = torch.bincount(prop.tokens[:, 0], minlength=d.cfg.vocab_size).float()
    assert chi2_test([(first, prop.probs[0, 0])])[0] > 1e-3
    groups = []
    for a in prop.tokens[:, 0].unique().tolist():
        rows = prop.tokens[:, 0] == a
        obs = torch.bincount(prop.tokens[rows, 1], minlength=d.cfg.vocab_size).float()
        groups.append((obs, prop.probs[rows][0, 1]))  # q of slot 2 given x_1 = a
    assert chi2_test(groups)[0] > 1e-3


def test_dspark_scheduler_picks_widths() -> None:
    d = with_context(drafter("dspark"), SLOTS, LENGTHS)
    d.scheduler = ConfidenceScheduler(token_budget=9)
    prop = _propose(d, 0.0, widths=[8, 8, 3])
    assert sum(prop.widths) <= 9 and all(
        1 <= w <= c for w, c in zip(prop.widths, [8, 8, 3], strict=True)
    )
    for r, k in enumerate(prop.widths):
        assert (prop.tokens[r, k - 1 :] == -1).all()


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_round_trip(kind: str, tmp_path) -> None:
    d = drafter(kind)
    save_drafter(d, tmp_path)
    e = load_drafter(tmp_path, d.borrowed.target)
    assert e.cfg == d.cfg and type(e) is type(d)
    for (k1, v1), (k2, v2) in zip(d.state_dict().items(), e.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2)
    assert not any(k.startswith("borrowed") for k in d.state_dict())
    with_context(d, SLOTS, LENGTHS)
    with_context(e, SLOTS, LENGTHS)
    assert torch.equal(_propose(d, 0.0).tokens, _propose(e, 0.0).tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_ring_path_equals_training_path(kind: str) -> None:
    """A block drafted at runtime (context K/V from the ring) and in training (gathered from
    the whole sequence, strictly before the anchor) sees the same inputs."""
    d = drafter(kind, window=12)
    t = d.borrowed.target
    length = 40
    toks = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(5))
    tp = run_target(t, toks, d.cfg.target_layers)
    fused = d.fuse({i: f[0] for i, f in tp.features.items()})
    k, v = d.context_kv(fused, torch.arange(length))
    anchors = torch.tensor([3, 25, 31])
    blocks = Blocks(torch.zeros(3, dtype=torch.int64), anchors, toks[0, anchors], None, None)  # type: ignore[arg-type]
    idx, valid = context_index(blocks, length, 12)
    want = d.block_hidden(blocks.tokens, anchors, lambda i: (k[i][idx], v[i][idx]), valid)
    d.init_ring(max_slots=3)
    for s, a in enumerate(anchors.tolist()):
        d.begin(s)
        d.append_context(
            torch.full((a,), s), torch.arange(a), {i: f[0, :a] for i, f in tp.features.items()}
        )
    win = d.ring.window_of(torch.arange(3), anchors)
    got = d.block_hidden(blocks.tokens, anchors, lambda i: d.ring.read(i, win), win.valid)
    assert torch.equal(win.valid, valid)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_context_writes_with_a_known_count_per_slot_equal_filtered_ones() -> None:
    """Decode steps and verify rounds tell ``append_context`` how many positions a slot adds
    (``per_slot``), which skips the newest-W filtering: the ring ends up the same."""
    t = target()
    runs = []
    for known in (False, True):
        d = drafter("dflash", window=6)
        d.init_ring(max_slots=3)
        g = torch.Generator().manual_seed(4)
        toks = torch.randint(0, 256, (1, 60), generator=g)
        feats = run_target(t, toks, d.cfg.target_layers).features
        n = [0, 0, 0]
        for _ in range(12):  # rounds committing 1..4 positions per slot
            slots, positions = [], []
            for s in range(3):
                a = int(torch.randint(1, 5, (), generator=g))
                slots += [s] * a
                positions += list(range(n[s], n[s] + a))
                n[s] += a
            pos = torch.tensor(positions)
            d.append_context(
                torch.tensor(slots), pos, {i: f[0, pos] for i, f in feats.items()},
                per_slot=4 if known else None,
            )  # fmt: skip
        runs.append((d.ring.k.clone(), d.ring.v.clone(), d.ring.tag.clone()))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
