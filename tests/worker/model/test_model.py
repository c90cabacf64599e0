"""The DSA model family: causal visibility (incl. compressed rows and the local window), layer
topologies (followers, Reuse, Reindex), chunking and save/load."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.config import ModelConfig
from dhisparse.family.presets import preset, preset_topology
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.token_ring import TokenRing
from services.worker.model.decoder import LayerTrace
from services.worker.weights.model_io import build_model, load_model, save_pretrained
from tests.worker.helpers import make, random_tokens, run_chunks

PRESET_NAMES = ["tiny-glm", "tiny-dsv4"]


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_selection_only_sees_complete_past_rows(name: str) -> None:
    model, kv = make(name)
    tokens = random_tokens(150, seed=1)
    trace: list[LayerTrace] = []
    run_chunks(model, kv, tokens, [150], trace=trace)
    cfg = model.cfg
    pos = torch.arange(150)
    for tr in trace:
        m = cfg.sources[cfg.layers[tr.layer].source].compress
        visible = (pos + 1) // m  # rows whose m tokens all lie at or before the query
        sel = tr.selection
        assert (sel < visible.unsqueeze(1)).all()
        valid = sel >= 0
        # Short histories select every visible row; long ones exactly k distinct rows.
        assert torch.equal(valid.sum(1), visible.clamp(max=cfg.index_topk))
        for t in range(150):
            row = sel[t][valid[t]]
            assert len(set(row.tolist())) == len(row)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_causal_future_tokens_do_not_change_the_past(name: str) -> None:
    a = random_tokens(120, seed=2)
    b = a.clone()
    b[70:] = random_tokens(50, seed=3)
    outs = []
    for toks in (a, b):
        model, kv = make(name)
        outs.append(run_chunks(model, kv, toks, [120]))
    torch.testing.assert_close(outs[0][:70], outs[1][:70], rtol=0, atol=0)
    assert not torch.allclose(outs[0][70:], outs[1][70:])


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_chunked_prefill_and_decode_equal_one_pass(name: str) -> None:
    tokens = random_tokens(140, seed=4)
    model, kv = make(name)
    full = run_chunks(model, kv, tokens, [140])
    model2, kv2 = make(name)
    # Uneven chunks cross pages, compression groups and the ring boundary; then decode steps.
    pieces = run_chunks(model2, kv2, tokens, [37, 1, 3, 50, 9, *([1] * 40)])
    torch.testing.assert_close(pieces, full, rtol=1e-4, atol=1e-4)


def test_token_ring_window_and_group_addressing() -> None:
    """Rows carry their own position; every chunking must address the same positions."""
    ring_rows = 8 + 4
    for chunks in ([30], [5, 7, 1, 1, 16], [1] * 30, [13, 17]):
        ring = TokenRing(max_slots=2, ring=ring_rows, width=1, dtype=torch.float32, device="cpu")
        start = 0
        for n in chunks:
            batch = ForwardBatch.build([1], [start], [n], "cpu")
            rows = torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)
            ext = ring.extend(batch, rows)
            locs = ext.window_locs(8)
            got = torch.where(locs >= 0, ext.rows[locs.clamp(min=0), 0], -1.0)
            pos = batch.positions.unsqueeze(1) - torch.arange(7, -1, -1).unsqueeze(0)
            want = torch.where(pos >= 0, pos.float(), -1.0)
            assert torch.equal(got, want), chunks
            # A compression group of 4 completing in the chunk is addressable in full.
            for p in range(start, start + n):
                if (p + 1) % 4 == 0:
                    grp = torch.arange(p - 3, p + 1)
                    idx = ext.index(torch.zeros(4, dtype=torch.int64), grp)
                    assert torch.equal(ext.rows[idx, 0], grp.float())
            start += n


def test_a_pass_whose_chunks_fit_the_ring_records_every_row_in_place() -> None:
    """Decode and verify passes (every chunk within the ring) write each new row at its
    position's ring row and leave every other row as it was; the buffer they read holds the
    ring's rows before the chunk, then the chunk's."""
    g = torch.Generator().manual_seed(5)
    ring = TokenRing(max_slots=6, ring=4, width=3, dtype=torch.float32, device="cpu")
    ring.data.copy_(torch.randn(ring.data.shape, generator=g))
    for width in (1, 3, 4):
        slots, starts = [4, 0, 2], [9, 17, 5]
        batch = ForwardBatch.build(slots, starts, [width] * 3, "cpu")
        rows = torch.randn(3 * width, 3, generator=g)
        before = ring.data.clone()
        ext = ring.extend(batch, rows)
        want = before.clone()
        for r, (slot, start) in enumerate(zip(slots, starts, strict=True)):
            for j in range(width):
                want[slot, (start + j) % 4] = rows[r * width + j]
            prior = ext.index(torch.full((4,), r), torch.arange(start - 4, start))
            expect = before[slot, torch.arange(start - 4, start) % 4]
            assert torch.equal(ext.rows[prior], expect)
        assert torch.equal(ring.data, want), width


def test_compressed_rows_are_gated_sums_of_their_tokens() -> None:
    model, kv = make("tiny-dsv4")
    tokens = random_tokens(64, seed=5)
    run_chunks(model, kv, tokens, [64])
    # Recompute layer 0's token rows directly and compress groups of 4 by hand.
    x = model.layers[0].attn_norm(model.embed(tokens))
    attn = model.layers[0].attn
    tok_rows = attn.token_rows(x, torch.arange(64))
    want = attn.compress(tok_rows.view(16, 4, -1))
    slots = torch.zeros(16, dtype=torch.int64)
    got = kv.payload.pool(0)[kv.payload.pools[0].locations(slots, torch.arange(16))]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reuse_inherits_locations_without_resolving_and_reindex_selects_afresh() -> None:
    model, kv = make("tiny-dsv4")
    calls: list[int] = []
    real_resolve = kv.payload.resolve

    def counting_resolve(layer, source, batch, selection):
        calls.append(layer)
        return real_resolve(layer, source, batch, selection)

    kv.payload.resolve = counting_resolve  # type: ignore[method-assign]
    trace: list[LayerTrace] = []
    run_chunks(model, kv, random_tokens(200, seed=6), [200], trace=trace)
    by_layer = {t.layer: t for t in trace}
    # Layers 1 and 4 are Reuse consumers: no resolver call, the leader's very locations.
    assert calls == [0, 2, 3]
    assert by_layer[1].locations is by_layer[0].locations
    assert by_layer[4].locations is by_layer[3].locations
    # Layer 2 is a Reindex consumer of source 0: its own top-k over the same rows.
    sel2 = by_layer[2].selection
    assert not torch.equal(sel2, by_layer[0].selection)
    slots = torch.zeros_like(sel2)
    assert torch.equal(by_layer[2].locations, kv.payload.pools[0].locations(slots, sel2))


def test_followers_share_positions_but_read_their_own_payload() -> None:
    model, kv = make("tiny-glm")
    trace: list[LayerTrace] = []
    run_chunks(model, kv, random_tokens(100, seed=7), [100], trace=trace)
    by_layer = {t.layer: t for t in trace}
    for follower, leader in ((1, 0), (2, 0), (4, 3), (5, 3)):
        assert torch.equal(by_layer[follower].selection, by_layer[leader].selection)
        assert not torch.equal(by_layer[follower].rows, by_layer[leader].rows)
    assert not torch.equal(by_layer[3].selection, by_layer[0].selection)


@pytest.mark.parametrize("name", ["tiny-indexshare", "tiny-dsv4"])  # the home-made format
def test_save_load_round_trip(name: str, tmp_path) -> None:
    model = build_model(preset(name), seed=11)
    save_pretrained(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.cfg == model.cfg
    for (k1, v1), (k2, v2) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert k1 == k2 and torch.equal(v1, v2)
    tokens = random_tokens(50, seed=8)
    _, kv1 = make(name)
    _, kv2 = make(name)
    a = run_chunks(model, kv1, tokens, [50])
    b = run_chunks(loaded, kv2, tokens, [50])
    assert torch.equal(a, b)
    assert ModelConfig.load(tmp_path / "m" / "config.json") == model.cfg


def test_config_rejects_bad_topologies() -> None:
    cfg = preset("tiny-dsv4")
    bad = cfg.to_dict()
    bad["layers"][1] = {"source": 1, "index": "reuse", "leader": 0}  # reuse across sources
    with pytest.raises(ValueError, match="reuse needs"):
        ModelConfig.from_dict(bad)
    bad = cfg.to_dict()
    bad["sources"][0]["window"] = 0
    with pytest.raises(ValueError, match="local window"):
        ModelConfig.from_dict(bad)
    bad = preset_topology("tiny-glm").to_dict()
    bad["layers"][1] = {"source": 1, "index": "follower", "leader": 2}
    with pytest.raises(ValueError, match="leader"):
        ModelConfig.from_dict(bad)
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        load_model("no-such-model")


@pytest.mark.parametrize("name", ["tiny-glm", "tiny-dsv4"])
def test_short_chunks_are_scored_in_one_batch_exactly_as_one_request_at_a_time(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of short chunks (a verify round: K_r queries per request, here unequal) is
    scored for all requests at once; its selections, attention inputs and hidden states equal
    those of the per-request path, bit for bit."""
    import services.worker.model.row_selection as model_mod

    lens, starts = [4, 1, 7], [60, 45, 83]

    def run(short_chunk: int) -> tuple[torch.Tensor, list[LayerTrace]]:
        monkeypatch.setattr(model_mod, "SHORT_CHUNK", short_chunk)
        model, kv = make(name, seed=3)
        for slot, s in enumerate(starts):
            run_chunks(model, kv, random_tokens(s, seed=10 + slot), [s], slot=slot)
            assert kv.ensure(slot, s + lens[slot])  # room for the chunk's rows
        batch = ForwardBatch.build([0, 1, 2], starts, lens, "cpu")
        trace: list[LayerTrace] = []
        hidden = model(random_tokens(sum(lens), seed=20), batch, kv, trace=trace)
        return hidden, trace

    batched, tb = run(16)
    looped, tl = run(0)
    assert torch.equal(batched, looped)
    for a, b in zip(tb, tl, strict=True):
        assert torch.equal(a.selection, b.selection) and torch.equal(a.rows, b.rows)
    assert (tb[0].selection >= 0).sum() > 0
