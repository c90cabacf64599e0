"""DeepSeek-V4's MTP layer (``mtp.0.*``, ``--drafter mtp``) against its plain-torch reference
(``mtp_reference.V4MTPReference``, from DeepSeek's ``MTPBlock``) on a tiny random V4 checkpoint
with an appended MTP layer: loading (DeepSeek's names and transformers' module names), every
draft step's logits and recycled streams, a verify round's commit of the MTP rows, the layer's
rows kept in its window's ring alone (no payload page, host region, manifest or prefix row); in
the engine, speculative greedy output equal to transformers' greedy in every serving mode with
chunked prefill, and a speculating durable session resumed after its worker dies."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from dhisparse.family.hf_config import ConfigError
from dhisparse.family.v4_config import parse_v4_config, v4_topology
from services.worker.engine.engine import Engine
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig, ResidencyConfig, bytes_per_token
from services.worker.model.v4_serving import V4Model
from services.worker.ops.fp4_e2m1 import dequantize_fp4
from services.worker.ops.fp8_blockwise import dequantize_blockwise
from services.worker.request.request import SamplingParams
from services.worker.serving.cache import KVCache
from services.worker.speculative.config import SpeculationConfig
from services.worker.speculative.drafters.mtp import MTPDrafter
from services.worker.weights.model_io import load_model
from tests import hf_tiny, hf_tiny_v4
from tests.worker.model import serving
from tests.worker.mtp_fixture import check_speculating_resume, v4_mtp_checkpoint
from tests.worker.mtp_reference import V4MTPReference

STEPS = 5
RTOL = 1e-4
SPEC = SpeculationConfig("mtp", 4, "fixed")


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> tuple[V4MTPReference, Path]:
    return v4_mtp_checkpoint(tmp_path_factory)


def _kv(model: V4Model, mode: str) -> KVCache:
    kw: dict = dict(mode=mode, max_slots=2, max_model_len=256, spec_block=STEPS + 1,
                    dtype=torch.float32)  # fmt: skip
    if mode == "hisparse":
        kw |= dict(hot_cache_rows=16, kv_pool_bytes=32 << 20)
    return KVCache(model.cfg, KVCacheConfig(**kw))


def _prefill(model: V4Model, kv: KVCache, ids: torch.Tensor, chunks: list[int]) -> None:
    """Commits ``ids`` in slot 0 in prefill chunks, with room for the draft steps after."""
    assert kv.admit(0, "r", len(ids), len(ids) + STEPS + 1)
    assert kv.ensure(0, len(ids) + STEPS + 1)
    start = 0
    for n in chunks:
        batch = ForwardBatch.build([0], [start], [n], "cpu", prefill=True)
        model(ids[start : start + n], batch, kv)
        start += n
        kv.commit(batch, [start])


def _draft(model: V4Model, kv: KVCache, anchor: int, n: int, tokens: list[int]) -> list:
    """Draft steps from ``anchor`` at position n, step i > 0 reading ``tokens[i-1]``."""
    src = model.cfg.layers[model.mtp_layer].source
    hidden, out = None, []
    for i in range(len(tokens) + 1):
        token = torch.tensor([anchor if i == 0 else tokens[i - 1]])
        batch = ForwardBatch.build([0], [n + i], [1], "cpu", sources=(src,))
        step = model.mtp_step(token, batch, kv, hidden)
        out.append(step)
        hidden = step.hidden
    return out


def test_the_mtp_layer_is_loaded_only_when_asked(family, tmp_path_factory) -> None:
    """Without ``mtp`` the target alone; with it layer 4 is a draft layer over a sliding
    source of its own lagging by one that keeps no history (no stored row: its window is its
    token ring), the carry as wide as the streams. The same layer stored under transformers'
    module names loads to the same parameters."""
    _, path = family
    plain = load_model(path)
    assert isinstance(plain, V4Model) and plain.mtp is None and not plain.cfg.draft_layers
    model = load_model(path, mtp=True)
    assert isinstance(model, V4Model) and model.mtp is not None
    cfg = model.cfg
    assert cfg.draft_layers == (4,) and model.mtp_layer == 4
    src = cfg.sources[cfg.layers[4].source]
    assert (src.compress, src.window, src.lag, src.stored) == (1, 8, 1, False)
    assert cfg.rows_for_tokens(cfg.layers[4].source, 10) == 0
    assert cfg.layers[4].source not in cfg.stored_sources
    assert cfg.extra["carry_width"] == 4 * 64
    _, modules = v4_mtp_checkpoint(tmp_path_factory, names="modules")
    other = load_model(modules, mtp=True)
    assert other.mtp is not None
    want = model.mtp.state_dict()
    got = other.mtp.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_released_fp8_fp4_mtp_layer_loads_dequantised(family, tmp_path: Path) -> None:
    """The MTP layer as released (``e_proj`` / ``h_proj`` and the attention projections FP8
    with UE8M0 block scales, routed experts FP4) beside a released-form target: every MTP
    parameter is its stored tensor dequantised, or the stored tensor itself."""
    ref, _ = family
    path = hf_tiny_v4.save_released_form(ref.target, tmp_path / "released")
    stored = hf_tiny_v4.released_tensors(ref.mtp.tensors, 16)
    hf_tiny.append_mtp(path, dataclasses.replace(ref.mtp, tensors=stored))
    model = load_model(path, mtp=True)
    assert model.mtp is not None
    got = model.mtp.state_dict()
    quantized = 0
    for name, t in stored.items():
        if name.endswith(".scale") and not name.endswith("hc_head_scale"):
            continue
        scale = stored.get(name.removesuffix(".weight") + ".scale")
        if t.dtype == torch.float8_e4m3fn:
            want, quantized = dequantize_blockwise(t, scale, (16, 16)), quantized + 1
        elif t.dtype == torch.int8:
            want, quantized = dequantize_fp4(t, scale), quantized + 1
        else:
            want = t.float()
        assert torch.equal(got[name.removeprefix("mtp.0.")], want), name
    assert quantized > 2 + 5 + 3 * 8  # e_proj, h_proj, attention, shared and routed experts


def test_an_mtp_layer_that_compresses_or_is_missing_is_refused(family, tmp_path: Path) -> None:
    """A trailing ``compress_ratios`` entry other than 0 (a compressed MTP layer) and
    ``num_nextn_predict_layers`` 0 are start-up errors naming them with ``--drafter mtp``."""
    _, path = family
    raw = json.loads((path / "config.json").read_text())
    cfg = parse_v4_config(raw | {"compress_ratios": [*raw["compress_ratios"][:-1], 4]})
    assert cfg.mtp_compress == 4
    v4_topology(cfg, "v4")  # the target alone is served
    with pytest.raises(ConfigError, match="ratio 4"):
        v4_topology(cfg, "v4", mtp=True)
    d = tmp_path / "none"
    d.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    (d / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers 1"):
        load_model(d, mtp=True)


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
@pytest.mark.parametrize("length", [5, 41])
def test_draft_steps_equal_the_reference(family, mode: str, length: int) -> None:
    """A prompt committed in chunks (the MTP rows each pass completes, the carry between
    passes), then five draft steps teacher-forced with the reference's proposals: each step's
    logits within 1e-4 relative, its token the reference's, the streams it recycles the
    reference's. A prompt within the window (8) and one five windows long."""
    ref, path = family
    model = load_model(path, mtp=True)
    ids = hf_tiny_v4.token_ids(length + 1, length)  # the last is the anchor
    want = ref.draft(ids, STEPS)
    proposals = [int(s.logits.argmax()) for s in want]
    kv = _kv(model, mode)
    _prefill(model, kv, ids[:-1], [length] if length < 8 else [13, 1, length - 14])
    steps = _draft(model, kv, int(ids[-1]), length, proposals[:-1])
    for i, (got, w) in enumerate(zip(steps, want, strict=True)):
        hf_tiny_v4.assert_close(got.logits[0], w.logits, RTOL)
        assert int(got.logits[0].argmax()) == proposals[i], f"step {i}"
        hf_tiny_v4.assert_close(got.hidden[0], w.streams.flatten(), RTOL)
        assert got.selection.shape == (1, 0)
    kv.close()


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_a_verify_round_commits_the_mtp_rows_of_its_accepted_prefix(family, mode: str) -> None:
    """Prefill, a round of draft steps (rows in the MTP ring), then a verify pass of four
    tokens that commits the anchor and two of them: the next round's steps equal the
    reference's over the committed tokens, so the verify pass rewrote the draft's rows of the
    accepted prefix (row n-1 from the carry) and its carry holds the streams of the last
    accepted position."""
    ref, path = family
    model = load_model(path, mtp=True)
    n, accepted = 30, 2
    ids = hf_tiny_v4.token_ids(n + 5, 77)  # prompt, anchor, three verified tokens, next anchor
    kv = _kv(model, mode)
    _prefill(model, kv, ids[:n], [n])
    _draft(model, kv, int(ids[n]), n, [5, 6, 7])
    verify = ForwardBatch.build([0], [n], [4], "cpu")
    model(ids[n : n + 4], verify, kv)
    kv.commit(verify, [n + accepted + 1])
    committed = torch.cat([ids[: n + accepted + 1], ids[n + 4 :]])  # with the next anchor
    want = ref.draft(committed, 3, tokens=[9, 10])
    got = _draft(model, kv, int(ids[n + 4]), n + accepted + 1, [9, 10])
    for g, w in zip(got, want, strict=True):
        hf_tiny_v4.assert_close(g.logits[0], w.logits, RTOL)
    kv.close()


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_the_mtp_layer_stores_no_row_beyond_its_window(family, mode: str) -> None:
    """A prompt of 25 windows committed with the MTP layer takes what it takes without it:
    the same payload pages (resident: no pool of the MTP source; hisparse: no hot cache or
    tail of it, the same host regions) and bytes per token; the MTP layer's rows are in its
    window's ring alone."""
    _, path = family
    ids = hf_tiny_v4.token_ids(200, 31)
    held = []
    for mtp in (True, False):
        model = load_model(path, mtp=mtp)
        kv = _kv(model, mode)
        _prefill(model, kv, ids, [64, 64, 72])
        regions = [] if kv.host_backups is None else kv.host_backups.regions(0)
        per_token = bytes_per_token(model.cfg, 4, True)
        held.append((kv.payload.memory(1), [(r.source, r.num_rows) for r in regions], per_token))
        if mtp:
            src, stored = model.mtp_source, model.cfg.stored_sources
            assert src not in stored and model.cfg.rows_for_tokens(src, len(ids)) == 0
            if mode == "resident":
                assert sorted(kv.payload.pools) == list(stored)
            else:
                assert kv.payload.store.num_sources == len(stored)
                assert sorted(r.source for r in regions) == list(stored)
            # the window's ring positions 193 .. 199 hold MTP rows 192 .. 198 (row t under the
            # token t + 1 that completes it)
            ring = kv.rings[src]
            window = ring.data[0, torch.arange(193, 200) % ring.ring]
            assert bool((window.abs().sum(-1) > 0).all())
        kv.close()
    assert held[0] == held[1]


def _ids(n: int, seed: int) -> list[int]:
    return hf_tiny_v4.token_ids(n, seed).tolist()


def _engine(path: Path, mode: str, host: tuple | None = None, **kw) -> Engine:
    return serving.engine(path, mode, host, **({"speculation": SPEC, "kv_pool_mib": 48} | kw))


def _tight_pool_mib(path: Path) -> float:
    """A pool of 80 pages (of ``hf_tiny_v4.PAGE`` rows: the compressed sources' few rows fill
    pages) beyond the fixed allocations of a speculating adaptive engine: admissions of later
    requests reclaim optional history of the running ones."""
    probe = _engine(path, "adaptive", hot_cache_rows=16, page_size=hf_tiny_v4.PAGE)
    page_bytes = hf_tiny_v4.PAGE * probe.model_cfg.d_kv * 4
    fixed = (48 << 20) - probe.kv.payload.store.pages.total * page_bytes
    probe.close()
    return (fixed + 80 * page_bytes) / (1 << 20)


@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_speculative_greedy_equals_transformers_greedy(family, mode: str) -> None:
    """Six requests, three arriving while the first three speculate, prompts prefilled in
    chunks of at most 64 tokens: every output is transformers' greedy continuation and the MTP
    layer drafted for every round; in adaptive, admissions reclaim optional history."""
    ref, path = family
    kw: dict = {"hot_cache_rows": 16}
    if mode == "adaptive":
        kw |= dict(kv_pool_mib=_tight_pool_mib(path), page_size=hf_tiny_v4.PAGE,
                   residency=ResidencyConfig(populate_pages=4))  # fmt: skip
    eng = _engine(path, mode, **kw)
    assert isinstance(eng.speculator.drafter, MTPDrafter)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reqs = []
    for i, n in enumerate((150, 61, 197, 90, 120, 40)):
        if i == 3:
            for _ in range(12):
                eng.step()
        reqs.append(eng.add_request(f"r{i}", _ids(n, 400 + n), params))
    while eng.has_work():
        eng.step()
    for r in reqs:
        assert len(r.output_ids) == 20
        assert r.output_ids == hf_tiny.greedy_under_reference(
            ref.target, r.prompt_ids, r.output_ids
        )
    c = eng.speculator.counters
    assert c.drafts > 0 and c.draft_tokens > 0
    if mode == "adaptive":
        st = eng.kv.payload.residency.stats
        assert st.reclaim_events > 0, st
    eng.close()


@pytest.mark.parametrize("mode", ["hisparse", "adaptive"])
def test_a_speculating_session_resumes_without_a_prompt_recompute(family, mode: str) -> None:
    """An engine speculating with V4's MTP layer is dropped mid-stream; its successor adopts
    the sessions from the host store — the MTP layer's window ring and the carry of streams
    with the target's rings — and continues them speculating, token for token as an
    uninterrupted run (greedy, and seeded sampling), drafting what it drafted, without
    computing a prompt token."""
    _, path = family
    prompts = [_ids(n, 500 + n) for n in (70, 25)]
    check_speculating_resume(functools.partial(_engine, path, mode), prompts, 20)


def test_a_durable_session_keeps_the_mtp_layer_in_its_ring_snapshot_alone(family) -> None:
    """A speculating durable session's host regions are the target's sources', its keys',
    its page carries' and its manifest's, none of the MTP source; its manifest counts the
    target's sources' committed rows and snapshots the MTP layer's window ring."""
    from services.worker.durable import manifest
    from services.worker.durable.host_link import HostLink
    from services.worker.hierarchy.local_store import LocalHostStore

    _, path = family
    store = LocalHostStore(64 << 20)
    eng = _engine(path, "hisparse", (store, store.mapping))
    HostLink(store, "local", 30.0, eng.kv.host_backups).register()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    req = eng.add_request("r", _ids(150, 700), params)
    while len(req.output_ids) < 8:
        eng.step()
    assert eng.speculator.counters.drafts > 0 and req.slot is not None
    cfg = eng.model_cfg
    src = cfg.layers[cfg.draft_layers[0]].source
    regions = eng.kv.host_backups.regions(req.slot)
    assert sorted(r.source for r in regions if r.source >= 0) == list(cfg.stored_sources)
    assert src not in cfg.stored_sources
    _, raw = manifest.read(eng.kv.sessions.manifest_buffer(req.slot).numpy(), "r")
    record = manifest.decode(raw)
    n = record.num_computed
    assert record.committed_rows == [cfg.rows_for_tokens(s, n) for s in cfg.stored_sources]
    assert src in record.rings
    eng.close()
    store.close()


def test_a_speculating_next_turn_imports_its_prefix_and_drafts_as_without(family) -> None:
    """V4 speculating with its MTP layer: a conversation's next turn on another worker of the
    node imports the first turn's pages — the target's rows, keys, the rings a reader at the
    prefix's end needs (the MTP layer's window among them: no row of it besides) and the page
    carry of hyper-connection streams — gives transformers' greedy tokens and drafts at every
    round what a worker with no cache drafts."""
    from services.worker.durable.host_link import HostLink
    from services.worker.hierarchy.local_store import LocalHostStore
    from tests.worker.mtp_fixture import record_drafts

    ref, path = family
    store = LocalHostStore(64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    drafts: dict[str, dict] = {}
    hits: list[set[int]] = []
    acquire = store.acquire_prefix

    def acquired(*args, **kw):
        hit = acquire(*args, **kw)
        hits.append(set() if hit is None else {r.source for r in hit.regions})
        return hit

    store.acquire_prefix = acquired  # type: ignore[method-assign]

    def make(owner: str, prefix_cache: bool = True) -> Engine:
        host = (store, store.mapping)
        eng = _engine(path, "hisparse", host, owner=owner, prefix_cache=prefix_cache)
        HostLink(store, owner, 30.0, eng.kv.host_backups).register()
        record_drafts(eng, drafts.setdefault(owner, {}))
        return eng

    w0, w1 = make("w0"), make("w1")
    first = _ids(92, 600)
    (turn1,) = w0.generate([first], params)
    prompt = [*first, *turn1.output_ids, *_ids(6, 601)]
    (turn2,) = w1.generate([prompt], params)
    (uncached,) = make("ref", prefix_cache=False).generate([prompt], params)
    assert turn2.output_ids == uncached.output_ids
    assert turn2.output_ids == hf_tiny.greedy_under_reference(ref.target, prompt, turn2.output_ids)
    hit = turn2.output().cached_prompt_tokens
    assert w1.scheduler.prefix.stats.hits == 1 and hit == (92 + 20 - 1) // 16 * 16
    assert w1.stats.prefill_tokens_computed == len(prompt) - hit
    # the record holds the target's sources' rows; of the MTP layer only its ring's snapshot
    cfg = w1.model_cfg
    assert [set(cfg.stored_sources)] == [{s for s in h if s >= 0} for h in hits if h]
    assert cfg.layers[cfg.draft_layers[0]].source not in cfg.stored_sources
    assert drafts["w1"] and all(drafts["ref"].get(k) == v for k, v in drafts["w1"].items())
    store.close()
