"""The FP8 KV formats (``--kv-cache-dtype fp8``): how one stored row is laid out as bytes, and
what a token costs in them. Pure Python (sizing imports no torch); the reference codec is
``fp8_codec.py``.

One layout serves both cached objects (sources in ``docs/fp8_kv.md``):

    [ values: n_values e4m3 bytes | scales: n_tiles fp32 (little-endian) | tail: n_tail bf16 ]

- the MLA row (FlashMLA "V32_FP8Sparse", 656 B at the released dims): values = the normed
  latent (kv_lora_rank), tail = the roped key (qk_rope_head_dim), kept in bf16;
- the index key (vLLM's DeepSeek-V3.2 indexer cache, 132 B): values = the key (index_head_dim),
  no tail.

Each tile of ``tile`` consecutive values has one scale, a power of two (UE8M0, as FlashMLA's
reference quantizer and ``scale_fmt: ue8m0``): the smallest 2^k with amax <= 448 * 2^k, floored
at 2^min_scale_exp. A value is stored as round-to-nearest-even e4m3 of x / 2^k, saturated to
+-448 (never NaN; the scale rule keeps |x / 2^k| <= 448, so saturation is a guard only).
Dequantization is e4m3 * scale in fp32, exact (3-bit mantissa times a power of two), then cast
to the caller's dtype, which is exact for bf16 too. The packed tensor is plain uint8
[N, row_bytes], so the hierarchy moves it as bytes. Inputs must be finite.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.family.hf_config import MLAConfig

E4M3_MAX = 448.0
TILE = 128  # values per scale at the released dims (FlashMLA, vLLM)
MLA_MIN_SCALE_EXP = -13  # FlashMLA quant.py clamps the scale at 1e-4: 2^ceil(log2 1e-4)
KEY_MIN_SCALE_EXP = -22  # vLLM clamps amax at 1e-4: 2^ceil(log2(1e-4 / 448))


@dataclass(frozen=True)
class Fp8RowFormat:
    """Byte layout of one FP8 row: ``n_values`` e4m3 values in tiles of ``tile`` (one fp32
    scale each), then ``n_tail`` bf16 values stored unquantized."""

    n_values: int
    n_tail: int
    tile: int
    min_scale_exp: int

    def __post_init__(self) -> None:
        t = self.tile
        if t <= 0 or t & (t - 1) or self.n_values % t:
            raise ValueError(f"tile {t} must be a power of two dividing {self.n_values} values")

    @property
    def n_tiles(self) -> int:
        return self.n_values // self.tile

    @property
    def scales_offset(self) -> int:
        return self.n_values

    @property
    def tail_offset(self) -> int:
        return self.n_values + 4 * self.n_tiles

    @property
    def row_bytes(self) -> int:
        return self.tail_offset + 2 * self.n_tail

    @property
    def width(self) -> int:
        """Elements of the dequantized row: values then tail."""
        return self.n_values + self.n_tail


def _tile(dim: int) -> int:
    """128 at the released dims; a smaller model's whole dim when it is below 128."""
    return min(TILE, dim)


def mla_row_format(kv_lora_rank: int, rope_dim: int) -> Fp8RowFormat:
    return Fp8RowFormat(kv_lora_rank, rope_dim, _tile(kv_lora_rank), MLA_MIN_SCALE_EXP)


def index_key_format(index_head_dim: int) -> Fp8RowFormat:
    return Fp8RowFormat(index_head_dim, 0, _tile(index_head_dim), KEY_MIN_SCALE_EXP)


def fp8_bytes_per_token(cfg: MLAConfig) -> int:
    """Cached bytes one token adds over the main layers in fp8: an MLA row per layer plus an
    index key per index producer (``full`` layer). DeepSeek-V3.2: 61 x (656 + 132) = 48,068."""
    row = mla_row_format(cfg.kv_lora_rank, cfg.qk_rope_head_dim).row_bytes
    key = index_key_format(cfg.index_head_dim).row_bytes
    producers = sum(t == "full" for t in cfg.indexer_types)
    return cfg.num_layers * row + producers * key
