"""DeepSeek-V4.1's shared sources on a tiny random V4 checkpoint built and saved by transformers
5.17.0, its config.json extended with ``kv_source_layers`` / ``index_source_layers`` (which
transformers ignores), against the plain-torch reference ``tests.v41_reference``: layer 0
sliding, layer 1 a KV and index source, 2 a Reuse consumer of it, 3 a Reindex consumer (its
own top-k over layer 1's index keys), 4 a Reuse consumer of 3's selection over layer 1's rows,
5 a second KV and index source. Teacher-forced logits in chunks and decode steps, the loader
leaving the consumers' compressors unread (or meeting a checkpoint without them), the released
FP8 / FP4 form; served by
the engine: a shared source and its keys stored once, the reference's logits through the KV
cache, hisparse's attention inputs bit-identical to resident's, and greedy tokens with
chunked prefill in resident, hisparse and adaptive mode (reclaiming history too), with the MTP
drafter, and after a durable session's adoption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

from dhisparse.family.v4_config import v4_state_rings
from services.worker.durable.host_link import HostLink
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig
from services.worker.model.decoder import LayerTrace
from services.worker.model.v4_serving import V4Model
from services.worker.request.request import SamplingParams
from services.worker.serving.cache import KVCache
from services.worker.speculative.config import SpeculationConfig
from services.worker.weights.model_io import load_model
from services.worker.weights.v4_names import load_v4_model
from tests import hf_tiny, hf_tiny_v4, v41_reference
from tests.worker.model import serving

RTOL = 1e-4
KV, INDEX = [1, 5], [1, 3, 5]
CSA = "compressed_sparse_attention"
LAYERS = ["sliding_attention", *[CSA] * 5]


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    config = hf_tiny_v4.v4_config(
        num_hidden_layers=6, layer_types=LAYERS,
        mlp_layer_types=["hash_moe", "hash_moe", *["moe"] * 4],
    )  # fmt: skip
    return hf_tiny_v4.build(config, seed=41)


@pytest.fixture(scope="module")
def path(ref, tmp_path_factory) -> Path:
    path = hf_tiny_v4.save_hub_style(ref, tmp_path_factory.mktemp("v41"))
    return with_shared_sources(path)


def with_shared_sources(path: Path) -> Path:
    raw = json.loads((path / "config.json").read_text())
    raw |= {"kv_source_layers": KV, "index_source_layers": INDEX}
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def test_the_consumers_build_no_compressor_and_reuse_builds_no_indexer(path) -> None:
    model = load_v4_model(path)
    share = model.cfg.sharing
    assert [share.role(i) for i in range(6)] == [
        "sliding", "full", "reuse", "reindex", "reuse", "full",
    ]  # fmt: skip
    assert share.kv_source == (-1, 1, 1, 1, 1, 5) and share.index_source == (-1, 1, 1, 3, 3, 5)
    names = model.state_dict()
    for i, (rows, index, keys) in enumerate(
        [(False, False, False), (True, True, True), (False, False, False),
         (False, True, False), (False, False, False), (True, True, True)]
    ):  # fmt: skip
        at = f"layers.{i}.attn."
        assert (f"{at}compressor.wkv.weight" in names) == rows, i
        assert (f"{at}indexer.wq_b.weight" in names) == index, i
        assert (f"{at}indexer.compressor.wkv.weight" in names) == keys, i
        assert f"{at}wkv.weight" in names  # every layer's own window


def test_chunks_and_decode_steps_give_the_reference_logits(ref, path) -> None:
    """A prefill of 13, seven one-token decode steps and a chunk of 26: 46 tokens hold 11 rows
    of each source (index_topk 4), past the window of 8; each step's logits are the
    reference's over the whole sequence, and differ from V4's (the sources matter)."""
    ids = hf_tiny_v4.token_ids(46, 11)
    model = load_v4_model(path)
    state = model.new_state()
    steps = [(0, 13), *((i, i + 1) for i in range(13, 20)), (20, 46)]
    got = torch.cat([model(ids[a:b], state) for a, b in steps])
    want = v41_reference.logits(ref, KV, INDEX, ids)
    hf_tiny_v4.assert_close(got, want, RTOL)
    v4 = v41_reference.logits(ref, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], ids)
    assert torch.equal(v4, hf_tiny.reference_logits(ref, ids))  # every layer its own: V4
    assert (v4 - want).abs().max() > 1e-2 * want.abs().max()


def test_a_checkpoint_without_the_consumers_compressors_loads_the_same(path, tmp_path) -> None:
    """The form a V4.1 checkpoint would have: no compressor on a consumer, no indexer on a
    Reuse layer; the same model as the V4 checkpoint whose unused tensors were left unread."""
    weights = load_file(str(path / "model.safetensors"))
    unbuilt = tuple(
        f"layers.{i}.attn.{part}." for i in (2, 4) for part in ("compressor", "indexer")
    )
    unbuilt += ("layers.3.attn.compressor.", "layers.3.attn.indexer.compressor.")
    keep = {n: t for n, t in weights.items() if not n.startswith(unbuilt)}
    # a compressor: wkv, wgate, ape, norm; an indexer: its compressor, wq_b, weights_proj
    assert len(weights) - len(keep) == 2 * (4 + 6) + 4 + 4
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (path / name).exists():
            (tmp_path / name).write_text((path / name).read_text())
    save_file(keep, str(tmp_path / "model.safetensors"))
    want, got = load_v4_model(path).state_dict(), load_v4_model(tmp_path).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_released_fp8_fp4_form_gives_the_reference_over_it_dequantised(ref, tmp_path) -> None:
    """The checkpoint as DeepSeek releases V4 (FP8 projections, a Reuse layer's indexer
    ``wq_b`` among them, with their scales; FP4 routed experts), the keys added: the unread
    tensors' scales are no error, and the logits are the reference's over transformers loading
    the same files dequantised."""
    path = with_shared_sources(hf_tiny_v4.save_released_form(ref, tmp_path / "released"))
    stored = load_file(str(path / "model.safetensors"))
    assert stored["layers.2.attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert "layers.2.attn.indexer.wq_b.scale" in stored
    ids = hf_tiny_v4.token_ids(40, 13)
    model = load_v4_model(path)
    got = model(ids, model.new_state())
    oracle = DeepseekV4ForCausalLM.from_pretrained(
        path, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).eval()
    hf_tiny_v4.assert_close(got, v41_reference.logits(oracle, KV, INDEX, ids), RTOL)


# ---- served by the engine ---------------------------------------------------------------------
def test_the_topology_stores_a_shared_source_and_its_keys_once(path) -> None:
    model = load_model(path)
    cfg = model.cfg
    assert [(s.compress, s.window) for s in cfg.sources] == [(4, 8), (4, 8)]
    assert [(spec.source, spec.index, spec.leader, spec.keys_from) for spec in cfg.layers] == [
        (-1, "none", -1, -1), (0, "producer", -1, -1), (0, "reuse", 1, -1),
        (0, "producer", -1, 1), (0, "reuse", 3, -1), (1, "producer", -1, -1),
    ]  # fmt: skip
    assert cfg.key_producers == (1, 5) and cfg.key_layer(3) == 1
    # the sliding layer's window, the sources' compressors, the consumers' own windows
    assert list(v4_state_rings(model.family)) == [
        (0, "window", 8, 32), (1, "kv", 8, 128), (1, "index", 8, 64), (2, "window", 8, 32),
        (3, "window", 8, 32), (4, "window", 8, 32), (5, "kv", 8, 128), (5, "index", 8, 64),
    ]  # fmt: skip
    kv_cfg = KVCacheConfig(mode="hisparse", max_slots=2, max_model_len=64, dtype=torch.float32)
    kv = KVCache(cfg, kv_cfg)
    assert sorted(kv.index_keys.pools) == sorted(cfg.key_producers)
    assert sorted(kv.rings) == [0, 1]
    # a request's host backup: one region per source, the shared one's rows once
    assert kv.admit(1, "r1", 40, 64)
    regions = [r for r in kv.host_backups.regions(1) if r.source >= 0]
    assert sorted((r.source, r.num_rows) for r in regions) == [(0, 16), (1, 16)]
    kv.close()


def test_two_requests_sharing_passes_give_the_reference_logits(ref, path) -> None:
    """Slots 2 and 0 in the same passes at different positions, prefill chunks and decode
    steps: every token's logits as the reference's one forward over its sequence."""
    model = load_model(path)
    kv = KVCache(model.cfg, KVCacheConfig(max_slots=3, max_model_len=128, dtype=torch.float32))
    seqs = {2: hf_tiny_v4.token_ids(41, 21), 0: hf_tiny_v4.token_ids(34, 22)}
    for slot, ids in seqs.items():
        assert kv.admit(slot, f"r{slot}", len(ids), len(ids))
    passes = [
        [(2, 13)], [(2, 10), (0, 7)], [(2, 1), (0, 17)], *([[(2, 1), (0, 1)]] * 5),
        [(2, 12), (0, 5)],
    ]  # fmt: skip
    got = hf_tiny_v4.interleaved_logits(model, kv, seqs, passes)
    for slot, ids in seqs.items():
        want = v41_reference.logits(ref, KV, INDEX, ids)
        hf_tiny_v4.assert_close(got[slot], want, RTOL)
    kv.close()


def _drive(model: V4Model, mode: str, lens: list[int], steps: int, **kv_kw):
    """Prefills fresh random prompts of ``lens`` tokens in one pass, then decodes them
    greedily for ``steps`` steps: (per pass the compressed layers' traces, the tokens)."""
    kv = KVCache(model.cfg, KVCacheConfig(
        mode=mode, max_slots=len(lens) + 1, max_model_len=256, page_size=4,
        kv_pool_bytes=16 << 20, host_arena_bytes=16 << 20, dtype=torch.float32, **kv_kw,
    ))  # fmt: skip
    prompts = [hf_tiny_v4.token_ids(n, 500 + n) for n in lens]
    slots = list(range(1, len(lens) + 1))
    for slot, p in zip(slots, prompts, strict=True):
        assert kv.admit(slot, f"r{slot}", len(p), len(p) + steps)
    batch = ForwardBatch.build(slots, [0] * len(lens), lens, "cpu", prefill=True)
    trace: list[LayerTrace] = []
    logits = model.logits(model(torch.cat(prompts), batch, kv, trace=trace))
    kv.commit(batch, lens)
    traces, tokens = [trace], [[t] for t in logits[batch.last_token_index].argmax(-1).tolist()]
    done = list(lens)
    for _ in range(steps):
        for slot, n in zip(slots, done, strict=True):
            assert kv.ensure(slot, n + 1)
        batch = ForwardBatch.build(slots, done, [1] * len(slots), "cpu")
        trace = []
        logits = model.logits(model(torch.tensor([t[-1] for t in tokens]), batch, kv, trace=trace))
        done = [n + 1 for n in done]
        kv.commit(batch, done)
        traces.append(trace)
        for t, nxt in zip(tokens, logits.argmax(-1).tolist(), strict=True):
            t.append(nxt)
    census = getattr(kv.payload, "census", None)
    kv.close()
    return traces, tokens, census


def test_hisparse_reads_the_rows_resident_reads(path) -> None:
    """Two requests of 90 and 61 tokens, 12 decode steps, a hot cache of 8 rows: per pass and
    compressed layer (the Reuse consumers' included) the selection and the rows attention
    reads are bit-identical to resident serving's, so are the tokens; rows came from the
    host."""
    model = load_model(path)
    ref_traces, ref_tokens, _ = _drive(model, "resident", [90, 61], 12)
    traces, tokens, census = _drive(model, "hisparse", [90, 61], 12, hot_cache_rows=8)
    for ref_pass, run_pass in zip(ref_traces, traces, strict=True):
        assert [t.layer for t in ref_pass] == [t.layer for t in run_pass] == [1, 2, 3, 4, 5]
        for a, b in zip(ref_pass, run_pass, strict=True):
            assert torch.equal(a.selection, b.selection), a.layer
            assert torch.equal(a.rows, b.rows), f"layer {a.layer}: attention inputs differ"
    assert tokens == ref_tokens
    assert census.host > 0 and census.hot > 0, census


@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_engine_greedy_with_chunked_prefill_is_the_references(ref, path, mode) -> None:
    """Three requests through ``Engine.generate`` with two seats, prefill chunks of at most 16
    tokens beside the others' decode steps: 10 greedy tokens each, the reference's greedy
    continuations (hisparse: some rows from the host)."""
    eng = Engine(EngineConfig(
        model=str(path), mode=mode, max_num_seqs=2, max_model_len=128, page_size=4,
        hot_cache_rows=8, max_prefill_tokens=16, kv_pool_mib=8, host_arena_mib=16,
    ))  # fmt: skip
    prompts = [hf_tiny_v4.token_ids(n, 300 + n).tolist() for n in (53, 9, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reqs = eng.generate(prompts, [params] * len(prompts))
    for prompt, req in zip(prompts, reqs, strict=True):
        assert len(req.output_ids) == 10
        out = req.output_ids
        assert out == v41_reference.greedy_under(ref, KV, INDEX, prompt, out)
    if mode == "hisparse":
        assert eng.kv.payload.census.host > 0, eng.kv.payload.census
    eng.close()


def test_durable_sessions_resume_token_for_token(ref, path) -> None:
    """A hisparse engine dropped mid-generation is succeeded by one that adopts its sessions
    (the shared source's rows and keys, the sources' windows and compressors, the consumers'
    own windows) and continues them without recomputing a prompt: the reference's tokens."""
    store = LocalHostStore(64 << 20)
    prompts = [hf_tiny_v4.token_ids(n, 800 + n).tolist() for n in (57, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 2

    def make(owner: str) -> Engine:
        engine = Engine(EngineConfig(
            model=str(path), mode="hisparse", max_num_seqs=2, max_model_len=128,
            hot_cache_rows=8, max_prefill_tokens=32, kv_pool_mib=8, owner=owner,
        ), host=(store, store.mapping))  # fmt: skip
        HostLink(store, owner, 30.0, engine.kv.host_backups).register()
        return engine

    want, second = serving.resumed_after_death(make, store, prompts, params, steps=6)
    for prompt, out in zip(prompts, want, strict=True):
        assert out == v41_reference.greedy_under(ref, KV, INDEX, prompt, out)
    second.close()
    store.close()


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_mtp_speculation_over_shared_sources_gives_the_references_greedy(
    ref, path, tmp_path_factory, mode
) -> None:
    """The checkpoint with a random MTP layer appended (``--drafter mtp``: a sliding source of
    its own after the shared ones): speculative greedy output, prefill chunks of at most 16,
    is the reference's greedy; the MTP layer drafted."""
    mtp_path = tmp_path_factory.mktemp("v41-mtp")
    for f in path.iterdir():
        (mtp_path / f.name).write_bytes(f.read_bytes())
    hf_tiny.append_mtp(mtp_path, hf_tiny_v4.mtp_layer(seed=6, tmp=tmp_path_factory.mktemp("m")))
    eng = Engine(EngineConfig(
        model=str(mtp_path), mode=mode, max_num_seqs=2, max_model_len=128, page_size=4,
        hot_cache_rows=8, max_prefill_tokens=16, kv_pool_mib=8, host_arena_mib=16,
        speculation=SpeculationConfig("mtp", 3, "fixed"),
    ))  # fmt: skip
    assert eng.model_cfg.layers[6].source == 2  # after the two shared sources' owners
    prompts = [hf_tiny_v4.token_ids(n, 600 + n).tolist() for n in (45, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reqs = eng.generate(prompts, [params] * len(prompts))
    for prompt, req in zip(prompts, reqs, strict=True):
        out = req.output_ids
        assert len(out) == 12
        assert out == v41_reference.greedy_under(ref, KV, INDEX, prompt, out)
    c = eng.speculator.counters
    assert c.drafts > 0 and c.draft_tokens > 0
    eng.close()


def test_adaptive_reclaiming_history_gives_the_references_greedy(ref, path) -> None:
    """Six requests, three arriving while the first three decode, in adaptive mode with a pool
    of 70 pages beyond its fixed allocations: admissions reclaim optional history (the shared
    source's pages among them), and the 12 greedy tokens of each are the reference's."""
    eng, reqs = hf_tiny_v4.reclaiming_run(path, pages=70, new_tokens=12, pause=8)
    for req in reqs:
        out = req.output_ids
        assert len(out) == 12
        assert out == v41_reference.greedy_under(ref, KV, INDEX, req.prompt_ids, out)
    stats = eng.kv.payload.residency.stats
    assert stats.reclaim_events > 0 and stats.reclaim_pages > 0, stats
    eng.close()
