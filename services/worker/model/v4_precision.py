"""The dtypes DeepSeek-V4 is served in: every floating tensor in the serving dtype but those
transformers keeps in fp32 in any dtype (``_keep_in_fp32_modules_strict``): the
hyper-connections' ``fn`` / ``base`` / ``scale`` and the hyper head's, the attention sinks, the
compressors' position biases (``ape``), the routers' correction biases and every RMSNorm's
weight. The modules read those in fp32 and hand the serving dtype on (``v4_norm.RMSNorm``
scales in fp32, then casts). Buffers keep their dtypes: a quantized projection's or expert
stack's bytes and fp32 scales (``WeightFormat.fp8``), the hash routers' ``tid2eid``."""

from __future__ import annotations

import re

import torch
from torch import nn

# DeepSeek's names of the tensors held in fp32 (transformers': attn_hc / ffn_hc / hc_head,
# sinks, position_bias, e_score_correction_bias, q_a_norm / kv_norm / the layer norms / norm)
FP32_TENSORS = re.compile(r"(^|\.)(hc_\w+|attn_sink|ape|gate\.bias|(\w*norm)\.weight)$")
SERVING_DTYPES = (torch.float32, torch.bfloat16)


def held_in_fp32(name: str) -> bool:
    return FP32_TENSORS.search(name) is not None


def to_serving_dtype(net: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``net`` with its parameters in ``dtype``, those ``held_in_fp32`` in fp32 (buffers
    untouched: quantized weights, their scales, ``tid2eid``); ValueError for a dtype V4 is not
    served in."""
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"DeepSeek-V4 is served in float32 or bfloat16, not {dtype}")
    with torch.no_grad():
        for name, t in net.named_parameters():
            t.data = t.data.to(torch.float32 if held_in_fp32(name) else dtype)
    return net
