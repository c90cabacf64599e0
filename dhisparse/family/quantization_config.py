"""What a checkpoint's ``config.json`` says about how its weights are stored: the
``quantization_config`` of an FP8 checkpoint (e4m3 weights with one scale per block), checked
field by field. Pure Python: ``dhisparse plan`` sizes a model's weights from config.json alone,
in the format a worker would hold them."""

from __future__ import annotations

from typing import Any

# quantization_config: the values each field may take (None: the field is absent).
QUANT_FIELDS: dict[str, tuple[Any, ...]] = {
    "quant_method": ("fp8",),
    "fmt": (None, "e4m3"),
    "activation_scheme": (None, "dynamic"),
    "scale_fmt": (None, "ue8m0"),
}
# Fields that only describe which modules are FP8; the stored dtypes say that already.
QUANT_INFO_FIELDS = {"modules_to_not_convert"}

FP8_EDGE = 128  # the edge of an FP8 weight's square scale block
FP8_BLOCK = (FP8_EDGE, FP8_EDGE)  # the block the FP8 kernels take as stored
SCALE_SUFFIX = "_scale_inv"  # X.weight's block scales are X.weight_scale_inv
# --weight-dtype: "fp8", the serving dtype ("bf16"), or "auto": FP8 where the checkpoint is
WEIGHT_DTYPES = ("auto", "fp8", "fp4", "bf16")


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is; the message names the file, tensor or field."""


def block_size(quantization: dict | None) -> tuple[int, int] | None:
    """The FP8 weight block ``(bm, bn)`` that a config's ``quantization_config`` gives, or None
    without one; a field this reader does not support raises CheckpointError naming it."""
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise CheckpointError(f"quantization_config must be an object, got {quantization!r}")
    for field, allowed in QUANT_FIELDS.items():
        if quantization.get(field) not in allowed:
            raise CheckpointError(
                f"quantization_config.{field} = {quantization.get(field)!r} is not supported "
                f"(supported: {', '.join(repr(a) for a in allowed if a is not None)})"
            )
    unknown = set(quantization) - set(QUANT_FIELDS) - QUANT_INFO_FIELDS - {"weight_block_size"}
    if unknown:
        raise CheckpointError(f"quantization_config.{', '.join(sorted(unknown))}: not supported")
    block = quantization.get("weight_block_size")
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"quantization_config.weight_block_size = {block!r} is not supported "
            "(supported: two positive integers [bm, bn])"
        )
    return block[0], block[1]


def fp8_as_stored(quantization: dict | None) -> bool:
    """Whether a checkpoint of this ``quantization_config`` serves its FP8 weights as stored:
    FP8 with the kernels' 128x128 blocks (other blocks are dequantized at load, or requantized
    into an ``Fp8Target``)."""
    return quantization is not None and block_size(quantization) == FP8_BLOCK


def serves_fp8(weight_dtype: str, checkpoint_fp8: bool) -> bool:
    """Whether a load holds the projections (and experts) in FP8: ``weight_dtype`` "fp8", "fp4"
    (FP8 projections, FP4 routed experts: DeepSeek-V4) or "bf16" (the serving dtype, an FP8
    checkpoint dequantized at load) as asked, or "auto": FP8 exactly when the checkpoint's FP8
    can be served as stored (``checkpoint_fp8``)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {weight_dtype!r} is not one of {WEIGHT_DTYPES}")
    return checkpoint_fp8 if weight_dtype == "auto" else weight_dtype in ("fp8", "fp4")


def modules_not_converted(quantization: dict | None) -> tuple[str, ...]:
    """The checkpoint modules an FP8 checkpoint stores unquantized (``modules_to_not_convert``,
    checkpoint names such as ``model.layers.0.self_attn.kv_a_proj_with_mqa``); none without."""
    if quantization is None:
        return ()
    names = quantization.get("modules_to_not_convert") or ()
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(
            f"quantization_config.modules_to_not_convert = {names!r} is not a list of names"
        )
    return tuple(names)
