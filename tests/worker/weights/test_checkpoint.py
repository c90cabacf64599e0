"""The safetensors reader: FP8 dequantization on ceil-div grids, single file against shards,
lazy shard mapping, and the start-up errors that name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from services.worker.ops.fp8_blockwise import dequantize_blockwise
from services.worker.weights import checkpoint as checkpoint_module
from services.worker.weights.checkpoint import Checkpoint, CheckpointError, read_header
from tests.worker.checkpoint_files import FP8_QUANT, fp8_bound, quantized, write

SHAPES = {"a.weight": (576, 300), "b.weight": (130, 257), "c.weight": (64, 64)}


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}
    out["norm.weight"] = torch.rand(300, generator=g).to(torch.bfloat16)
    out["bias"] = torch.randn(7, generator=g).to(torch.float16)
    out["ids"] = torch.arange(5, dtype=torch.int64)
    return out


@pytest.mark.parametrize("scale_dtype", ["F32", "F8_E8M0"])
def test_get_dequantizes_exactly_as_dequantize_blockwise(tmp_path, scale_dtype) -> None:
    src = weights()
    stored = quantized(src, scale_dtype=scale_dtype)
    ckpt = Checkpoint(write(tmp_path, stored), FP8_QUANT)
    header = read_header(tmp_path / "model.safetensors")
    by_offset = sorted(header, key=lambda n: header[n].offset)
    assert ckpt.names() == [n for n in by_offset if not n.endswith("_scale_inv")]
    assert set(ckpt.names()) == set(src) and ckpt.block == (128, 128)
    for name in SHAPES:
        assert ckpt.dtype(name) == "F8_E4M3" and ckpt.shape(name) == SHAPES[name]
        out = ckpt.get(name, torch.float32)
        scale = stored[name + "_scale_inv"]
        assert torch.equal(out, dequantize_blockwise(stored[name], scale, (128, 128)))
        assert ((out - src[name]).abs() <= fp8_bound(src[name], scale, (128, 128))).all()
        w_fp8, scale32 = ckpt.get_fp8(name)
        assert torch.equal(w_fp8.view(torch.uint8), stored[name].view(torch.uint8))
        assert scale32.dtype == torch.float32 and torch.equal(scale32, scale.float())
        assert torch.equal(ckpt.get(name, torch.bfloat16), out.to(torch.bfloat16))


def test_bf16_scales_are_read_as_float32(tmp_path) -> None:
    src = weights()
    stored = quantized(src)
    stored = {k: v.to(torch.bfloat16) if k.endswith("_scale_inv") else v for k, v in stored.items()}
    ckpt = Checkpoint(write(tmp_path, stored), FP8_QUANT)
    scale = stored["b.weight_scale_inv"]
    assert ckpt.get_fp8("b.weight")[1].dtype == torch.float32
    expected = dequantize_blockwise(stored["b.weight"], scale, (128, 128))
    assert torch.equal(ckpt.get("b.weight", torch.float32), expected)


def test_the_real_kv_a_grid_with_its_ragged_last_block(tmp_path) -> None:
    w = torch.randn(576, 7168, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    stored = quantized({"kv_a_proj_with_mqa.weight": w})
    assert stored["kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 56)
    ckpt = Checkpoint(write(tmp_path, stored), FP8_QUANT)
    out = ckpt.get("kv_a_proj_with_mqa.weight", torch.float32)
    scale = stored["kv_a_proj_with_mqa.weight_scale_inv"]
    assert ((out - w.float()).abs() <= fp8_bound(w.float(), scale, (128, 128))).all()


def test_plain_tensors_are_cast_and_integers_kept(tmp_path) -> None:
    src = weights()
    ckpt = Checkpoint(write(tmp_path, src))
    assert ckpt.dtype("norm.weight") == "BF16" and ckpt.dtype("bias") == "F16"
    assert torch.equal(ckpt.get("norm.weight", torch.float32), src["norm.weight"].float())
    assert torch.equal(ckpt.get("bias", torch.bfloat16), src["bias"].to(torch.bfloat16))
    assert torch.equal(ckpt.get("a.weight", torch.float32), src["a.weight"])
    assert torch.equal(ckpt.get("ids", torch.int64), src["ids"])
    with pytest.raises(CheckpointError, match=r"ids is stored as I64.*bfloat16"):
        ckpt.get("ids", torch.bfloat16)
    with pytest.raises(CheckpointError, match="no weight named nope"):
        ckpt.get("nope", torch.float32)


@pytest.mark.parametrize("scale_dtype", ["F32", "F8_E8M0"])
def test_shards_and_one_file_give_identical_tensors(tmp_path, scale_dtype) -> None:
    stored = quantized(weights(), scale_dtype=scale_dtype)
    one = Checkpoint(write(tmp_path / "one", stored), FP8_QUANT)
    three = Checkpoint(write(tmp_path / "three", stored, shards=3), FP8_QUANT)
    assert len(list((tmp_path / "three").glob("model-*-of-00003.safetensors"))) == 3
    assert sorted(one.names()) == sorted(three.names())
    for name in one.names():
        dtype = torch.int64 if name == "ids" else torch.float32
        assert three.dtype(name) == one.dtype(name) and three.shape(name) == one.shape(name)
        assert torch.equal(one.get(name, dtype), three.get(name, dtype)), name


def test_reading_a_tensor_maps_only_its_shard(tmp_path, monkeypatch) -> None:
    stored = quantized(weights())
    path = write(tmp_path, stored, shards=3)
    opened = []
    real = checkpoint_module.safe_open

    def spy(file, *args, **kwargs):
        opened.append(file.rsplit("/", 1)[1])
        return real(file, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "safe_open", spy)
    ckpt = Checkpoint(path, FP8_QUANT)
    assert opened == []  # construction reads headers only
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    ckpt.get("b.weight", torch.float32)
    assert opened == [index["b.weight"]]
    ckpt.get("b.weight", torch.float32)  # the shard mapped now is reused
    assert opened == [index["b.weight"]]
    for name in ckpt.names():  # storage order: shard by shard, each mapped once
        ckpt.get(name, torch.int64 if name == "ids" else torch.float32)
    shards = sorted(set(index.values()))
    assert opened[0] != shards[0] and opened[1:] == shards


def test_a_missing_shard_is_named(tmp_path) -> None:
    path = write(tmp_path, quantized(weights()), shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors"):
        Checkpoint(path, FP8_QUANT)


def test_a_tensor_the_index_maps_to_a_shard_that_lacks_it_is_named(tmp_path) -> None:
    path = write(tmp_path, quantized(weights()), shards=3)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"ghost\.weight to model-00001-of-00003"):
        Checkpoint(path, FP8_QUANT)


def test_a_tensor_the_index_does_not_map_is_named(tmp_path) -> None:
    path = write(tmp_path, quantized(weights()), shards=3)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["bias"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="holds bias"):
        Checkpoint(path, FP8_QUANT)


def test_a_truncated_shard_is_named(tmp_path) -> None:
    path = write(tmp_path, weights())
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor a\.weight .*truncated"):
        Checkpoint(path)


def test_a_directory_without_weights_is_named(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors nor"):
        Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such model directory"):
        Checkpoint(tmp_path / "absent")


def test_a_scale_grid_of_the_wrong_shape_names_the_tensor_and_both_shapes(tmp_path) -> None:
    stored = quantized(weights())
    stored["a.weight_scale_inv"] = stored["a.weight_scale_inv"][:4]  # floor-div, not ceil-div
    with pytest.raises(
        CheckpointError, match=r"a\.weight_scale_inv has shape \[4, 3\]; weight \[576, 300\]"
    ) as e:
        Checkpoint(write(tmp_path, stored), FP8_QUANT)
    assert "needs [5, 3]" in str(e.value)


def test_an_fp8_weight_without_a_scale_is_named(tmp_path) -> None:
    stored = quantized(weights())
    del stored["c.weight_scale_inv"]
    with pytest.raises(CheckpointError, match=r"c\.weight \[64, 64\] F8_E4M3 has no c\.weight_sc"):
        Checkpoint(write(tmp_path, stored), FP8_QUANT)


def test_fp8_without_a_quantization_config_is_named(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"a\.weight .* no quantization_config"):
        Checkpoint(write(tmp_path, quantized(weights())))


def test_a_scale_without_an_fp8_weight_is_named(tmp_path) -> None:
    stored = weights()
    stored["a.weight_scale_inv"] = torch.ones(5, 3)
    with pytest.raises(CheckpointError, match=r"a\.weight_scale_inv scales no F8_E4M3"):
        Checkpoint(write(tmp_path, stored), FP8_QUANT)


def test_an_unsupported_scale_dtype_is_named(tmp_path) -> None:
    stored = quantized(weights())
    stored["b.weight_scale_inv"] = stored["b.weight_scale_inv"].to(torch.float16)
    with pytest.raises(CheckpointError, match=r"b\.weight_scale_inv is stored as F16"):
        Checkpoint(write(tmp_path, stored), FP8_QUANT)


def test_another_fp8_format_is_named_on_read(tmp_path) -> None:
    save_file(
        {"e.weight": torch.randn(4, 4).to(torch.float8_e5m2)}, str(tmp_path / "model.safetensors")
    )
    ckpt = Checkpoint(tmp_path, FP8_QUANT)
    with pytest.raises(CheckpointError, match=r"e\.weight is stored as F8_E5M2"):
        ckpt.get("e.weight", torch.bfloat16)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("quant_method", "awq"),
        ("fmt", "e5m2"),
        ("activation_scheme", "static"),
        ("scale_fmt", "e4m3"),
        ("weight_block_size", [128]),
        ("weight_block_size", None),
        ("weight_block_size", [128, 0]),
        ("group_size", 128),
    ],
)
def test_an_unsupported_quantization_field_is_named(tmp_path, field, value) -> None:
    path = write(tmp_path, weights())
    with pytest.raises(CheckpointError, match=f"quantization_config.{field}"):
        Checkpoint(path, {**FP8_QUANT, field: value})


def test_the_glm5_fp8_config_and_a_non_128_block_are_accepted(tmp_path) -> None:
    stored = quantized(weights(), block=(32, 48))
    glm = {"quant_method": "fp8", "weight_block_size": [32, 48], "modules_to_not_convert": []}
    ckpt = Checkpoint(write(tmp_path, stored), glm)
    assert ckpt.block == (32, 48)
    expected = dequantize_blockwise(stored["b.weight"], stored["b.weight_scale_inv"], (32, 48))
    assert torch.equal(ckpt.get("b.weight", torch.float32), expected)
