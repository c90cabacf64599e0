"""How a real family's weights are held in memory: in the serving dtype, or FP8 (e4m3 with one
fp32 scale per 128x128 block, as DeepSeek-V3.2's and GLM-5-FP8's checkpoints store them).

With FP8, every projection a released FP8 checkpoint stores in FP8 stays FP8 in device memory
and runs through the block-scaled matmul (``FP8Linear``; the routed experts through the fused
FP8 MoE). What stays in the serving dtype, as in those checkpoints and in vLLM / SGLang: the
embedding and ``lm_head``, the norms, the routers, the indexer's ``weights_proj`` (fp32), and
``kv_b_proj``, which absorbed MLA splits into W_UK and W_UV for batched matmuls (dequantized
once at load, as vLLM and SGLang do; ``ABSORBED``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dhisparse.family.quantization_config import WEIGHT_DTYPES, serves_fp8
from services.worker.ops.fp8_linear import MODES, Mode

__all__ = ["ABSORBED", "BF16", "WEIGHT_DTYPES", "WeightFormat", "linear", "resolve"]

# FP8 in a released checkpoint, kept in the serving dtype here: absorbed MLA needs it as
# per-head batched-matmul operands.
ABSORBED = ("kv_b_proj",)


@dataclass(frozen=True)
class WeightFormat:
    """``fp8``: projections held as FP8 (``FP8Linear``) and the routed experts as FP8
    (``FP8Experts``); ``mode``: their activation mode (``ops/fp8_linear.py``);
    ``fp4_experts``: with ``fp8``, the routed experts held as FP4 e2m1 with one power-of-two
    scale per 32 columns instead (``FP4Experts``: DeepSeek-V4's released form)."""

    fp8: bool = False
    mode: Mode = "w8a16"
    fp4_experts: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"FP8 activation mode {self.mode!r} is not one of {MODES}")
        if self.fp4_experts and not self.fp8:
            raise ValueError("FP4 routed experts come with FP8 projections (fp8=True)")


BF16 = WeightFormat()


def resolve(weight_dtype: str, checkpoint_fp8: bool, mode: Mode = "w8a16") -> WeightFormat:
    """The format a load serves: ``weight_dtype`` "fp8", "fp4" (FP8 projections, FP4 routed
    experts) or "bf16" (the serving dtype, an FP8 checkpoint dequantized at load) as asked, or
    "auto": FP8 exactly when the checkpoint's FP8 can be served as stored
    (``checkpoint_fp8``), the routed experts FP8 whatever the checkpoint stores (DeepSeek-V4's
    FP4 experts re-held exactly in FP8 blocks: the FP8 MoE decodes faster than the FP4 one,
    docs/fp8_weights.md)."""
    fp8 = serves_fp8(weight_dtype, checkpoint_fp8)
    return WeightFormat(fp8=fp8, mode=mode, fp4_experts=weight_dtype == "fp4")


def linear(d_in: int, d_out: int, fmt: WeightFormat) -> nn.Module:
    """A bias-free projection ``[d_in] -> [d_out]`` in ``fmt``: ``nn.Linear`` or ``FP8Linear``
    (both expose ``weight``; FP8Linear also ``weight_scale_inv``)."""
    if not fmt.fp8:
        return nn.Linear(d_in, d_out, bias=False)
    from services.worker.model.fp8_linear_layer import FP8Linear

    return FP8Linear(d_in, d_out, mode=fmt.mode)
