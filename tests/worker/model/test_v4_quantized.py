"""DeepSeek-V4 with its projections and experts held quantized (``WeightFormat.fp8``, FP4 routed
experts with ``fp4_experts``), on the CPU (the kernels' torch references): the released form's
bytes held as stored, FP4 experts upcast to FP8 exactly, dense checkpoints and random presets
quantized at load, the logits those of the dense model the quantized weights stand for, and
the settings that cannot be served refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dhisparse.family.quantization_config import CheckpointError
from services.worker.model.fp4_experts import FP4Experts
from services.worker.model.fp8_experts import FP8Experts
from services.worker.model.fp8_linear_layer import FP8Linear
from services.worker.model.grouped_linear import GroupedLinear
from services.worker.model.weight_format import BF16, WeightFormat
from services.worker.ops.fp4_e2m1 import E2M1_VALUES, dequantize_fp4
from services.worker.ops.fp4_quantize import quantize_fp4
from services.worker.ops.fp8_blockwise import dequantize_blockwise, quantize_blockwise
from services.worker.request.request import SamplingParams
from services.worker.weights.model_io import build_model
from services.worker.weights.v4_names import load_v4_model, load_v4_served
from services.worker.weights.v4_quantized import Stored, dense, slots
from tests import hf_tiny_v4
from tests.worker.scaled_shrunk import VOCAB, engine, shrunk, shrunk_v4

FP8 = WeightFormat(fp8=True)
FP4 = WeightFormat(fp8=True, fp4_experts=True)


@pytest.fixture(scope="module")
def ref() -> torch.nn.Module:
    return hf_tiny_v4.build(hf_tiny_v4.v4_config(), seed=5)


@pytest.fixture(scope="module")
def released(ref, tmp_path_factory):
    """The released form with DeepSeek's 128x128 blocks (one ragged block per tiny matrix)."""
    return hf_tiny_v4.save_released_form(ref, tmp_path_factory.mktemp("released"), block=128)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, model.new_state())


def test_the_released_form_is_held_as_stored_and_computes_the_dequantized_model(
    released,
) -> None:
    stored = load_file(str(released / "model.safetensors"))
    dense_model = load_v4_model(released)
    held = load_v4_model(released, fmt=FP4)
    wq_a = held.layers[0].attn.wq_a
    assert isinstance(wq_a, FP8Linear)
    assert torch.equal(wq_a.weight.view(torch.uint8),
                       stored["layers.0.attn.wq_a.weight"].view(torch.uint8))  # fmt: skip
    experts = held.layers[2].ffn.experts
    assert isinstance(experts, FP4Experts)
    i = experts.intermediate
    assert torch.equal(experts.gate_up_proj[3, :i],
                       stored["layers.2.ffn.experts.3.w1.weight"].view(torch.uint8))  # fmt: skip
    assert torch.equal(experts.down_proj[5],
                       stored["layers.2.ffn.experts.5.w2.weight"].view(torch.uint8))  # fmt: skip
    assert isinstance(held.layers[1].attn.wo_a, GroupedLinear) and held.layers[1].attn.wo_a.fp8
    ids = hf_tiny_v4.token_ids(40, 3)
    hf_tiny_v4.assert_close(_logits(held, ids), _logits(dense_model, ids), 1e-4)


def test_fp4_experts_held_in_fp8_are_upcast_exactly(released) -> None:
    held = load_v4_model(released, fmt=FP8)
    fp4 = load_v4_model(released, fmt=FP4)
    for layer in (0, 3):
        e8, e4 = held.layers[layer].ffn.experts, fp4.layers[layer].ffn.experts
        assert isinstance(e8, FP8Experts) and isinstance(e4, FP4Experts)
        got_gate_up, got_down = e8.dequantized()
        s8, _ = slots(held)
        s4, _ = slots(fp4)
        for e in range(e8.n):
            for w in ("w1", "w2", "w3"):
                name = f"layers.{layer}.ffn.experts.{e}.{w}.weight"
                four = s4[name]
                want = dequantize_fp4(four.weight, four.scale.view(torch.float8_e8m0fnu))
                eight = s8[name]
                got = dequantize_blockwise(eight.weight, eight.scale, (128, 128))
                assert torch.equal(got, want), name
        assert got_gate_up.shape[0] == got_down.shape[0] == e8.n
    ids = hf_tiny_v4.token_ids(33, 8)
    hf_tiny_v4.assert_close(_logits(held, ids), _logits(fp4, ids), 1e-4)


def test_auto_serves_an_fp8_checkpoint_in_fp8_and_bf16_dequantizes(released) -> None:
    auto = load_v4_served(released, "cpu", None, False, "auto", 1)
    assert isinstance(auto.net.layers[0].attn.wkv, FP8Linear)
    assert isinstance(auto.net.layers[0].ffn.experts, FP8Experts)  # FP4 re-held: faster
    as_fp4 = load_v4_served(released, "cpu", None, False, "fp4", 1)
    assert isinstance(as_fp4.net.layers[0].ffn.experts, FP4Experts)
    dense_model = load_v4_served(released, "cpu", None, False, "bf16", 1)
    assert isinstance(dense_model.net.layers[0].attn.wq_a, torch.nn.Linear)
    assert not dense_model.net.layers[0].ffn.quantized


def test_a_dense_checkpoint_is_quantized_at_load(ref, tmp_path) -> None:
    """Every matrix the release quantizes is held in FP8 blocks of the dense weight; the logits
    are those of the dense model over the dequantized blocks, and not the unquantized ones."""
    path = hf_tiny_v4.save_hub_style(ref, tmp_path / "dense")
    dense_model = load_v4_model(path)
    held = load_v4_model(path, fmt=FP8)
    ids = hf_tiny_v4.token_ids(30, 4)
    exact = _logits(dense_model, ids)
    quantized, _ = slots(held)
    params = dict(dense_model.named_parameters())
    with torch.no_grad():
        for name, slot in quantized.items():
            want = dequantize_blockwise(*quantize_blockwise(params[name].detach()), (128, 128))
            got = dequantize_blockwise(slot.weight, slot.scale, (128, 128))
            assert torch.equal(got, want), name
            params[name].copy_(got)
    hf_tiny_v4.assert_close(_logits(held, ids), _logits(dense_model, ids), 1e-4)
    assert not torch.allclose(_logits(held, ids), exact)


def test_fp4_experts_are_refused_for_the_families_without_them() -> None:
    with pytest.raises(ValueError, match="FP4 routed experts"):
        build_model(shrunk("v32-scaled"), weights=FP4)


def test_a_checkpoint_whose_fp4_scales_do_not_fit_is_refused_by_name(released, tmp_path) -> None:
    weights = load_file(str(released / "model.safetensors"))
    name = "layers.3.ffn.experts.1.w1.scale"
    weights[name] = weights[name][:, :1].contiguous()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((released / "config.json").read_text())
    save_file(weights, str(broken / "model.safetensors"))
    for fmt in (FP4, FP8, BF16):
        with pytest.raises(CheckpointError, match=r"layers\.3\.ffn\.experts\.1\.w1\.weight"):
            load_v4_model(broken, fmt=fmt)


def test_a_quantized_preset_holds_its_dense_twin_quantized() -> None:
    d = shrunk_v4("v4flash-scaled")
    dense_model = build_model(d, seed=7, dtype=torch.bfloat16, mtp=True)
    held = build_model(d, seed=7, dtype=torch.bfloat16, weights=FP4, in_place=True, mtp=True)
    dense_named = dict(dense_model.net.named_parameters())
    quantized, _ = slots(held.net)
    for name, slot in quantized.items():
        w = dense_named[name].detach()
        want = quantize_fp4(w) if slot.fp4 else quantize_blockwise(w, (128, 128))
        kind = "fp4" if slot.fp4 else "fp8"
        block = None if slot.fp4 else (128, 128)
        scale = slot.scale.view(torch.float8_e8m0fnu) if slot.fp4 else slot.scale
        got = dense(Stored(kind, slot.weight, scale, block))
        assert torch.equal(got, dense(Stored(kind, *want, block))), name
    for name, t in held.net.named_parameters():
        assert torch.equal(t, dense_named[name]), name  # everything else as the twin's
    assert any(s.fp4 for s in quantized.values()) and any(not s.fp4 for s in quantized.values())
    assert any(n.startswith("mtp.0.e_proj") for n in quantized)


def test_every_mode_serves_a_quantized_model_with_its_own_greedy_tokens() -> None:
    d = shrunk_v4("v4flash-scaled")
    model = build_model(d, seed=3, weights=FP4)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (45, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for mode in ("resident", "hisparse"):
        eng = engine(d.name, model, mode, None, max_prefill_tokens=32, page_size=4,
                     hot_cache_rows=8)  # fmt: skip
        outs[mode] = [r.output_ids for r in eng.generate(prompts, params)]
        eng.close()
    assert outs["resident"] == outs["hisparse"]
    for prompt, out in zip(prompts, outs["resident"], strict=True):
        logits = model.net(torch.tensor(prompt + out[:-1]), model.net.new_state())
        assert logits[len(prompt) - 1 :].argmax(-1).tolist() == out


def test_grouped_fp8_projection_per_group_equals_the_dequantized_einsum() -> None:
    g = torch.Generator().manual_seed(2)
    groups, d_in, d_out = 3, 96, 128
    layer = GroupedLinear(groups, d_in, d_out, FP8)
    w = torch.randn(groups * d_out, d_in, generator=g) / d_in**0.5
    w8, s = quantize_blockwise(w)
    layer.weight.copy_(w8)
    layer.weight_scale_inv.copy_(s)
    assert layer.block_aligned
    x = torch.randn(5, groups, d_in, generator=g)
    dq = dequantize_blockwise(w8, s, (128, 128)).view(groups, d_out, d_in)
    want = torch.einsum("ngi,goi->ngo", x, dq).reshape(5, -1)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    plain = GroupedLinear(groups, d_in, d_out, BF16)
    with torch.no_grad():
        plain.weight.copy_(dq.reshape(-1, d_in))
    torch.testing.assert_close(plain(x), want, rtol=1e-5, atol=1e-5)


def test_fp4_quantization_rounds_each_value_to_its_nearest_code() -> None:
    g = torch.Generator().manual_seed(9)
    w = torch.randn(8, 96, generator=g) * torch.logspace(-3, 2, 96)  # groups of many binades
    packed, scale = quantize_fp4(w)
    got = dequantize_fp4(packed, scale)
    per_col = scale.float().repeat_interleave(32, dim=1)
    codes = torch.tensor(E2M1_VALUES[:8])
    magnitudes = (w.abs() / per_col).clamp(max=6.0)
    nearest = codes[(magnitudes.unsqueeze(-1) - codes).abs().argmin(-1)] * per_col
    assert torch.equal(got.abs(), nearest)
    assert torch.equal(got.sign() * (got != 0), w.sign() * (got != 0))
    assert ((w.abs() / per_col).amax(dim=1) <= 6).all()
