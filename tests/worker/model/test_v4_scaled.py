"""``v4flash-scaled`` (``dhisparse/family/scaled.py``): the released DeepSeek-V4-Flash config
with 32 routed experts, its figures counted from a ``meta`` build (parameters, bf16 bytes, KV
bytes per token); built with random weights (in place, with its MTP layer) and, shrunk to CPU
size with its topology kept (sliding-window, CSA and HCA layers, hash routing, the MTP layer),
served by the engine: greedy tokens with chunked prefill equal in resident, hisparse and
adaptive mode, equal to the model run alone over each whole sequence, and to MTP
speculation's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dhisparse.family.scaled import V4_SCALED
from dhisparse.family.v4_config import parse_v4_config
from services.worker.kv.config import bytes_per_token
from services.worker.model.v4_decoder import V4Decoder
from services.worker.model.v4_mtp import MTPBlock
from services.worker.model.v4_precision import held_in_fp32, to_serving_dtype
from services.worker.model.v4_serving import V4Model
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from services.worker.weights.model_io import build_model
from tests.worker.scaled_shrunk import VOCAB, engine, shrunk_v4

FLASH = Path(__file__).parents[2] / "fixtures" / "configs" / "deepseek-v4-flash" / "config.json"
PRESET = V4_SCALED["v4flash-scaled"]
# notes/real-models.md: transformers' parameter counts (no MTP layer), whose gates' correction
# biases are buffers; here they are parameters, one per routed expert on each of the 40
# learned-routing layers
NOTES_FLASH, NOTES_SCALED, LEARNED_LAYERS = 284_332_230_231, 41_895_560_791, 40


def _meta(raw: dict, mtp: bool) -> V4Decoder:
    cfg = parse_v4_config(raw)
    with torch.device("meta"):
        return V4Decoder(cfg, MTPBlock(cfg) if mtp else None)


def _params(net: torch.nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def test_the_preset_is_the_released_flash_config_with_32_experts() -> None:
    released = parse_v4_config(json.loads(FLASH.read_text()))
    cfg, topo = PRESET.parse(mtp=True)
    assert cfg == dataclasses.replace(released, n_routed=32)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (43, 4096, 64, 512)
    assert [cfg.attention.count(k) for k in ("sliding", "csa", "hca")] == [2, 21, 20]
    assert cfg.mlp[:4] == ("hash", "hash", "hash", "moe") and cfg.mlp.count("hash") == 3
    assert (cfg.n_routed, cfg.top_k, cfg.mtp_layers, cfg.expert_dtype) == (32, 6, 1, "fp4")
    assert topo.draft_layers == (43,)


def test_the_docstrings_figures_are_a_meta_builds() -> None:
    """Parameters with and without the MTP layer, transformers' counts (notes §3.5, §3.7)
    plus the correction biases, the bf16 bytes and the KV bytes per token the module
    docstring states."""
    full = _meta(PRESET.config, mtp=True)
    assert full.mtp is not None
    target = _params(full) - _params(full.mtp)
    assert _params(full) == pytest.approx(42.87e9, rel=0.01)
    assert _params(full) == 42_867_548_658 and target == 41_895_562_071
    assert target == NOTES_SCALED + LEARNED_LAYERS * 32
    flash = _meta(json.loads(FLASH.read_text()), mtp=False)
    assert _params(flash) == NOTES_FLASH + LEARNED_LAYERS * 256
    full.mtp = None
    stored = [*to_serving_dtype(full, torch.bfloat16).parameters(), *full.buffers()]
    assert sum(t.numel() * t.element_size() for t in stored) == 83_881_246_044
    cfg, topo = PRESET.parse()
    # the model's own: CSA rows and index keys, HCA rows (notes §3.1: 6,880 B); the sliding
    # layers' windows are rings of their own, no stored row, and no layer but CSA holds keys
    own = sum(
        (topo.d_kv + (kind == "csa") * topo.d_index) * 2 / rate
        for kind, rate in zip(cfg.attention, cfg.compress, strict=True)
        if kind != "sliding"
    )
    assert bytes_per_token(topo, 2, True) == own == 6880
    # the MTP layer keeps only its window: no byte per token more
    assert bytes_per_token(PRESET.parse(mtp=True)[1], 2, True) == 6880


def test_built_in_place_as_on_the_host_with_tid2eid_into_its_experts() -> None:
    """In place (allocated on ``meta``, drawn where it lives) gives the host build's weights,
    in the dtype asked; the MTP layer is drawn after the target, which it leaves unchanged;
    each token's hash experts are distinct experts of the preset's."""
    d = shrunk_v4("v4flash-scaled")
    host = build_model(d, seed=4)
    assert isinstance(host, V4Model)
    placed = build_model(d, seed=4, in_place=True, mtp=True)
    theirs = placed.state_dict()
    assert all(torch.equal(t, theirs[n]) for n, t in host.state_dict().items())
    half = build_model(d, seed=4, dtype=torch.bfloat16, in_place=True)
    held = {n: p.dtype for n, p in half.named_parameters()}
    assert {n for n, t in held.items() if t == torch.float32} == set(filter(held_in_fp32, held))
    assert {t for n, t in held.items() if not held_in_fp32(n)} == {torch.bfloat16}
    assert any(n.endswith("attn_sink") for n in filter(held_in_fp32, held))
    hashed = [b for n, b in host.named_buffers() if n.endswith("tid2eid")]
    assert len(hashed) == 3
    for table in hashed:
        assert table.shape == (VOCAB, 2) and table.dtype == torch.int64
        assert table.unique().tolist() == list(range(8))  # every expert, none past them
        assert bool((table[:, 0] != table[:, 1]).all())


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (70, 33, 101)]


def test_every_mode_serves_the_models_greedy_tokens_with_chunked_prefill() -> None:
    """Three requests, prefill chunks of at most 32 tokens, a hot cache of 8 rows: 16 greedy
    tokens each, the same in resident, hisparse and adaptive mode (hisparse reads rows from
    the host; adaptive keeps them on the device, which holds them all here), and those of the
    model run alone over each whole sequence."""
    d = shrunk_v4("v4flash-scaled")
    model = build_model(d, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = _prompts()
    outs = {}
    for mode in ("resident", "hisparse", "adaptive"):
        eng = engine(d.name, model, mode, None, max_prefill_tokens=32, page_size=4,
                     hot_cache_rows=8)  # fmt: skip
        outs[mode] = [r.output_ids for r in eng.generate(prompts, params)]
        if mode == "hisparse":
            assert eng.kv.payload.census.host > 0, eng.kv.payload.census
        eng.close()
    assert outs["resident"] == outs["hisparse"] == outs["adaptive"]
    assert len({t for out in outs["resident"] for t in out}) > 16  # not a fixed point
    for prompt, out in zip(prompts, outs["resident"], strict=True):
        logits = model.net(torch.tensor(prompt + out[:-1]), model.net.new_state())
        assert logits[len(prompt) - 1 :].argmax(-1).tolist() == out


def test_built_with_its_mtp_layer_it_speculates_as_plain_greedy() -> None:
    d = shrunk_v4("v4flash-scaled")
    plain_model, model = build_model(d, seed=3), build_model(d, seed=3, mtp=True)
    assert model.mtp is not None and plain_model.mtp is None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = _prompts()
    plain = engine(d.name, plain_model, "resident", None)
    want = [r.output_ids for r in plain.generate(prompts, params)]
    plain.close()
    for mode in ("resident", "hisparse"):
        eng = engine(d.name, model, mode, SpeculationConfig("mtp", 4, "fixed"))
        assert [r.output_ids for r in eng.generate(prompts, params)] == want, mode
        assert eng.speculator.counters.drafts > 0
        eng.close()
