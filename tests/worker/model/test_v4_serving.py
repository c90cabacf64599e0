"""DeepSeek-V4 served by the engine (``model/v4_serving.py``) against transformers 5.17.0 (the
oracle), in fp32 on the CPU, on a tiny random checkpoint with every branch active (sliding
window, CSA with its indexer, HCA, mHC, hash and learned routing): teacher-forced logits of
two requests sharing every pass through the KV cache, in prefill chunks and decode steps;
greedy tokens of batched requests through ``Engine.generate`` with chunked prefill (resident,
hisparse, adaptive reclaiming history), through ``dhisparse generate`` and after a durable
session's adoption; prompt logprobs; hisparse's compressed rows bit-identical to resident's;
what V4 is not served with stops start-up, named."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dhisparse.cli import main as cli_main
from dhisparse.family.hf_config import ConfigError
from dhisparse.family.hf_dir import hf_family
from dhisparse.family.v4_config import v4_state_rings
from dhisparse.tokenizer import load_tokenizer
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
from services.worker.serving.hierarchy_build import hierarchy_fixed_bytes
from services.worker.speculative.config import SpeculationConfig
from services.worker.weights.model_io import load_model
from tests import hf_tiny, hf_tiny_v4
from tests.worker.model import serving

RTOL = 1e-4


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    return hf_tiny_v4.build(hf_tiny_v4.v4_config(), seed=5)


@pytest.fixture(scope="module")
def path(ref, tmp_path_factory) -> Path:
    return hf_tiny_v4.save_hub_style(ref, tmp_path_factory.mktemp("v4"))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    hf_tiny_v4.assert_close(got, want, RTOL)


def test_the_topology_gives_each_layer_its_window_and_compressed_rows(path) -> None:
    model = load_model(path)
    assert isinstance(model, V4Model)
    cfg = model.cfg
    assert [(s.compress, s.window) for s in cfg.sources] == [(4, 8), (8, 8), (4, 8)]
    assert cfg.d_kv == 32 and cfg.d_index == 16 and cfg.index_topk == 4
    # the sliding layer 0: no source, no keys; the HCA layer 2: no keys
    assert [(spec.source, spec.index) for spec in cfg.layers] == [
        (-1, "none"), (0, "producer"), (1, "none"), (2, "producer"),
    ]  # fmt: skip
    assert cfg.key_producers == (1, 3)
    # the sliding layer's window; the compressors' rings: CSA layers 1 and 3 (attention,
    # indexer), HCA layer 2
    state = list(v4_state_rings(model.family))
    assert state == [
        (0, "window", 8, 32), (1, "kv", 8, 128), (1, "index", 8, 64), (2, "kv", 8, 64),
        (3, "kv", 8, 128), (3, "index", 8, 64),
    ]  # fmt: skip
    kv_cfg = KVCacheConfig(mode="hisparse", max_slots=3, max_model_len=64, dtype=torch.float32)
    kv = KVCache(cfg, kv_cfg)
    assert sorted(kv.index_keys.pools) == [1, 3]
    extra = kv_cfg.token_ring_extra  # a verify block and a page (prefixes leave rings)
    state_bytes = 3 * sum((rows + extra) * width for *_, rows, width in state) * 4
    source_bytes = 3 * 3 * (8 + extra) * cfg.d_kv * 4
    assert kv.ring_bytes == source_bytes + state_bytes
    bare = replace(cfg, extra={})
    fixed = hierarchy_fixed_bytes(cfg, kv_cfg) - hierarchy_fixed_bytes(bare, kv_cfg)
    assert fixed == state_bytes
    kv.close()


def test_two_requests_sharing_passes_give_transformers_logits(ref, path) -> None:
    """Slots 2 and 0 in the same passes at different positions: prefill chunks of both, one
    continuing while the other starts, decode steps of both, then a last chunk of one beside
    the other's decode step; every token's logits as one transformers forward over its whole
    sequence gives them (CSA and HCA rows completed within chunks and across passes)."""
    model = load_model(path)
    kv = KVCache(model.cfg, KVCacheConfig(max_slots=3, max_model_len=128, dtype=torch.float32))
    seqs = {2: hf_tiny_v4.token_ids(45, 21), 0: hf_tiny_v4.token_ids(38, 22)}
    for slot, ids in seqs.items():
        assert kv.admit(slot, f"r{slot}", len(ids), len(ids))
    passes = [
        [(2, 13)], [(2, 10), (0, 7)], [(2, 1), (0, 17)], *([[(2, 1), (0, 1)]] * 6),
        [(2, 15), (0, 1)], [(0, 7)],
    ]  # fmt: skip
    got = hf_tiny_v4.interleaved_logits(model, kv, seqs, passes)
    for slot, ids in seqs.items():
        _close(got[slot], hf_tiny.reference_logits(ref, ids))
    kv.close()


def test_bf16_serving_keeps_transformers_fp32_logits_within_bf16(tmp_path) -> None:
    """A dense checkpoint (every visible row selected, every expert active: no selection or
    routing flips, which dominate bf16's gap on random weights) served in bfloat16 with the
    tensors transformers keeps in fp32 kept so: two requests sharing passes through the KV
    cache give logits within 3% (of the largest) of transformers' fp32 forward and its
    argmax at nearly every position; a window's and a compressed row's store in bfloat16."""
    dense = hf_tiny_v4.v4_config(index_topk=64, num_experts_per_tok=8)
    ref = hf_tiny_v4.build(dense, seed=6)
    model = load_model(hf_tiny_v4.save_hub_style(ref, tmp_path), dtype=torch.bfloat16)
    attn = model.net.layers[1].attn
    assert attn.attn_sink.dtype == attn.q_norm.weight.dtype == torch.float32
    assert attn.wq_a.weight.dtype == model.net.embed.weight.dtype == torch.bfloat16
    assert model.dtype == torch.bfloat16  # what the engine sizes its KV rows and rings in
    kv = KVCache(model.cfg, KVCacheConfig(max_slots=3, max_model_len=128, dtype=torch.bfloat16))
    seqs = {2: hf_tiny_v4.token_ids(45, 23), 0: hf_tiny_v4.token_ids(38, 24)}
    for slot, ids in seqs.items():
        assert kv.admit(slot, f"r{slot}", len(ids), len(ids))
    passes = [[(2, 13)], [(2, 10), (0, 7)], [(2, 22), (0, 31)]]
    got = hf_tiny_v4.interleaved_logits(model, kv, seqs, passes)
    assert kv.payload.pool(1).dtype == torch.bfloat16
    for slot, ids in seqs.items():
        want = hf_tiny.reference_logits(ref, ids)
        hf_tiny_v4.assert_close(got[slot], want, 3e-2)
        agree = (got[slot].argmax(-1) == want.argmax(-1)).float().mean()
        assert agree >= 0.95, f"argmax agrees at {agree:.0%} of positions"
    kv.close()


PROMPTS = (37, 9, 50, 22)


def test_engine_generate_batched_with_chunked_prefill_equals_transformers_greedy(ref, path) -> None:
    """Four requests through ``Engine.generate`` with three seats, prefill chunks of at most
    16 tokens beside the others' decode steps: 14 greedy tokens each, transformers' greedy
    continuations."""
    eng = Engine(EngineConfig(
        model=str(path), mode="resident", max_num_seqs=3, max_model_len=128,
        max_prefill_tokens=16, kv_pool_mib=8,
    ))  # fmt: skip
    passes: list[list[int]] = []
    run_pass = eng.run_pass

    def recorded(reqs: list, lens: list[int] | None = None) -> list:
        passes.append(list(lens) if lens is not None else [1] * len(reqs))
        return run_pass(reqs, lens)

    eng.run_pass = recorded
    prompts = [hf_tiny_v4.token_ids(n, 300 + n).tolist() for n in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    reqs = eng.generate(prompts, [params] * len(prompts))
    assert max(map(max, passes)) == 16 and max(map(len, passes)) == 3, passes
    for prompt, req in zip(prompts, reqs, strict=True):
        assert len(req.output_ids) == 14
        assert req.output_ids == hf_tiny.greedy_under_reference(ref, prompt, req.output_ids)
    eng.close()


def test_prompt_logprobs_equal_transformers(ref, path) -> None:
    """A prompt of 70 tokens prefilled in chunks of 16 beside another request: the engine's
    logprob of each prompt token (and the top 4) is ``log_softmax`` of transformers' logits."""
    eng = Engine(EngineConfig(
        model=str(path), mode="resident", max_num_seqs=2, max_model_len=128,
        max_prefill_tokens=16, kv_pool_mib=8,
    ))  # fmt: skip
    prompt, beside = hf_tiny_v4.token_ids(70, 31).tolist(), hf_tiny_v4.token_ids(30, 32).tolist()
    got, want = serving.scored_prompt(
        eng, lambda p: hf_tiny.reference_logits(ref, torch.tensor(p)), prompt, beside, 4
    )
    top = torch.tensor([[v for _, v in lp.top] for lp in got])
    torch.testing.assert_close(top, torch.topk(want, 4, dim=-1).values, atol=2e-4, rtol=0)
    eng.close()


@pytest.mark.parametrize("mode", [[], ["--mode", "resident"]])
def test_dhisparse_generate_prints_transformers_greedy(ref, path, capsys, mode) -> None:
    """As configured by default (adaptive, durable sessions) and in resident mode."""
    texts = ["the V4 engine", "a window, compressed rows and sinks"]
    argv = ["generate", "--model", str(path), *mode, "--max-tokens", "10"]
    assert cli_main([*argv, "--ignore-eos", "--json", *(f"--prompt={t}" for t in texts)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tok = load_tokenizer(path)
    assert [line["prompt"] for line in lines] == texts
    for text, line in zip(texts, lines, strict=True):
        out = line["token_ids"]
        assert len(out) == 10
        assert out == hf_tiny.greedy_under_reference(ref, tok.encode_prompt(text), out)


def _drive(
    model: V4Model, mode: str, lens: list[int], steps: int, **kv_kw
) -> tuple[list[list[LayerTrace]], list[torch.Tensor], list[list[int]], KVCache]:
    """Prefills fresh random prompts of ``lens`` tokens together (one pass), then decodes them
    together greedily for ``steps`` steps: (per pass the CSA / HCA layers' traces, per pass the
    logits, the tokens, the cache); rows in the model's dtype."""
    kv = KVCache(model.cfg, KVCacheConfig(
        mode=mode, max_slots=len(lens) + 1, max_model_len=256, page_size=4,
        kv_pool_bytes=16 << 20, host_arena_bytes=16 << 20, dtype=model.net.embed.weight.dtype,
        **kv_kw,
    ))  # fmt: skip
    prompts = [hf_tiny_v4.token_ids(n, 500 + n) for n in lens]
    slots = list(range(1, len(lens) + 1))
    for slot, p in zip(slots, prompts, strict=True):
        assert kv.admit(slot, f"r{slot}", len(p), len(p) + steps)
    batch = ForwardBatch.build(slots, [0] * len(lens), lens, "cpu", prefill=True)
    trace: list[LayerTrace] = []
    logits = model.logits(model(torch.cat(prompts), batch, kv, trace=trace))
    kv.commit(batch, lens)
    logits = logits[batch.last_token_index]
    traces, all_logits = [trace], [logits]
    tokens = [[t] for t in logits.argmax(-1).tolist()]
    done = list(lens)
    for _ in range(steps):
        for slot, n in zip(slots, done, strict=True):
            assert kv.ensure(slot, n + 1)
        batch = ForwardBatch.build(slots, done, [1] * len(slots), "cpu")
        trace = []
        ids = torch.tensor([t[-1] for t in tokens])
        logits = model.logits(model(ids, batch, kv, trace=trace))
        done = [n + 1 for n in done]
        kv.commit(batch, done)
        traces.append(trace), all_logits.append(logits)
        for t, nxt in zip(tokens, logits.argmax(-1).tolist(), strict=True):
            t.append(nxt)
    return traces, all_logits, tokens, kv


@pytest.mark.parametrize("attention", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hisparse_reads_the_rows_resident_reads(path, dtype, attention) -> None:
    """Three requests of 150, 61 and 197 tokens, 24 decode steps, a hot cache of 8 rows per
    request and source (twice index_topk; an HCA query sees up to 27 rows, resolved 8 at a
    time): per pass and CSA / HCA layer the selection and the compressed rows attention reads
    are bit-identical to resident serving's, so are the logits and the tokens; rows came from
    the host and from the hot cache. In fp32 and bf16, through the torch reference of the
    sparse attention and its Triton kernels (the heads' sinks in the kernel)."""
    model = load_model(path, dtype=dtype)
    if attention == "triton":
        model.use_triton_attention()
    lens = [150, 61, 197]
    ref = _drive(model, "resident", lens, 24)
    run = _drive(model, "hisparse", lens, 24, hot_cache_rows=8)
    for ref_pass, run_pass in zip(ref[0], run[0], strict=True):
        assert [t.layer for t in ref_pass] == [t.layer for t in run_pass] == [1, 2, 3]
        for a, b in zip(ref_pass, run_pass, strict=True):
            assert torch.equal(a.selection, b.selection), a.layer
            assert torch.equal(a.rows, b.rows), f"layer {a.layer}: attention inputs differ"
    # the HCA query sees up to 27 rows, selected at the bucketed width 32 (-1 beyond)
    assert max(int((t.selection >= 0).sum(1).max()) for t in ref[0][-1]) == 27
    assert max(t.selection.shape[1] for t in ref[0][-1]) == 32
    for a, b in zip(ref[1], run[1], strict=True):
        assert torch.equal(a, b)
    assert ref[2] == run[2]
    census = run[3].payload.census
    assert census.host > 0 and census.hot > 0 and census.direct > 0, census
    ref[3].close()
    run[3].close()


def test_engine_hisparse_generate_equals_transformers_greedy(ref, path) -> None:
    """Three requests in hisparse mode (hot cache of 8 rows, prefill chunks of at most 32
    tokens): 16 greedy tokens each, transformers' greedy continuations; some rows came from
    the host."""
    eng = Engine(EngineConfig(
        model=str(path), mode="hisparse", max_num_seqs=3,
        max_model_len=256, page_size=4, hot_cache_rows=8, max_prefill_tokens=32,
        kv_pool_mib=8, host_arena_mib=16,
    ))  # fmt: skip
    prompts = [hf_tiny_v4.token_ids(n, 700 + n).tolist() for n in (120, 45, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reqs = eng.generate(prompts, [params] * len(prompts))
    for prompt, req in zip(prompts, reqs, strict=True):
        assert len(req.output_ids) == 16
        assert req.output_ids == hf_tiny.greedy_under_reference(ref, prompt, req.output_ids)
    assert eng.kv.payload.census.host > 0, eng.kv.payload.census
    eng.close()


def test_engine_adaptive_reclaiming_history_equals_transformers_greedy(ref, path) -> None:
    """Six requests, three arriving while the first three decode, in adaptive mode with a pool
    of 90 pages beyond its fixed allocations: admissions reclaim optional history, and the 20
    greedy tokens of each request are transformers' greedy continuations."""
    eng, reqs = hf_tiny_v4.reclaiming_run(path, pages=90, new_tokens=20, pause=12)
    for req in reqs:
        assert len(req.output_ids) == 20
        assert req.output_ids == hf_tiny.greedy_under_reference(ref, req.prompt_ids, req.output_ids)
    stats = eng.kv.payload.residency.stats
    assert stats.reclaim_events > 0 and stats.reclaim_pages > 0, stats
    eng.close()


def test_durable_sessions_resume_token_for_token(ref, path) -> None:
    """A hisparse engine dropped mid-generation is succeeded by one that adopts its sessions
    from the host store (compressed rows, index keys, the window and the compressors' rings)
    and continues them without recomputing a prompt: the tokens of an uninterrupted engine,
    transformers' greedy ones."""
    store = LocalHostStore(64 << 20)
    prompts = [hf_tiny_v4.token_ids(n, 800 + n).tolist() for n in (101, 42)]
    params = [SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)] * 2

    def make(owner: str) -> Engine:
        engine = Engine(EngineConfig(
            model=str(path), mode="hisparse", max_num_seqs=2, max_model_len=256,
            hot_cache_rows=16, max_prefill_tokens=64, kv_pool_mib=8, owner=owner,
        ), host=(store, store.mapping))  # fmt: skip
        HostLink(store, owner, 30.0, engine.kv.host_backups).register()
        return engine

    want, second = serving.resumed_after_death(make, store, prompts, params, steps=9)
    for prompt, out in zip(prompts, want, strict=True):
        assert out == hf_tiny.greedy_under_reference(ref, prompt, out)
    second.close()
    store.close()


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
        ({"speculation": SpeculationConfig(drafter="dflash")}, "--drafter dflash"),
        ({"dtype": "float16"}, "dtype torch.float16"),
    ],
)
def test_what_v4_is_not_served_with_stops_start_up_by_name(path, setting, named) -> None:
    with pytest.raises(ValueError, match=named):
        Engine(EngineConfig(model=str(path), **({"mode": "resident"} | setting)))


def test_the_v3_path_refuses_a_v4_directory_by_name(path) -> None:
    with pytest.raises(ConfigError, match="'deepseek_v4' is served by the engine's V4 model"):
        hf_family(path)


@pytest.mark.parametrize("page_size", [16, 4])
def test_a_next_turn_imports_the_rings_with_its_prefix(ref, path, page_size) -> None:
    """A conversation's next turn on another worker of the node imports the first turn's
    pages, with the rows of the window and compressor rings a reader at the prefix's end
    needs (the leaver a page less one token past it; pages of 4 end inside an HCA window of
    8): transformers' greedy tokens, and only the new tokens computed. A prompt matching
    part of a record imports nothing."""
    store = LocalHostStore(64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def make(owner: str, prefix_cache: bool = True) -> Engine:
        engine = Engine(EngineConfig(
            model=str(path), mode="hisparse", max_num_seqs=2, max_model_len=256,
            hot_cache_rows=16, max_prefill_tokens=64, kv_pool_mib=8, owner=owner,
            page_size=page_size, prefix_cache=prefix_cache,
        ), host=(store, store.mapping))  # fmt: skip
        HostLink(store, owner, 30.0, engine.kv.host_backups).register()
        return engine

    w0, w1 = make("w0"), make("w1")
    first = hf_tiny_v4.token_ids(100, 900).tolist()
    (turn1,) = w0.generate([first], params)
    computed = len(first) + params.max_tokens - 1
    assert computed % page_size == page_size - 1
    assert page_size == 16 or computed // page_size * page_size % 8 == 4  # inside a window
    prompt = [*first, *turn1.output_ids, *hf_tiny_v4.token_ids(5, 901).tolist()]
    (turn2,) = w1.generate([prompt], params)
    hit = computed // page_size * page_size
    assert w1.scheduler.prefix.stats.hits == 1 and turn2.output().cached_prompt_tokens == hit
    assert w1.stats.prefill_tokens_computed == len(prompt) - hit
    assert turn2.output_ids == hf_tiny.greedy_under_reference(ref, prompt, turn2.output_ids)
    (uncached,) = make("ref", prefix_cache=False).generate([prompt], params)
    assert turn2.output_ids == uncached.output_ids
    # the first prompt again matches fewer pages than a record holds, whose rings are of
    # its end: computed whole
    (again,) = w1.generate([first], params)
    assert again.output_ids == turn1.output_ids and w1.scheduler.prefix.stats.hits == 1
    assert w1.stats.prefill_tokens_computed == len(prompt) - hit + len(first)
    store.close()
