"""DeepSeek-V4 from its Hugging Face format against transformers 5.17.0 (the oracle), in fp32
on a tiny random checkpoint with every branch active (sliding window, CSA with its indexer, HCA,
mHC, hash and learned routing): the indexer's selections, teacher-forced logits over one
prefill and over prefill + decode + chunked prefill, and greedy tokens; the checkpoint read in
the hub's names, save_pretrained's and transformers' module names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from dhisparse.family.quantization_config import CheckpointError
from services.worker.model.v4_decoder import V4Decoder
from services.worker.model.v4_indexer import Indexer
from services.worker.ops.fp4_e2m1 import dequantize_fp4
from services.worker.weights.v4_names import load_v4_model
from tests import hf_tiny, hf_tiny_v4

RTOL = 1e-4
SAVERS = {
    "hub": hf_tiny_v4.save_hub_style,
    "save_pretrained": lambda model, path: model.save_pretrained(path),
    "module_names": hf_tiny_v4.save_module_names,
}


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    return hf_tiny_v4.build(hf_tiny_v4.v4_config(), seed=3)


@pytest.fixture(scope="module")
def saved(ref, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, save in SAVERS.items():
        out[name] = tmp_path_factory.mktemp(name)
        save(ref, out[name])
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    hf_tiny_v4.assert_close(got, want, RTOL)


def test_no_tensor_of_the_reference_is_left_at_its_zero_or_one_init(ref) -> None:
    for name, t in ref.state_dict().items():
        if "inv_freq" not in name:
            assert not (t == 0).all() and not (t == 1).all(), name
    for layer in ref.model.layers[:2]:
        picks = layer.mlp.gate.tid2eid  # hash layers: distinct experts per token
        assert (picks[:, 0] != picks[:, 1]).all()
        assert len(picks.unique()) == ref.config.n_routed_experts


def test_every_naming_loads_the_model_transformers_built(ref, saved) -> None:
    hub = load_v4_model(saved["hub"])
    assert hub.cfg.attention == ("sliding", "csa", "hca", "csa")
    assert hub.cfg.compress == (0, 4, 8, 4) and hub.cfg.mlp == ("hash", "hash", "moe", "moe")
    want = hub.state_dict()
    for name in ("save_pretrained", "module_names"):
        model = load_v4_model(saved[name])
        assert model.cfg == hub.cfg, name
        got = model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), name
    experts = ref.model.layers[2].mlp.experts
    inter = ref.config.moe_intermediate_size
    assert torch.equal(want["layers.2.ffn.experts.5.w3.weight"], experts.gate_up_proj[5, inter:])
    assert torch.equal(want["layers.2.ffn.experts.5.w2.weight"], experts.down_proj[5])


@pytest.mark.parametrize(("name", "length"), [("hub", 45), ("save_pretrained", 11)])
def test_prefill_logits_equal_transformers(ref, saved, name: str, length: int) -> None:
    """One forward over a fresh random prompt: 45 tokens is past the window, has 11 CSA rows
    of which the indexer keeps 4, and 5 HCA rows; 11 tokens is short of the HCA rate."""
    ids = hf_tiny_v4.token_ids(length, length)
    model = load_v4_model(saved[name])
    _close(model(ids, model.new_state()), hf_tiny.reference_logits(ref, ids))


def test_the_released_rates_csa_4_and_hca_128_equal_transformers(tmp_path) -> None:
    """Two layers at the releases' rates, read from the hub's ``compress_ratios`` alone: 150
    tokens fill one HCA row and 37 CSA rows (the indexer keeps 4)."""
    config = hf_tiny_v4.v4_config(
        num_hidden_layers=2,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates=None, mlp_layer_types=["hash_moe", "moe"], sliding_window=16,
    )  # fmt: skip
    ref = hf_tiny_v4.build(config, seed=8)
    path = hf_tiny_v4.save_hub_style(ref, tmp_path / "released_rates")
    assert "compress_rate_hca" not in json.loads((path / "config.json").read_text())
    model = load_v4_model(path)
    assert model.cfg.compress == (4, 128)
    ids = hf_tiny_v4.token_ids(150, 17)
    state = model.new_state()
    got = torch.cat([model(ids[:130], state), model(ids[130:], state)])
    _close(got, hf_tiny.reference_logits(ref, ids))


def test_prefill_decode_and_chunks_equal_one_transformers_forward(ref, saved) -> None:
    """Teacher-forced over a prefill of 13, seven one-token decode steps (across CSA and HCA
    window boundaries) and a chunk of 17: each step's logits as transformers' one uncached
    forward over the whole sequence gives them, and as its cached decode gives them."""
    ids = hf_tiny_v4.token_ids(37, 7)
    model = load_v4_model(saved["hub"])
    state = model.new_state()
    steps = [(0, 13), *((i, i + 1) for i in range(13, 20)), (20, 37)]
    got = torch.cat([model(ids[a:b], state) for a, b in steps])
    _close(got, hf_tiny.reference_logits(ref, ids))
    with torch.no_grad(), hf_tiny.our_topk_order():
        out = ref(ids[None, :13], use_cache=True)
        cached = [out.logits[0]]
        for i in range(13, 20):
            out = ref(ids[None, i : i + 1], past_key_values=out.past_key_values, use_cache=True)
            cached.append(out.logits[0])
    _close(got[:20], torch.cat(cached).float())


def test_the_indexer_keeps_the_rows_transformers_keeps(ref, saved, monkeypatch) -> None:
    """Per CSA layer and query, the set of compressed rows attended: ours against
    transformers' top-k (its -1 picks dropped), over a prompt with 4 times index_topk rows."""
    ids = hf_tiny_v4.token_ids(64, 11)
    want: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.compressor.indexer.register_forward_hook(
            lambda _m, _a, res, i=i: want.__setitem__(i, res[0])
        )
        for i, layer in enumerate(ref.model.layers)
        if layer.self_attn.compressor is not None and hasattr(layer.self_attn.compressor, "indexer")
    ]
    try:
        hf_tiny.reference_logits(ref, ids)
    finally:
        for h in hooks:
            h.remove()
    got: list[torch.Tensor] = []
    select = Indexer.select
    monkeypatch.setattr(Indexer, "select", lambda self, *a: got.append(select(self, *a)) or got[-1])
    model = load_v4_model(saved["hub"])
    model(ids, model.new_state())
    assert sorted(want) == [1, 3] and len(got) == 2
    for layer, chosen in zip(sorted(want), got, strict=True):
        picks = want[layer]  # [T, k], -1 where nothing visible is left
        ref_sets = [set(row[row >= 0].tolist()) for row in picks]
        our_sets = [set(torch.nonzero(row).flatten().tolist()) for row in chosen]
        assert our_sets == ref_sets, layer
        assert max(len(s) for s in our_sets) == hf_tiny_v4.v4_config().index_topk
        assert chosen.shape[1] == 16  # rows: the selection is sparse


def _greedy(model: V4Decoder, prompt: torch.Tensor, n: int) -> list[int]:
    state = model.new_state()
    logits = model(prompt, state)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model(torch.tensor(out[-1:]), state)
    return out


def test_greedy_tokens_equal_transformers(ref, saved) -> None:
    prompt = hf_tiny_v4.token_ids(21, 5)
    model = load_v4_model(saved["module_names"])
    ours = _greedy(model, prompt, 16)
    assert hf_tiny.greedy_under_reference(ref, prompt.tolist(), ours) == ours
    with torch.no_grad(), hf_tiny.our_topk_order():
        gen = ref.generate(
            prompt[None], attention_mask=torch.ones(1, 21, dtype=torch.long), max_new_tokens=16,
            do_sample=False, pad_token_id=hf_tiny_v4.VOCAB - 1, eos_token_id=None,
        )  # fmt: skip
    assert gen[0, 21:].tolist() == ours


def test_the_released_fp8_fp4_form_equals_transformers_dequantizing_it(ref, tmp_path) -> None:
    """Dense projections FP8 e4m3 in 16x16 blocks, routed experts FP4 e2m1 with per-32 UE8M0
    scales: dequantised on load, the logits are those of transformers loading the same files
    with ``FineGrainedFP8Config(dequantize=True)``, and not those of the unquantised model."""
    path = hf_tiny_v4.save_released_form(ref, tmp_path / "released")
    stored = load_file(str(path / "model.safetensors"))
    assert stored["layers.2.ffn.experts.3.w1.weight"].dtype == torch.int8
    assert stored["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.0.attn.wq_a.scale"].shape == (2, 4)
    ids = hf_tiny_v4.token_ids(40, 13)
    model = load_v4_model(path)
    got = model(ids, model.new_state())
    oracle = DeepseekV4ForCausalLM.from_pretrained(
        path, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).eval()
    _close(got, hf_tiny.reference_logits(oracle, ids))
    unquantised = hf_tiny.reference_logits(ref, ids)
    assert (got - unquantised).abs().max() > 1e-2 * unquantised.abs().max()


def test_fp4_dequantisation_equals_transformers() -> None:
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(-128, 128, (6, 32), generator=g, dtype=torch.int8)
    exponents = torch.randint(120, 134, (6, 2), generator=g, dtype=torch.uint8)
    scale = exponents.view(torch.float8_e8m0fnu)
    want = Fp8Dequantize(None)._dequantize_one(packed, scale, torch.float32)
    assert torch.equal(dequantize_fp4(packed, scale), want)
    w = torch.randn(4, 64, generator=g)
    back = dequantize_fp4(*hf_tiny_v4.quantize_fp4(w))
    assert (back - w).abs().max() <= 0.25 * w.abs().max()


def test_missing_tensors_and_undeclared_formats_are_refused(ref, saved, tmp_path) -> None:
    path = tmp_path / "broken"
    path.mkdir()
    (path / "config.json").write_text((saved["hub"] / "config.json").read_text())
    weights = load_file(str(saved["hub"] / "model.safetensors"))
    weights.pop("layers.1.attn.indexer.compressor.ape")
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing \['layers.1.attn.indexer.compressor.ape'"):
        load_v4_model(path)
    released = hf_tiny_v4.save_released_form(ref, tmp_path / "released")
    raw = json.loads((released / "config.json").read_text())
    for key, match in (("quantization_config", "FP8 but"), ("expert_dtype", "packed FP4 but")):
        (released / "config.json").write_text(
            json.dumps({k: v for k, v in raw.items() if k != key})
        )
        with pytest.raises(CheckpointError, match=match):
            load_v4_model(released)
    (released / "config.json").write_text(json.dumps(raw))
    weights = load_file(str(released / "model.safetensors"))
    weights.pop("layers.2.ffn.experts.0.w2.scale")
    save_file(weights, str(released / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"experts\.0\.w2\.weight is stored as torch\.int8 without"
    ):
        load_v4_model(released)
