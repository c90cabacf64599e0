"""write_fp8_checkpoint on a tiny transformers DeepSeek-V3.2: what it quantizes, that every
converted tensor is within e4m3's rounding, that the rest is bit-identical, and that the result
loads back into a transformers model through load_into."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dhisparse.family.quantization_config import SCALE_SUFFIX
from services.worker.weights.checkpoint import Checkpoint
from services.worker.weights.fp8_writer import reshard_checkpoint, write_fp8_checkpoint
from services.worker.weights.loader import load_into
from tests.worker.checkpoint_files import fp8_bound

transformers = pytest.importorskip("transformers")

MOE_INTERMEDIATE = 48
# What the released DeepSeek-V3.2 FP8 checkpoint stores as FP8, per layer.
FP8_SUFFIXES = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.indexer.wq_b.weight",
    "self_attn.indexer.wk.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
FP8_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.(experts\.\d+|shared_experts)\.\w+_proj\.weight")


def tiny_config():
    return transformers.DeepseekV32Config(
        hidden_size=64,
        num_hidden_layers=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        index_n_heads=16,
        index_head_dim=32,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        vocab_size=128,
        intermediate_size=160,
        moe_intermediate_size=MOE_INTERMEDIATE,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny DeepseekV32ForCausalLM (fp32, one model.safetensors) and the model."""
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(tiny_config()).eval()
    path = tmp_path_factory.mktemp("tiny_v32")
    model.save_pretrained(path)
    return path, model


def expected_fp8(name: str) -> bool:
    return name.endswith(FP8_SUFFIXES) or bool(FP8_EXPERT.fullmatch(name))


@pytest.mark.parametrize(
    ("block", "scale_dtype"), [((128, 128), "F32"), ((32, 24), "F8_E8M0"), ((16, 16), "F32")]
)
def test_converted_tensors_are_within_e4m3_and_the_rest_bit_identical(
    tiny, tmp_path, block, scale_dtype
) -> None:
    src_dir, _ = tiny
    write_fp8_checkpoint(src_dir, tmp_path, block=block, scale_dtype=scale_dtype)
    config = json.loads((tmp_path / "config.json").read_text())
    quant = config.pop("quantization_config")
    assert config == json.loads((src_dir / "config.json").read_text())
    assert quant["weight_block_size"] == list(block) and quant["quant_method"] == "fp8"
    assert (quant.get("scale_fmt") == "ue8m0") == (scale_dtype == "F8_E8M0")
    gen = "generation_config.json"
    assert (tmp_path / gen).read_bytes() == (src_dir / gen).read_bytes()

    src, dst = Checkpoint(src_dir), Checkpoint(tmp_path, quant)
    assert sorted(dst.names()) == sorted(src.names())
    fp8 = [n for n in src.names() if expected_fp8(n)]
    assert len(fp8) == 2 * 7 + 3 + 3 * 4 + 3  # attention per layer, dense MLP, experts, shared
    for name in src.names():
        original = src.get(name, torch.float32)
        if name in fp8:
            assert dst.dtype(name) == "F8_E4M3", name
            w_fp8, scale = dst.get_fp8(name)
            assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == original.shape
            if scale_dtype == "F8_E8M0":
                assert torch.equal(torch.frexp(scale).mantissa, torch.full_like(scale, 0.5))
            out = dst.get(name, torch.float32)
            assert ((out - original).abs() <= fp8_bound(original, scale, block)).all(), name
        else:
            assert dst.dtype(name) == src.dtype(name) == "F32", name
            assert torch.equal(dst.get(name, torch.float32), original), name


def test_shards_hold_a_weight_with_its_scale_and_match_one_file(tiny, tmp_path) -> None:
    src_dir, _ = tiny
    write_fp8_checkpoint(src_dir, tmp_path / "one", block=(32, 24))
    write_fp8_checkpoint(src_dir, tmp_path / "many", block=(32, 24), max_shard_bytes=40_000)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert len(set(weight_map.values())) > 3
    for name, shard in weight_map.items():
        if name.endswith(SCALE_SUFFIX):
            assert weight_map[name.removesuffix(SCALE_SUFFIX)] == shard, name
    quant = json.loads((tmp_path / "many" / "config.json").read_text())["quantization_config"]
    one, many = Checkpoint(tmp_path / "one", quant), Checkpoint(tmp_path / "many", quant)
    assert sorted(one.names()) == sorted(many.names())
    for name in one.names():
        assert torch.equal(one.get(name, torch.float32), many.get(name, torch.float32)), name

    write_fp8_checkpoint(src_dir, tmp_path / "many", block=(32, 24))  # one file now
    assert (
        not list((tmp_path / "many").glob("model-*"))
        and not (tmp_path / "many" / "model.safetensors.index.json").exists()
    )


def test_skip_keeps_tensors_in_their_dtype(tiny, tmp_path) -> None:
    src_dir, _ = tiny
    write_fp8_checkpoint(src_dir, tmp_path, skip=lambda name: ".experts." in name)
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    dst = Checkpoint(tmp_path, quant)
    assert dst.dtype("model.layers.1.mlp.experts.0.up_proj.weight") == "F32"
    assert dst.dtype("model.layers.1.mlp.shared_experts.up_proj.weight") == "F8_E4M3"


def _stored(ckpt: Checkpoint, name: str) -> tuple[torch.Tensor, ...]:
    """A tensor's stored values: an FP8 weight's bytes and scales, else the values in fp32."""
    if ckpt.is_fp8(name):
        w, scale = ckpt.get_fp8(name)
        return w.view(torch.uint8), scale
    return (ckpt.get(name, torch.float32),)


def test_resharding_copies_every_stored_tensor_bit_for_bit(tiny, tmp_path) -> None:
    """An FP8 checkpoint split into shards of a size limit: the same tensors, bytes and
    dtypes; a weight beside its scale; no shard's tensors over the limit; one file again with
    a limit above the total."""
    src_dir, _ = tiny
    write_fp8_checkpoint(src_dir, tmp_path)
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    before = Checkpoint(tmp_path, quant)
    stored = {n: _stored(before, n) for n in before.names()}
    dtypes = {n: before.dtype(n) for n in before.names()}
    before.close()
    files = reshard_checkpoint(tmp_path, 40_000)
    assert len(files) > 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    for name, file in index.items():
        if name.endswith(SCALE_SUFFIX):
            assert index[name.removesuffix(SCALE_SUFFIX)] == file
    after = Checkpoint(tmp_path, quant)
    assert sorted(after.names()) == sorted(stored)
    for name, want in stored.items():
        assert after.dtype(name) == dtypes[name], name
        assert all(torch.equal(a, b) for a, b in zip(want, _stored(after, name), strict=True))
    after.close()
    assert reshard_checkpoint(tmp_path, 1 << 40) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_a_quantized_source_is_refused(tiny, tmp_path) -> None:
    src_dir, _ = tiny
    write_fp8_checkpoint(src_dir, tmp_path / "fp8")
    with pytest.raises(ValueError, match="quantized already"):
        write_fp8_checkpoint(tmp_path / "fp8", tmp_path / "again")


def test_the_fp8_checkpoint_loads_into_a_transformers_model(tiny, tmp_path) -> None:
    """Through load_into with views into transformers' fused experts ([E, 2I, H] gate then
    up, [E, H, I] down); the logits stay within FP8 weight noise of the original model's."""
    src_dir, model = tiny
    write_fp8_checkpoint(src_dir, tmp_path, block=(32, 24), scale_dtype="F8_E8M0")
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    torch.manual_seed(1)
    fresh = transformers.DeepseekV32ForCausalLM(tiny_config()).eval()
    targets, n = {}, MOE_INTERMEDIATE
    for name, t in fresh.state_dict().items():
        fused = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
        if fused is None:
            targets[name] = t
            continue
        for e in range(t.shape[0]):
            if fused[2] == "down_proj":
                targets[f"{fused[1]}.{e}.down_proj.weight"] = t[e]
            else:
                targets[f"{fused[1]}.{e}.gate_proj.weight"] = t[e, :n]
                targets[f"{fused[1]}.{e}.up_proj.weight"] = t[e, n:]
    load_into(Checkpoint(tmp_path, quant), targets)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = model(ids).logits, fresh(ids).logits
    assert (got - want).norm() / want.norm() < 0.08
