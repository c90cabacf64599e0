"""What a model's rotary embedding is, as config.json states it: plain RoPE or YaRN (the
DeepSeek-V3.2 context extension), and the scalars YaRN derives from it.

Pure Python, so that parsing a config (``hf_config``) and sizing a model (``dhisparse plan``)
import no torch; ``rotary`` computes the frequency tables from a ``RopeSpec``. The formulas are
transformers' ``_compute_yarn_parameters``, the oracle for the real families."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

RopeKind = Literal["default", "yarn"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    kind: RopeKind = "default"
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # cos/sin multiplier; derived from mscale when None
    truncate: bool = True

    def correction_range(self, dim: int) -> tuple[float, float]:
        """YaRN's (low, high) dimension range over which a ``dim``-wide rotary part blends
        from extrapolated to interpolated frequencies (DeepSeek-V3.2 at dim 64: 10, 23)."""

        def correction_dim(rotations: float) -> float:
            ratio = self.original_max_position / (rotations * 2 * math.pi)
            return dim * math.log(ratio) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    @property
    def table_factor(self) -> float:
        """The multiplier on cos and sin (1 for plain RoPE)."""
        if self.kind == "default":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """The factor on the attention softmax scale: mscale(factor, mscale_all_dim)^2 under YaRN
        (DeepSeek-V3.2: 1.36889^2, so 192^-0.5 becomes 0.1352338), else 1."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2
