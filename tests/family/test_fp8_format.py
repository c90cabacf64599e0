"""The FP8 row formats: byte layout at the released and tiny dims, the reference codec's scale
and saturation rules, exact round trips, and fp8 bytes per token of the real configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dhisparse.family.fp8_kv_format import (
    Fp8RowFormat,
    fp8_bytes_per_token,
    index_key_format,
    mla_row_format,
)
from dhisparse.family.hf_dir import hf_family
from services.worker.ops.fp8_kv_codec import pack, tile_scales, unpack
from tests.fp8_cases import random_rows

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"


def test_released_layouts() -> None:
    row = mla_row_format(512, 64)
    assert (row.scales_offset, row.tail_offset, row.row_bytes, row.n_tiles) == (512, 528, 656, 4)
    key = index_key_format(128)
    assert (key.scales_offset, key.tail_offset, key.row_bytes, key.n_tiles) == (128, 132, 132, 1)
    assert mla_row_format(64, 16).row_bytes == 64 + 4 + 32  # one tile of 64
    assert index_key_format(32).row_bytes == 36
    assert index_key_format(256).row_bytes == 256 + 8
    with pytest.raises(ValueError):
        Fp8RowFormat(96, 0, 64, -13)  # a tile must divide the values


def test_fp8_bytes_per_token_of_deepseek_v32() -> None:
    cfg, _ = hf_family(CONFIGS / "deepseek-v3.2")
    assert fp8_bytes_per_token(cfg) == 61 * (656 + 132) == 48_068


def test_fp8_bytes_per_token_counts_only_index_producers() -> None:
    cfg, _ = hf_family(CONFIGS / "glm-5.2")
    producers = sum(t == "full" for t in cfg.indexer_types)
    assert producers < cfg.num_layers
    assert fp8_bytes_per_token(cfg) == cfg.num_layers * 656 + producers * 132


def _fields(fmt: Fp8RowFormat, packed: torch.Tensor):
    q = packed[:, : fmt.n_values]
    scales = packed[:, fmt.scales_offset : fmt.tail_offset].contiguous().view(torch.float32)
    tail = packed[:, fmt.tail_offset :].contiguous().view(torch.bfloat16)
    return q, scales, tail


@pytest.mark.parametrize("fmt", [mla_row_format(512, 64), mla_row_format(64, 16),
                                 index_key_format(128), index_key_format(32)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_layout_and_rules(fmt: Fp8RowFormat, dtype: torch.dtype) -> None:
    rows = random_rows(fmt, 37, seed=fmt.row_bytes, dtype=dtype)
    packed = pack(fmt, rows)
    assert packed.dtype == torch.uint8 and packed.shape == (37, fmt.row_bytes)
    q, scales, tail = _fields(fmt, packed)
    # scales are powers of two: the smallest 2^k >= amax / 448, floored at 2^min_scale_exp
    mant, exp = torch.frexp(scales)
    assert (mant == 0.5).all()
    amax = rows[:, : fmt.n_values].float().abs().reshape(37, fmt.n_tiles, -1).amax(-1)
    k = exp - 1
    assert (amax <= 448 * scales).all()
    above_floor = k > fmt.min_scale_exp
    assert (amax[above_floor] > 224 * scales[above_floor]).all()
    assert scales[0, 0] == 2.0**fmt.min_scale_exp  # the tiny tile sits on the floor
    # saturation: no NaN byte (0x7f / 0xff); the tile's amax maps to at most 448
    assert not ((q & 0x7F) == 0x7F).any()
    assert tail.equal(rows[:, fmt.n_values :].to(torch.bfloat16))
    # the dequantized row is exact e4m3 * scale, in the caller's dtype
    out = unpack(fmt, packed, dtype)
    assert out.dtype == dtype
    expect = q.view(torch.float8_e4m3fn).float().reshape(37, fmt.n_tiles, -1) * scales[..., None]
    assert out[:, : fmt.n_values].float().equal(expect.reshape(37, -1))


def test_scale_boundaries() -> None:
    """amax exactly 448 * 2^k keeps scale 2^k (and stores 448 = 0x7e); one ulp above moves to
    2^(k+1). Checked against frexp, independent of the log2 in the codec."""
    fmt = Fp8RowFormat(4, 0, 4, -13)
    for k in (-10, -3, 0, 5, 20):
        edge = torch.tensor(448.0 * 2.0**k)
        up = torch.nextafter(edge, torch.tensor(float("inf")))
        down = torch.nextafter(edge, torch.tensor(0.0))
        rows = torch.stack([edge, up, down]).repeat_interleave(4).reshape(3, 4) * torch.tensor(
            [1.0, -0.5, 0.25, 0.1]
        )
        s = tile_scales(fmt, rows)[:, 0]
        assert s.tolist() == [2.0**k, 2.0 ** (k + 1), 2.0**k]
        packed = pack(fmt, rows)
        assert packed[0, 0] == 0x7E and packed[2, 0] == 0x7E  # 448 and just below round to 448
        assert packed[1, 0] == 0x76  # just above 448 * 2^k: 224 * 2^(k+1)


def test_round_trip_error_is_bounded() -> None:
    """Relative error of each value is <= 2^-4 (half an e4m3 ulp) for values above the tile's
    subnormal range; the tail is bf16 exactly."""
    fmt = mla_row_format(512, 64)
    rows = random_rows(fmt, 64, seed=3, dtype=torch.float32)
    out = unpack(fmt, pack(fmt, rows), torch.float32)
    scales = tile_scales(fmt, rows[:, :512]).repeat_interleave(fmt.tile, dim=1)
    normal = rows[:, :512].abs() >= scales * 2.0**-6
    rel = ((out[:, :512] - rows[:, :512]).abs() / rows[:, :512].abs())[normal]
    assert rel.max() <= 2.0**-4
