"""DeepSeek-V4.1's candidate blocks on the tiny random V4 checkpoint of ``test_v41_sources``
(layer 1 a KV and index source, 2 Reuse, 3 Reindex, 4 Reuse, 5 a second KV and index source),
its config.json adding a candidate source at layer 1 with blocks of 2 compressed rows, 3 kept
per query (5 positions at least, index_topk 4): from 7 rows on (token 27) a query's
candidates leave rows out, and layers 3 and 5 score only inside them. Against the plain-torch
reference ``tests.v41_reference`` (its ``select_candidate_blocks`` written from DeepSeek's):
the rule itself over random scores with ties, teacher-forced logits through the decoder and
through the KV cache (decode steps, short and long chunks, two requests per pass),
hisparse's selections and attention inputs bit-identical to resident's, and greedy tokens
with chunked prefill in resident, hisparse and adaptive mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dhisparse.family.v41_candidates import CandidateBlocks
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.kv.config import KVCacheConfig
from services.worker.model.candidate_blocks import PassCandidates, select_blocks, within_blocks
from services.worker.request.request import SamplingParams
from services.worker.serving.cache import KVCache
from services.worker.weights.model_io import load_model
from services.worker.weights.v4_names import load_v4_model
from tests import hf_tiny_v4, v41_reference
from tests.worker.model import serving
from tests.worker.model.test_v41_sources import INDEX, KV, LAYERS, _drive, with_shared_sources

RTOL = 1e-4
RULE = v41_reference.Candidates(source=1, block_size=2, topk_blocks=3)
KEYS = {"candidate_source_layer": 1, "candidate_block_size": 2, "candidate_topk_blocks": 3}


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    config = hf_tiny_v4.v4_config(
        num_hidden_layers=6, layer_types=LAYERS,
        mlp_layer_types=["hash_moe", "hash_moe", *["moe"] * 4],
    )  # fmt: skip
    return hf_tiny_v4.build(config, seed=41)


@pytest.fixture(scope="module")
def path(ref, tmp_path_factory) -> Path:
    path = with_shared_sources(hf_tiny_v4.save_hub_style(ref, tmp_path_factory.mktemp("v41c")))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | KEYS, indent=2))
    return path


def _logits(ref, ids: torch.Tensor) -> torch.Tensor:
    return v41_reference.logits(ref, KV, INDEX, ids, RULE)


@pytest.mark.parametrize("seed", range(6))
def test_the_blocks_are_the_references_over_random_scores_with_ties(seed) -> None:
    """Random scores rounded to few values (ties between blocks), unseen tails, rows that see
    nothing, widths not a multiple of the block: ``select_blocks`` keeps the reference's
    positions, and ``within_blocks`` masks exactly outside them."""
    g = torch.Generator().manual_seed(seed)
    t, s = 9, int(torch.randint(1, 40, (1,), generator=g))
    block = int(torch.randint(1, 6, (1,), generator=g))
    k = int(torch.randint(1, 8, (1,), generator=g))
    scores = torch.randint(0, 4, (t, s), generator=g).float()
    visible = torch.randint(0, s + 1, (t,), generator=g)
    visible[0] = 0
    seen = scores.masked_fill(torch.arange(s) >= visible[:, None], float("-inf"))
    want = v41_reference.select_candidate_blocks(seen[None], visible.view(1, t, 1), k, block)[0]
    count = min(k, -(-s // block))
    blocks = select_blocks(scores, visible, block, k, count)
    assert blocks.shape == (t, count)
    got = within_blocks(scores, blocks, block)
    assert torch.equal(got > float("-inf"), want), (s, block, k)
    assert torch.equal(got[want], scores[want])


def test_the_mask_leaves_rows_out_and_changes_the_logits(ref) -> None:
    """The reference with the candidates differs from the one without from token 27 on (its 7
    rows fill 4 blocks), and is it before (up to the MoE's batching: rounding)."""
    ids = hf_tiny_v4.token_ids(46, 11)
    with_mask, without = _logits(ref, ids), v41_reference.logits(ref, KV, INDEX, ids)
    hf_tiny_v4.assert_close(with_mask[:27], without[:27], RTOL)
    gap = (with_mask - without).abs().amax(dim=-1)
    assert bool((gap[27:] > 1e-2 * without.abs().max()).all())


def test_the_config_places_the_source_and_its_consumers(path) -> None:
    cfg = load_v4_model(path).cfg
    assert cfg.candidates == CandidateBlocks(1, block_size=2, topk_blocks=3, consumers=(3, 5))


def test_chunks_and_decode_steps_give_the_reference_logits(ref, path) -> None:
    """The decoder: a prefill of 13, seven decode steps and a chunk of 26 (46 tokens, 11 rows
    of each source): each step's logits are the reference's over the whole sequence."""
    ids = hf_tiny_v4.token_ids(46, 11)
    model = load_v4_model(path)
    state = model.new_state()
    steps = [(0, 13), *((i, i + 1) for i in range(13, 20)), (20, 46)]
    got = torch.cat([model(ids[a:b], state) for a, b in steps])
    hf_tiny_v4.assert_close(got, _logits(ref, ids), RTOL)


def test_two_requests_sharing_passes_give_the_reference_logits(ref, path) -> None:
    """Through the KV cache: slots 2 and 0 at different positions in the same passes, long
    chunks (scored per request), short ones (together) and decode steps."""
    model = load_model(path)
    kv = KVCache(model.cfg, KVCacheConfig(max_slots=3, max_model_len=128, dtype=torch.float32))
    seqs = {2: hf_tiny_v4.token_ids(53, 21), 0: hf_tiny_v4.token_ids(44, 22)}
    for slot, ids in seqs.items():
        assert kv.admit(slot, f"r{slot}", len(ids), len(ids))
    passes = [
        [(2, 30)], [(2, 10), (0, 7)], [(2, 1), (0, 24)], *([[(2, 1), (0, 1)]] * 5),
        [(2, 7), (0, 8)],
    ]  # fmt: skip
    got = hf_tiny_v4.interleaved_logits(model, kv, seqs, passes)
    for slot, ids in seqs.items():
        hf_tiny_v4.assert_close(got[slot], _logits(ref, ids), RTOL)
    kv.close()


def test_a_pass_keeps_its_blocks_in_its_own_state(path) -> None:
    """Each pass makes a ``PassCandidates`` of its own: a consumer before its source fails,
    and nothing is kept on the model or the batch between passes."""
    rule = load_model(path).family.candidates
    fresh = PassCandidates(rule)
    with pytest.raises(AssertionError, match="before its source"):
        fresh.step(3)(torch.zeros(1, 4), torch.ones(1, dtype=torch.int64), slice(0, 1), 1, 4)
    assert fresh.step(2) is None and fresh.blocks is None


def test_hisparse_reads_the_rows_resident_reads(path) -> None:
    """Two requests of 90 and 61 tokens, 12 decode steps, a hot cache of 8 rows: per pass and
    compressed layer the selection and the rows attention reads are resident serving's."""
    model = load_model(path)
    ref_traces, ref_tokens, _ = _drive(model, "resident", [90, 61], 12)
    traces, tokens, census = _drive(model, "hisparse", [90, 61], 12, hot_cache_rows=8)
    for ref_pass, run_pass in zip(ref_traces, traces, strict=True):
        for a, b in zip(ref_pass, run_pass, strict=True):
            assert torch.equal(a.selection, b.selection), a.layer
            assert torch.equal(a.rows, b.rows), f"layer {a.layer}: attention inputs differ"
    assert tokens == ref_tokens
    assert census.host > 0 and census.hot > 0, census


@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_engine_greedy_with_chunked_prefill_is_the_references(ref, path, mode) -> None:
    """Three requests through ``Engine.generate`` with two seats, prefill chunks of at most 16
    tokens beside the others' decode steps: 10 greedy tokens each, the reference's."""
    eng = Engine(EngineConfig(
        model=str(path), mode=mode, max_num_seqs=2, max_model_len=128, page_size=4,
        hot_cache_rows=8, max_prefill_tokens=16, kv_pool_mib=8, host_arena_mib=16,
    ))  # fmt: skip
    prompts = [hf_tiny_v4.token_ids(n, 300 + n).tolist() for n in (53, 9, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reqs = eng.generate(prompts, [params] * len(prompts))
    for prompt, req in zip(prompts, reqs, strict=True):
        out = req.output_ids
        assert len(out) == 10
        assert out == v41_reference.greedy_under(ref, KV, INDEX, prompt, out, RULE)
    eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_on_the_gpu_replayed_passes_equal_the_eager_ones_and_the_reference(ref, path, mode) -> None:
    """On a GPU (fp32, the Triton resolver, sparse attention and index-score kernels): decode
    passes replayed from CUDA graphs give the eager passes' tokens and logits bit for bit with
    the candidate mask inside the graph, and the reference's greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts = [hf_tiny_v4.token_ids(n, 700 + n).tolist() for n in (53, 41, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        eng = Engine(EngineConfig(
            model=str(path), mode=mode, device="cuda", dtype="float32", max_num_seqs=4,
            max_model_len=256, page_size=4, hot_cache_rows=None if mode == "resident" else 8,
            max_prefill_tokens=32, kv_pool_mib=16, host_arena_mib=16,
            graphs=GraphConfig(graphs),
        ))  # fmt: skip
        seen = serving.recorded_emits(eng)
        index = {r.request_id: i for i, r in enumerate(eng.generate(prompts, params))}
        runs[graphs] = {(index[r], n): logits for r, n, logits in seen}
        if graphs:
            assert eng.passes.graphs is not None and eng.passes.graphs.replays > 10
        eng.close()
    assert runs[True].keys() == runs[False].keys()
    for key, logits in runs[False].items():
        assert torch.equal(runs[True][key], logits), f"{mode} {key}: logits differ"
    for i, prompt in enumerate(prompts):
        out = [int(runs[True][(i, n)].argmax()) for n in range(24)]
        # the reference's slack of each token (0: its argmax; within a near-tie otherwise)
        want = _logits(ref, torch.tensor(prompt + out[:-1]))[len(prompt) - 1 :]
        chosen = want.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)
        slack = want.max(-1).values - chosen
        assert float(slack.max()) <= 1e-3, f"prompt {i}: slacks {slack.tolist()}"
