"""The decode indexer's scores read straight from the paged index-key cache: one program per
(request, block of BLOCK_S rows), ``I[r, s] = sum_h w[r, h] * relu(q[r, h] . key(r, s))`` for
rows s below the request's visible count, 0 beyond (see ``index_scores_paged.py``, which
launches it and holds the torch form).

Row s of a request lives at ``page_table[slot, s // PAGE] * PAGE + s % PAGE`` of the key
storage. Keys are stored in the serving dtype (``FP8`` False) or in the FP8 index-key format
(``FP8`` True: D e4m3 bytes, then one fp32 scale; dequantized exactly, e4m3 times a power of
two, then rounded to ``DOT_DTYPE`` as the torch form's gather rounds it to the serving dtype).
The products q . key accumulate in fp32 (``DOT_DTYPE`` bf16 / fp16: exact products; fp32:
IEEE, never TF32). ``SPLIT``: fp32 queries over keys that bf16 holds exactly (bf16 or FP8
storage) are scored as three tensor-core dots, q = hi + mid + lo with each part rounded to
bf16 (the three hold fp32's 24 bits, so each product is exact and only the order of the fp32
sums differs from the IEEE dot); ``DOT_DTYPE`` is then the parts' and keys' dtype (bf16, or
fp32 under the interpreter, whose bf16 dot is wrong)."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.fp8_bits import e4m3_value


@triton.jit
def index_scores_kernel(
    q_ptr, stride_qr, stride_qh,
    w_ptr, stride_wr,
    key_ptr, stride_key,
    table_ptr, stride_table,
    slot_ptr, visible_ptr,
    out_ptr, stride_out,
    H, D, S,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < H
    mask_d = offs_d < D
    visible = tl.load(visible_ptr + r)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    mask_s = (offs_s < visible) & (offs_s < S)
    page = tl.load(table_ptr + slot * stride_table + offs_s // PAGE, mask=mask_s, other=0)
    loc = page.to(tl.int64) * PAGE + offs_s % PAGE  # [BLOCK_S]
    # Row starts share only the stride's alignment (the wrapper checks 4 B for fp8 rows); the
    # hint keeps the compiler from assuming more from loc's structure and vectorizing wider.
    row = key_ptr + tl.multiple_of(loc * stride_key, 4 if FP8 else 1)  # [BLOCK_S]
    mask_k = mask_s[:, None] & mask_d[None, :]
    if FP8:
        b = tl.load(row[:, None] + offs_d[None, :], mask=mask_k, other=0).to(tl.int32)
        offs4 = tl.arange(0, 4)
        sb = tl.load(row[:, None] + D + offs4[None, :], mask=mask_s[:, None], other=0)
        scale = tl.sum(sb.to(tl.int32) << (8 * offs4[None, :]), 1).to(tl.float32, bitcast=True)
        keys = (e4m3_value(b) * scale[:, None]).to(DOT_DTYPE)  # [BLOCK_S, BLOCK_D]
    else:
        keys = tl.load(row[:, None] + offs_d[None, :], mask=mask_k, other=0.0).to(DOT_DTYPE)
    q = tl.load(
        q_ptr + r * stride_qr + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    keys_t = tl.trans(keys)
    if SPLIT:
        hi = q.to(tl.bfloat16).to(tl.float32)
        mid = (q - hi).to(tl.bfloat16).to(tl.float32)
        lo = (q - hi - mid).to(tl.bfloat16)
        logits = tl.dot(hi.to(DOT_DTYPE), keys_t, out_dtype=tl.float32)
        logits = tl.dot(mid.to(DOT_DTYPE), keys_t, logits, out_dtype=tl.float32)
        logits = tl.dot(lo.to(DOT_DTYPE), keys_t, logits, out_dtype=tl.float32)
    else:
        logits = tl.dot(q.to(DOT_DTYPE), keys_t, input_precision="ieee", out_dtype=tl.float32)
    w = tl.load(w_ptr + r * stride_wr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    scores = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)  # [BLOCK_S]
    scores = tl.where(mask_s, scores, 0.0)
    tl.store(out_ptr + r * stride_out + offs_s, scores, mask=offs_s < S)
