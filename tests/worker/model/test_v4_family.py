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

from dhisparse.family.quantization_config import CheckpointError
from services.worker.model.v4_decoder import V4Decoder
from services.worker.model.v4_indexer import Indexer
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


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, hf_tiny_v4.VOCAB, (n,), generator=g)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    err = (got - want).abs().max() / want.abs().max()
    assert err <= RTOL, f"relative max error {err:.3g}"


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
    ids = _ids(length, length)
    model = load_v4_model(saved[name])
    _close(model(ids, model.new_state()), hf_tiny.reference_logits(ref, ids))


def test_prefill_decode_and_chunks_equal_one_transformers_forward(ref, saved) -> None:
    """Teacher-forced over a prefill of 13, seven one-token decode steps (across CSA and HCA
    window boundaries) and a chunk of 17: each step's logits as transformers' one uncached
    forward over the whole sequence gives them, and as its cached decode gives them."""
    ids = _ids(37, 7)
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
    ids = _ids(64, 11)
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
    prompt = _ids(21, 5)
    model = load_v4_model(saved["module_names"])
    ours = _greedy(model, prompt, 16)
    assert hf_tiny.greedy_under_reference(ref, prompt.tolist(), ours) == ours
    with torch.no_grad(), hf_tiny.our_topk_order():
        gen = ref.generate(
            prompt[None], attention_mask=torch.ones(1, 21, dtype=torch.long), max_new_tokens=16,
            do_sample=False, pad_token_id=hf_tiny_v4.VOCAB - 1, eos_token_id=None,
        )  # fmt: skip
    assert gen[0, 21:].tolist() == ours


def test_missing_tensors_and_the_quantized_form_are_refused(saved, tmp_path) -> None:
    path = tmp_path / "broken"
    path.mkdir()
    (path / "config.json").write_text((saved["hub"] / "config.json").read_text())
    weights = load_file(str(saved["hub"] / "model.safetensors"))
    weights.pop("layers.1.attn.indexer.compressor.ape")
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing \['layers.1.attn.indexer.compressor.ape'"):
        load_v4_model(path)
    weights["layers.1.attn.indexer.compressor.ape"] = torch.zeros(4, 32)
    weights["layers.0.attn.wq_a.weight"] = weights["layers.0.attn.wq_a.weight"].to(
        torch.float8_e4m3fn
    )
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="F8_E4M3"):
        load_v4_model(path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="FP8 / FP4"):
        load_v4_model(path)
