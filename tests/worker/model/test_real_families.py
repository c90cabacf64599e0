"""DeepSeek-V3.2 and GLM-5 from their Hugging Face format against transformers 5.17.0 (the
oracle), in fp32 on tiny random checkpoints: the indexer's selections, teacher-forced logits
over prefill and decode, and greedy tokens through the engine in every serving mode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dhisparse.family.hf_config import ConfigError
from services.worker.durable.host_link import HostLink
from services.worker.engine.engine import Engine
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.kv.config import KVCacheConfig, ResidencyConfig
from services.worker.model.mla_decoder import MLADecoder
from services.worker.request.request import SamplingParams
from services.worker.serving.cache import KVCache
from services.worker.speculative.config import SpeculationConfig
from services.worker.weights.checkpoint import Checkpoint, CheckpointError
from services.worker.weights.fp8_writer import write_fp8_checkpoint
from services.worker.weights.model_io import load_model
from tests import hf_tiny
from tests.worker.helpers import run_chunks
from tests.worker.model import serving

FAMILIES = {"deepseek_v32": hf_tiny.v32_config, "glm_moe_dsa": hf_tiny.glm_config}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """(the transformers reference, its checkpoint saved hub-style); GLM sharded."""
    name = request.param
    ref = hf_tiny.build(FAMILIES[name](), seed=3)
    path = tmp_path_factory.mktemp(name)
    shard = "40KB" if name == "glm_moe_dsa" else None
    hf_tiny.save_hub_style(ref, path, max_shard_size=shard)
    return ref, path


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, hf_tiny.VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _ours(path: Path) -> MLADecoder:
    model = load_model(path)
    assert isinstance(model, MLADecoder)
    return model


def test_the_checkpoint_is_read_as_the_hub_ships_it(family) -> None:
    ref, path = family
    model = _ours(path)
    if model.family.family == "glm_moe_dsa":
        assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
        assert model.family.indexer_types == tuple(ref.config.indexer_types)
        assert [s.index for s in model.cfg.layers].count("follower") == 2
    else:
        assert model.family.rope.kind == "yarn"
        assert model.layers[0].attn.scale == pytest.approx(ref.model.layers[0].self_attn.scaling)


@pytest.mark.parametrize("length", [64, 10, 90])
def test_selections_equal_transformers_over_visible_positions(family, length: int) -> None:
    """Per producer layer and position, our ordered top-k as a set over visible positions is
    transformers' (its full uncached forward, torch.topk patched to our order); prompts of
    4x index_topk and longer are truly sparse, the short one dense-causal."""
    ref, path = family
    ids = _ids(length, length)
    want = hf_tiny.reference_selections(ref, ids)
    model = _ours(path)
    kv = KVCache(model.cfg, KVCacheConfig(max_slots=1, max_model_len=256))
    trace = []
    run_chunks(model, kv, ids, [length], trace=trace)
    got = {t.layer: t.selection for t in trace if t.layer in want}
    assert sorted(got) == sorted(want)
    for layer, sel in got.items():
        for t in range(length):
            ours = {int(p) for p in sel[t] if p >= 0}
            theirs = {int(p) for p in want[layer][t] if p <= t}
            assert ours == theirs, f"layer {layer} position {t}"
    kv.close()


def test_teacher_forced_logits_match_over_prefill_chunks_and_decode(family) -> None:
    ref, path = family
    ids = _ids(96, 5)
    want = hf_tiny.reference_logits(ref, ids)
    model = _ours(path)
    kv = KVCache(model.cfg, KVCacheConfig(max_slots=1, max_model_len=256))
    chunks = [37, 20, *([1] * 9), 30]
    got = model.logits(run_chunks(model, kv, ids, chunks))
    err = (got - want).abs().max() / want.abs().max()
    assert err <= 1e-4, err
    kv.close()


LENGTHS = (200, 90, 260, 60, 180, 230)
NEW_TOKENS = 34


@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_engine_greedy_equals_transformers(family, mode: str) -> None:
    """34 greedy tokens for each of six requests, three arriving while the first three decode,
    prompts prefilled in chunks of at most 64 tokens interleaved with the others' decode steps,
    equal transformers' greedy continuations: resident; hisparse with a hot cache of two pages
    per request and source (most selected rows come from host); adaptive with a pool tight
    enough that admissions reclaim optional history."""
    ref, path = family
    kw = (
        {"kv_pool_mib": serving.tight_pool_mib(path)} if mode == "adaptive" else {"kv_pool_mib": 48}
    )
    if mode == "adaptive":
        kw["residency"] = ResidencyConfig(populate_pages=4)
    eng = serving.engine(path, mode, **kw)
    chunks: list[list[int]] = []  # the prefill passes' chunks
    run_pass = eng.run_pass

    def recorded(reqs: list, lens: list[int] | None = None) -> list:
        if lens is not None:
            chunks.append(lens)
        return run_pass(reqs, lens)

    eng.run_pass = recorded
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = []
    for i, n in enumerate(LENGTHS):
        if i == 3:
            for _ in range(12):
                eng.step()
        reqs.append(eng.add_request(f"r{i}", _ids(n, 100 + n).tolist(), params))
    while eng.has_work():
        eng.step()
    assert max(map(sum, chunks)) <= 64 and sum(map(sum, chunks)) == sum(LENGTHS), chunks
    for r in reqs:
        assert len(r.output_ids) == NEW_TOKENS
        assert r.output_ids == hf_tiny.greedy_under_reference(ref, r.prompt_ids, r.output_ids)
    if mode == "hisparse":
        census = eng.kv.payload.census
        assert census.host > census.hot, census
    if mode == "adaptive":
        st = eng.kv.payload.residency.stats
        assert st.reclaim_events > 0 and st.reclaim_pages > 0, st
    eng.close()


@pytest.mark.parametrize(("scale_dtype", "block"), [("F32", 32), ("F8_E8M0", 32), ("F8_E8M0", 128)])
def test_fp8_checkpoint_against_transformers_on_its_dequantized_weights(
    family, tmp_path: Path, scale_dtype: str, block: int
) -> None:
    """An FP8 e4m3 checkpoint, sharded, against transformers on the same dequantized weights;
    logits agree as for bf16/fp32 checkpoints. With 32x32 block scales (kv_a_proj_with_mqa's 48
    rows: one full and one ragged block) our load dequantizes it; with the released 128x128
    blocks the projections and experts stay FP8 (FP8Linear, FP8Experts: on the CPU their
    reference, dequantize and one fp32 matmul)."""
    ref, path = family
    fp8 = tmp_path / "fp8"
    write_fp8_checkpoint(
        path, fp8, block=(block, block), scale_dtype=scale_dtype, max_shard_bytes=60_000
    )
    raw = json.loads((fp8 / "config.json").read_text())
    ckpt = Checkpoint(fp8, raw["quantization_config"])
    assert ckpt.is_fp8("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    save_file(
        {n: ckpt.get(n, torch.float32) for n in ckpt.names()}, dequantized / "model.safetensors"
    )
    ckpt.close()
    raw.pop("quantization_config")
    (dequantized / "config.json").write_text(json.dumps(raw))
    cls = type(ref)
    theirs = cls.from_pretrained(dequantized, attn_implementation="eager", dtype=torch.float32)
    ids = _ids(80, 9)
    want = hf_tiny.reference_logits(theirs.eval(), ids)
    assert (want - hf_tiny.reference_logits(ref, ids)).abs().max() > 0  # the weights moved
    model = _ours(fp8)
    assert model.weight_format.fp8 == (block == 128)
    kv = KVCache(model.cfg, KVCacheConfig(max_slots=1, max_model_len=256))
    got = model.logits(run_chunks(model, kv, ids, [50, 1, 1, 28]))
    assert (got - want).abs().max() / want.abs().max() <= 1e-4
    kv.close()


def test_bad_model_directories_give_clear_errors(family, tmp_path: Path) -> None:
    _, path = family
    raw = json.loads((path / "config.json").read_text())

    def variant(name: str, config: dict, drop: str | None = None) -> Path:
        d = tmp_path / name
        shutil.copytree(path, d)
        (d / "config.json").write_text(json.dumps(config))
        if drop:
            (d / drop).unlink()
        return d

    with pytest.raises(ConfigError, match=r"unsupported field.*'sliding_window'"):
        load_model(variant("field", raw | {"sliding_window": 4096}))
    with pytest.raises(ConfigError, match="model_type 'llama' is not supported"):
        load_model(variant("type", raw | {"model_type": "llama"}))
    with pytest.raises(ConfigError, match="hidden_act"):
        load_model(variant("act", raw | {"hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match="rope_type 'longrope'"):
        bad_rope = raw | {
            "rope_scaling": {"type": "longrope", "factor": 2},
            "rope_parameters": None,
        }
        load_model(variant("rope", bad_rope))
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    if shards:
        with pytest.raises(CheckpointError, match=shards[0].name):
            load_model(variant("shard", raw, drop=shards[0].name))
    d = variant("dtype", raw)
    weights = next(
        w for w in sorted(d.glob("*.safetensors"))
        if any(n.endswith("kv_a_proj_with_mqa.weight") for n in load_file(w))
    )  # fmt: skip
    state = load_file(weights)
    name = next(n for n in state if n.endswith("kv_a_proj_with_mqa.weight"))
    state[name] = state[name].to(torch.int64)
    save_file(state, weights)
    with pytest.raises(CheckpointError, match=name):
        load_model(d)
    d = variant("missing", raw)
    state = load_file(weights := sorted(d.glob("*.safetensors"))[-1])
    gone = sorted(state)[0]
    save_file({k: v for k, v in state.items() if k != gone}, weights)
    with pytest.raises(CheckpointError):
        load_model(d)


@pytest.mark.parametrize(
    "family,drafter",
    [("deepseek_v32", "dflash"), ("glm_moe_dsa", "dspark"), ("glm_moe_dsa", "dflash2")],
    indirect=["family"],
)
def test_speculative_greedy_equals_transformers_greedy(family, drafter: str) -> None:
    """Each drafter (seeded, untrained) over the hierarchy: verified greedy output is
    transformers' greedy continuation."""
    ref, path = family
    spec = SpeculationConfig(drafter, 4, "fixed")
    eng = serving.engine(path, "hisparse", kv_pool_mib=48, speculation=spec)
    prompts = [_ids(n, 200 + n).tolist() for n in (120, 45, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt, r in zip(prompts, eng.generate(prompts, params), strict=True):
        assert r.output_ids == hf_tiny.greedy_under_reference(ref, prompt, r.output_ids)
    assert eng.speculator.counters.drafts > 0
    eng.close()


@pytest.mark.parametrize(
    "family,mode", [("glm_moe_dsa", "hisparse"), ("deepseek_v32", "adaptive")], indirect=["family"]
)
def test_durable_sessions_resume_token_for_token(family, mode: str) -> None:
    """An engine dropped mid-generation is succeeded by one that adopts its sessions from the
    host store and continues them, index keys included, without recomputing a prompt."""
    _, path = family
    store = LocalHostStore(64 << 20)
    prompts = [_ids(n, 300 + n).tolist() for n in (100, 40)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_p=0.95, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True
        ),
    ]

    def make(owner: str) -> Engine:
        engine = serving.engine(
            path, mode, kv_pool_mib=48, owner=owner, host=(store, store.mapping)
        )
        HostLink(store, owner, 30.0, engine.kv.host_backups).register()
        return engine

    _, second = serving.resumed_after_death(make, store, prompts, params, steps=12)
    second.close()
    store.close()
