"""DeepSeek-V3.2's ``quantization_config`` as released: e4m3 weights, one UE8M0 scale per
128x128 block, activations quantized at run time. Pure Python (the presets import it)."""

from __future__ import annotations

from typing import Any

RELEASED_FP8: dict[str, Any] = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
