"""``bench load --selections replay``: the shipped model's recorded selections mapped onto a
served model (``bench/load/replay.py``). The simulated hot cache (``lru_census``) over the trace
reproduces the census the engine measured on the shipped model; at real dimensions (the scaled
presets' k and producers, 32K and 100K prompts, no engine) the mapping keeps the trace's
step-to-step reuse exactly and its LRU hit rate within 0.02; on the CPU, a tiny hierarchy
engine driven by the replay serves the census the simulated cache predicts, the same greedy
tokens as a resident engine under the same replay, and a hit rate far above the random
histories' own selections'; ``bench load --tiny --selections replay`` records the mapping."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.cli import main as bench_main
from bench.load import cli
from bench.load.engines import EngineSizing, Variant, build
from bench.load.history import KEY_TOKENS, HistoryImport, history_tokens, random_history
from bench.load.pool import ROOT
from bench.load.replay import (
    SelectionTrace,
    decode_rows,
    expansion,
    install,
    load_traces,
    lru_census,
    predicted_census,
    replay_for,
    replay_table,
    trace_census,
    trace_for,
    trace_step,
)
from dhisparse.family.hf_dir import hf_family
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.kv.batch import ForwardBatch
from services.worker.request.request import SamplingParams

K = 2048  # the scaled presets' index_topk
PRODUCERS = 7  # glm5-scaled's index producers (v32-scaled: 16)
HIT_TOLERANCE = 0.02  # |served hit rate - trace hit rate|, absolute


def _hit(c: dict) -> float:
    return c["hot"] / (c["hot"] + c["host"])


def test_trace_steps_forth_and_back() -> None:
    u = np.arange(70)
    steps = trace_step(u, 0, 4, 32)
    assert steps[:32].tolist() == list(range(32))
    assert steps[32:63].tolist() == list(range(30, -1, -1))
    assert steps[63:].tolist() == list(range(1, 8))
    assert (np.abs(np.diff(steps)) == 1).all()  # consecutive served steps: consecutive trace steps
    assert trace_step(np.asarray(0), 5, 4, 32) == 1  # producer 5 replays producer 1, a step later


@pytest.mark.parametrize("context", [32768, 100_000])
def test_mapping_keeps_the_traces_reuse(context: int) -> None:
    traces = load_traces()
    trace = trace_for(context, K, traces)
    assert trace.context == {32768: 4096, 100_000: 16384}[context]
    e = expansion(K, trace)
    assert e == 4
    table = replay_table(trace, PRODUCERS, K, context)
    p0 = trace.rows.shape[1]
    for j in range(PRODUCERS):
        prev = None
        for u in range(2 * trace.steps):
            pos = context + u
            rows = decode_rows(table, j, p0, pos, context)
            valid = rows[rows >= 0]
            assert len(np.unique(valid)) == len(valid) and valid.max() <= pos
            t = int(trace_step(np.asarray(u), j, p0, trace.steps))
            src = trace.rows[t, j % p0]
            assert len(valid) == e * (src >= 0).sum()  # every trace row stands for e rows
            old = set(valid[valid < context - e * trace.steps].tolist())  # history rows
            hist = set(src[(src >= 0) & (src < trace.context)].tolist())
            if prev is not None:  # the rows kept from step to step are the trace's, times e
                assert len(old & prev[0]) == e * len(hist & prev[1])
            prev = (old, hist)
    for capacity, tail in ((512, 32), (1024, 32)):
        ref = trace_census(trace, capacity, tail, trace.steps)
        got = {"direct": 0, "hot": 0, "host": 0}
        for j in range(p0):  # the producers that replay their trace producer in step
            seq = [(context + u, decode_rows(table, j, p0, context + u, context))
                   for u in range(trace.steps)]  # fmt: skip
            for key, v in lru_census(seq, capacity * e, tail * e).items():
                got[key] += v
        assert abs(_hit(got) - _hit(ref)) < HIT_TOLERANCE, (capacity, got, ref)


def test_lru_census_by_hand() -> None:
    # capacity 2, tail 2 (rows above p - 2 direct)
    steps = [(10, np.array([1, 2, 9])), (11, np.array([1, 3, 10])), (12, np.array([2, 1, -1]))]
    # step 10: 9 direct, 1 and 2 miss (cache 1, 2); step 11: 10 direct, 1 hit, 3 misses and
    # evicts 2 (least recent, unselected); step 12: 2 misses (evicts 3), 1 hits
    assert lru_census(steps, 2, 2) == {"direct": 2, "hot": 2, "host": 4}


def test_contracted_trace_selects_each_row_once() -> None:
    rows = np.array([[[0, 1, 2, 3, 100]], [[1, 2, 3, 100, 101]]])  # 2 steps, 1 producer, k0 = 5
    trace = SelectionTrace(100, rows, "hand")
    table = replay_table(trace, 1, 4, 12)  # A = 12 - 2 = 10: rows spread by 0.1, then cut at 4
    # step 0: the recent row (distance 0) first, then rows 0..3 all land on row 0
    assert table[0, 0].tolist() == [-2, 0, -1, -1]
    # step 1: row 100 at distance 1, row 101 at distance 0 (the trace's order), then row 0
    assert table[0, 1].tolist() == [-3, -2, 0, -1]


def _sizing(context: int, steps: int) -> EngineSizing:
    return EngineSizing(pool_bytes=8 << 20, slots=2, max_model_len=context + steps + 16,
                        max_prefill_tokens=128, page_size=16, hot_cache_rows=64,
                        kv_cache_dtype="auto", spec_width=2, graphs=False, fused_kernels=False,
                        host_bytes=64 << 20)  # fmt: skip


def _decode(mode: str, replay: bool, context: int, steps: int) -> tuple[list[int], dict, dict]:
    """One imported prompt decoded ``steps`` tokens after its first in ``mode``: the tokens,
    the census of those steps (rows; empty: resident) and the shares the replay predicts
    (``predicted_census``; empty without a replay)."""
    model = cli.tiny_model(seed=3, mtp=False)
    sizing = _sizing(context, steps)
    prompt = [(7 * i + 3) % 250 for i in range(context)]
    store = LocalHostStore(sizing.host_bytes)
    eng, _ = build(model, cli.TINY, Variant(mode), sizing, store)
    r = replay_for(model, context, load_traces()) if replay else None
    if r is not None:
        install(eng, r)
    try:
        history = random_history(eng.kv, history_tokens(context, 16), seed=1)
        HistoryImport(eng, {tuple(prompt[:KEY_TOKENS]): history})
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        req = eng.add_request("replay", prompt, params)
        while not req.output_ids:  # the prefill of the prompt's last tokens
            eng.step()
        before = eng.kv.payload.census if mode != "resident" else None
        while eng.has_work():
            eng.step()
        got = {}
        if before is not None:
            after = eng.kv.payload.census
            got = {f: getattr(after, f) - getattr(before, f) for f in ("direct", "hot", "host")}
        pred = {}
        if r is not None and mode != "resident":
            layout = eng.kv.layout()
            pred = predicted_census(r, model.cfg, layout["hot_cache_rows"], layout["tail_rows"],
                                    steps)  # fmt: skip
        return list(req.output_ids), got, pred
    finally:
        eng.close()
        store.close()


def test_engine_serves_the_replay() -> None:
    """The census of a hisparse engine under the replay is the simulated cache's over the
    replayed rows (``predicted_census``; tolerance: 1% of the rows), its tokens a resident
    engine's under the same replay (the hierarchy stays exact), and its hot-cache hit rate is
    far above the same engine's with the random histories' own selections."""
    context, steps = 256, 16
    tokens, census, pred = _decode("hisparse", True, context, steps)
    total = sum(census.values())
    assert total == 6 * steps * 32  # every layer k rows a step: the replay's selections
    for key in census:
        assert abs(census[key] / total - pred[key]) <= 0.01, (census, pred)
    resident, _, _ = _decode("resident", True, context, steps)
    assert tokens == resident
    _, random_census, _ = _decode("hisparse", False, context, steps)
    assert _hit(census) > 0.7 and _hit(random_census) < 0.4, (census, random_census)


def test_load_tiny_replay(tmp_path) -> None:
    """``bench load --tiny --selections replay`` records the mapping and the census."""
    out_path = tmp_path / "load.json"
    assert bench_main([
        "load", "--tiny", "--selections", "replay", "--contexts", "200", "--concurrency", "1",
        "--noise-concurrency", "2", "--modes", "hisparse", "--spec", "off,fixed",
        "--spec-width", "3", "--acceptance", "0.9,0.8", "--output-len", "6", "--page", "16",
        "--hot-cache-rows", "64", "--max-prefill-tokens", "64", "--prefixes", "1",
        "--out", str(out_path),
    ]) == 0  # fmt: skip
    out = json.loads(out_path.read_text())
    assert out["selections"] == "replay"
    replay = out["sizing"][0]["replay"]
    assert replay["trace_context"] == 4096 and replay["expansion"] == 1
    assert replay["producers"] == 2 and replay["trace_producers"] == 4
    pred = replay["predicted_census"]
    assert pred["steps"] == 5 and pred["direct"] + pred["hot"] + pred["host"] == pytest.approx(1)
    assert [(r["mode"], r["spec"]) for r in out["runs"]] == [
        ("hisparse", "off"),
        ("adaptive", "off"),
        ("adaptive", "fixed"),
    ]  # the modes, then the spec group (adaptive without and with the MTP layer)
    for r in out["runs"]:
        m = r["metrics"]
        assert m["census"]["rows"] > 0 and m["imported"] == 2
    # the MTP layer's verify rounds under the control (forced acceptance) select the replay too
    fixed = out["runs"][-1]["metrics"]
    ctl = fixed["acceptance_control"]
    assert fixed["acceptance_length"] > 1 and ctl["kind"] == "force" and ctl["rounds"] > 0


def test_lru_census_is_the_engines() -> None:
    """The simulated cache over the trace reproduces the census the engine measured on the
    shipped model in the run that recorded the trace (``census.json``: hisparse, after its
    warm-up steps), so the replay's locality
    statistics are the resolver's."""
    doc = json.loads((ROOT / "docs" / "results" / "census.json").read_text())
    cfg = hf_family(ROOT / doc["target"])[1]
    producers = list(cfg.index_producers)
    sharing = [sum(1 for i, s in enumerate(cfg.layers)
                   if i == p or (s.index == "follower" and s.leader == p))
               for p in producers]  # fmt: skip
    traces = {t.context: t for t in load_traces()}
    for row in (r for r in doc["rows"] if r["weights"] == "trained"):
        trace, got = traces[row["context"]], {"direct": 0, "hot": 0, "host": 0}
        layout = row["hisparse"]["layout"]
        for j, n in enumerate(sharing):
            seq = [(trace.context + u, trace.rows[u, j]) for u in range(doc["decode_steps"] - 1)]
            warm = lru_census(seq[: doc["warmup_steps"]], layout["hot_cache_rows"],
                              layout["tail_rows"])  # fmt: skip
            all_ = lru_census(seq, layout["hot_cache_rows"], layout["tail_rows"])
            for key in got:
                got[key] += n * (all_[key] - warm[key])
        total = sum(got.values())
        for key in got:
            assert abs(got[key] / total - row["hisparse"][key]) < 0.002, (row["context"], got)


def test_drafter_layer_replays_behind_its_lag() -> None:
    """The MTP layer (its own indexer over a source lagging one row) replays after the target's
    producers: in a draft pass at position p it attends the rows its producer's table gives a
    query at p - 1, the last row the pass completes, never a row past it; a decode step's
    predicted census counts the target's producers only."""
    model = cli.tiny_model(seed=3, mtp=True)
    cfg, context = model.cfg, 256
    r = replay_for(model, context, load_traces())
    drafts = [i for i in cfg.index_producers if cfg.sources[cfg.layers[i].source].lag]
    assert len(drafts) == 1 and r.producer[drafts[0]] == r.targets == len(r.producer) - 1
    positions = [context, context + 3, context + 40]
    batch = ForwardBatch.build([0, 1, 2], positions, [1, 1, 1], "cpu")
    own = torch.full((3, cfg.index_topk), 5, dtype=torch.int64)
    got = r.rows(drafts[0], batch, own)
    for row, p in zip(got.tolist(), positions, strict=True):
        row = np.asarray(row)
        ref = decode_rows(r.table_np, r.targets, r.p0, p, context)
        recent = ref >= context - expansion(cfg.index_topk, r.trace) * r.trace.steps
        # history rows as the table has them; recent rows one behind, ending at p - 1
        assert (row[~recent] == ref[~recent]).all() and (row[recent] == ref[recent] - 1).all()
        assert row.max() == p - 1
    # before the prompt's end the layer keeps its own selection
    early = ForwardBatch.build([0], [context - 2], [1], "cpu")
    assert (r.rows(drafts[0], early, own[:1]) == 5).all()
    pred = predicted_census(r, cfg, 64, 16, 4)
    plain = predicted_census(replay_for(cli.tiny_model(seed=3, mtp=False), context,
                                        load_traces()), cfg, 64, 16, 4)  # fmt: skip
    assert pred == plain
