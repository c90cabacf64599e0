"""FP8 weights held as FP8 (``weight_format``): which tensors are FP8, that a released-layout
FP8 checkpoint's bytes and scales land unchanged in the model (experts included), that a bf16
checkpoint asked for FP8 is quantized per block at load, that the engine serves an FP8 model with
the tokens of the same weights dequantized, and the errors. On the CPU the FP8 layers run their
torch references (the kernels' own tests are tests/worker/ops/test_fp8_linear.py, test_fp8_moe.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dhisparse.family.presets import preset
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.model.fp8_experts import FP8Experts
from services.worker.model.fp8_linear_layer import FP8Linear
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.weight_format import WeightFormat
from services.worker.ops.fp8_blockwise import FP8_DTYPE, quantize_blockwise, scale_to_float
from services.worker.request.request import SamplingParams
from services.worker.weights.checkpoint import Checkpoint, CheckpointError
from services.worker.weights.fp8_writer import write_fp8_checkpoint
from services.worker.weights.model_io import build_model, load_model
from tests import hf_tiny

FP8 = WeightFormat(fp8=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A tiny DeepSeek-V3.2 checkpoint in fp32 and its FP8 copy with the released 128x128
    blocks and UE8M0 scales."""
    root = tmp_path_factory.mktemp("fp8w")
    ref = hf_tiny.build(hf_tiny.v32_config(), seed=11)
    dense = hf_tiny.save_hub_style(ref, root / "dense")
    fp8 = root / "fp8"
    write_fp8_checkpoint(dense, fp8, block=(128, 128), scale_dtype="F8_E8M0")
    return {"dense": dense, "fp8": fp8}


def test_what_is_held_in_fp8() -> None:
    """The released checkpoints' FP8 projections are FP8 (attention but kv_b, the indexer's
    wq_b and wk, dense and shared MLPs, routed experts); kv_b (absorbed), embeddings, head,
    norms, routers and weights_proj are not; FP8 scales are fp32."""
    model = build_model(preset("tiny-glm"), weights=FP8)
    assert isinstance(model, MLADecoder) and model.weight_format.fp8
    fp8 = {n for n, t in model.named_buffers() if t.dtype == FP8_DTYPE}
    layer = model.layers[3]
    assert isinstance(layer.attn.q_a_proj, FP8Linear) and isinstance(layer.attn.o_proj, FP8Linear)
    assert isinstance(layer.mlp.experts, FP8Experts)
    assert isinstance(layer.mlp.shared_experts.down_proj, FP8Linear)
    assert isinstance(model.layers[0].mlp.gate_proj, FP8Linear)  # the dense layer
    assert isinstance(model.layers[0].indexer.wk, FP8Linear)
    for name in ("kv_b_proj", "embed", "lm_head", "norm", "mlp.gate.", "weights_proj"):
        assert not any(name in n for n in fp8), name
    assert "layers.3.mlp.experts.gate_up_proj" in fp8
    for n, t in model.named_buffers():
        if n.endswith("_scale_inv"):
            assert t.dtype == torch.float32, n
    dense = build_model(preset("tiny-glm"))
    fp8_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    dense_bytes = sum(t.numel() * t.element_size() for t in dense.state_dict().values())
    assert fp8_bytes < 0.6 * dense_bytes  # fp32 preset: FP8 is a quarter where it applies


def test_an_fp8_checkpoint_lands_byte_for_byte(checkpoints) -> None:
    model = load_model(checkpoints["fp8"])
    assert isinstance(model, MLADecoder) and model.weight_format.fp8
    ckpt = Checkpoint(checkpoints["fp8"], {"weight_block_size": [128, 128], "quant_method": "fp8"})
    state = model.state_dict()
    layer = 1  # a MoE layer of the tiny V3.2
    w, s = ckpt.get_fp8(f"model.layers.{layer}.self_attn.q_b_proj.weight")
    assert torch.equal(state[f"layers.{layer}.attn.q_b_proj.weight"].view(torch.uint8),
                       w.view(torch.uint8))  # fmt: skip
    assert torch.equal(state[f"layers.{layer}.attn.q_b_proj.weight_scale_inv"], s)
    gate_up = state[f"layers.{layer}.mlp.experts.gate_up_proj"]
    scales = state[f"layers.{layer}.mlp.experts.gate_up_proj_scale_inv"]
    i, rows = gate_up.shape[1] // 2, scales.shape[1] // 2
    for e in (0, 2):
        wg, sg = ckpt.get_fp8(f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight")
        wu, su = ckpt.get_fp8(f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight")
        wd, sd = ckpt.get_fp8(f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight")
        assert torch.equal(gate_up[e, :i].view(torch.uint8), wg.view(torch.uint8))
        assert torch.equal(gate_up[e, i:].view(torch.uint8), wu.view(torch.uint8))
        assert torch.equal(scales[e, :rows], sg) and torch.equal(scales[e, rows:], su)
        down = state[f"layers.{layer}.mlp.experts.down_proj"]
        assert torch.equal(down[e].view(torch.uint8), wd.view(torch.uint8))
        assert torch.equal(state[f"layers.{layer}.mlp.experts.down_proj_scale_inv"][e], sd)
    ckpt.close()


def test_a_dense_checkpoint_asked_for_fp8_is_quantized_at_load(checkpoints) -> None:
    model = load_model(checkpoints["dense"], weight_dtype="fp8")
    assert model.weight_format.fp8
    assert not load_model(checkpoints["dense"]).weight_format.fp8  # auto: as stored
    dense = load_model(checkpoints["dense"])
    w = dense.get_parameter("layers.0.attn.o_proj.weight")
    want, scale = quantize_blockwise(w.detach(), (128, 128))
    assert torch.equal(model.get_buffer("layers.0.attn.o_proj.weight").view(torch.uint8),
                       want.view(torch.uint8))  # fmt: skip
    assert torch.equal(model.get_buffer("layers.0.attn.o_proj.weight_scale_inv"),
                       scale_to_float(scale))  # fmt: skip


@pytest.mark.parametrize("mode", ["resident", "adaptive"])
def test_the_engine_serves_fp8_weights_with_the_dequantized_tokens(checkpoints, mode) -> None:
    """Greedy tokens of the FP8-held model (``--weight-dtype fp8``) equal those of the same
    checkpoint dequantized at load (``--weight-dtype bf16``; fp32 here): on the CPU both
    compute the same products. "auto" on a CPU is the dequantized one."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, hf_tiny.VOCAB, (n,), generator=g).tolist() for n in (40, 75)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for weight_dtype in ("fp8", "bf16"):
        cfg = EngineConfig(
            model=str(checkpoints["fp8"]), mode=mode, weight_dtype=weight_dtype, dtype="float32",
            max_num_seqs=2, max_model_len=256, page_size=16, hot_cache_rows=32,
            max_prefill_tokens=32, host_arena_mib=16,
        )  # fmt: skip
        engine = Engine(cfg)
        assert engine.model.weight_format.fp8 == (weight_dtype == "fp8")
        outs.append([r.output_ids for r in engine.generate(prompts, params)])
        engine.close()
    assert outs[0] == outs[1]
    assert EngineConfig(weight_dtype="auto", device="cpu").served_weights() == "bf16"
    assert EngineConfig(weight_dtype="auto", device="cuda").served_weights() == "auto"


def test_errors_name_what_is_unsupported(checkpoints, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weight dtype 'fp2'"):
        load_model(checkpoints["dense"], weight_dtype="fp2")
    with pytest.raises(ValueError, match="fp4 holds DeepSeek-V4's FP4 routed experts"):
        load_model(checkpoints["dense"], weight_dtype="fp4")
    with pytest.raises(ValueError, match=r"not a DeepSeek-V3\.2 / GLM-5 / V4 model"):
        load_model("tiny-indexshare", weight_dtype="fp8")
    with pytest.raises(ValueError, match="FP8 activation mode"):
        load_model(checkpoints["fp8"], fp8_mode="w4a8")  # type: ignore[arg-type]
    # transformers' in-memory layout: experts fused into 3-D tensors
    fused = tmp_path / "fused"
    fused.mkdir()
    ref = hf_tiny.build(hf_tiny.v32_config(), seed=2)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"))
    shutil.copy(checkpoints["dense"] / "config.json", fused / "config.json")
    with pytest.raises(CheckpointError, match="fused 3-D expert tensors"):
        load_model(fused, weight_dtype="fp8")


def test_in_place_builds_draw_the_same_weights_on_the_cpu() -> None:
    """``in_place`` allocates on the device and draws there: on the CPU the same numbers as
    the default build (initialised on the CPU, then moved)."""
    a = build_model(preset("tiny-glm"), in_place=True).state_dict()
    b = build_model(preset("tiny-glm")).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
