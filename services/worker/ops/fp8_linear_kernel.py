"""The FP8 block-scaled matmul kernel ``y = x @ dequant(W)^T (+ bias)``: one program per
[BLOCK_M, BLOCK_N] tile of y and split of K, a loop over that split's K blocks of 128 aligned
to the weight's scale grid, ``K_STEP`` (1 or 2) scale blocks per iteration (see
``fp8_linear.py``, which launches it and holds the torch references).

How the splits of K end (compile-time ``SPLIT`` and ``SUM_SPLITS``):
- one split (``SPLIT=False``): the program writes its tile of y, bias included;
- ``SPLIT=True, SUM_SPLITS=False``: it writes its fp32 partial sum at ``part[split]`` and adds
  no bias; the wrapper sums the splits with torch;
- ``SPLIT=True, SUM_SPLITS=True``: it writes its partial, then takes a ticket from its tile's
  arrival counter. The program that arrives last sums the ``SPLITS`` partials in split order
  (from zero, ``0 + part[0] + part[1] + ...``, four loads in flight: the result does not
  depend on which program arrives last), adds the bias, writes y and sets the counter back to 0, so the counters are
  zero between launches (replayable in a CUDA graph; ``arrivals.py``). Ordering: a CTA barrier puts every
  thread's partial store before the ticket's acq_rel atomic (the release), the last arriver's
  atomic (the acquire) and the barrier Triton places after a scalar atomic put its loads of
  the others' partials after it, and those loads bypass L1 (``.cg``).

Two activation modes, chosen at compile time by ``A8``:
- W8A16 (``A8=False``): the e4m3 weight tile is widened to ``DOT_DTYPE`` (x's dtype on a GPU,
  exact: e4m3 fits bf16 and fp16), multiplied with x with fp32 accumulation, and the block's
  partial sum scaled by the weight's block scale. The interpreter's bf16/fp16 ``tl.dot`` is
  wrong, so there ``DOT_DTYPE`` is fp32: the same numbers, since a product of two bf16 (or
  fp16, or e4m3) values is exact in fp32.
- W8A8 (``A8=True``): each [BLOCK_M, 128] tile of x is quantized per row (one 1x128 group:
  scale = amax / 448, amax at least 1e-4, as DeepSeek's ``act_quant``), FP8 x FP8 products are
  accumulated in fp32, and the partial sum is scaled by x_scale * w_scale. Every program
  quantizes the x tiles it reads (the same values each time); no x_fp8 is written.

``K_STEP`` does not change the arithmetic: the blocks are added to the accumulator one by one
in K order either way.

A Triton kernel takes every pointer, stride and size as a flat argument: this file is exempt
from the project's argument-count rule (``pyproject.toml``), and holds only the kernel and the
device functions it inlines."""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.ops.cast_bits import round_to
from services.worker.ops.fp8_bits import round_to_e4m3

FP8_MAX = tl.constexpr(448.0)
AMAX_MIN = tl.constexpr(1e-4)


@triton.jit
def _add_scaled_block(
    acc, kb, kb_end, k_limit,
    x_ptr, stride_xm, stride_xk,
    w_ptr, stride_wn, stride_wk,
    w_scale_row, stride_wsk,
    offs_m, offs_n, mask_m, mask_n,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    A8: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """``acc`` plus K block ``kb``'s scaled product. Columns from ``k_limit`` on read as zero
    (a block at or past ``kb_end``, the split's end, reads nothing); the scale address stays
    within the split's blocks (its value is unused past them)."""
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = k < k_limit
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_K]
    w = tl.load(
        w_ptr + k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
        mask=mask_k[:, None] & mask_n[None, :],
        other=0.0,
    )  # [BLOCK_K, BLOCK_N] e4m3, W^T's tile
    # BLOCK_K is the scale block: K block kb has the weight scales of column kb.
    w_scale = tl.load(w_scale_row + tl.minimum(kb, kb_end - 1) * stride_wsk, mask=mask_n, other=0.0)
    if A8:
        xf = x.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xf), axis=1), AMAX_MIN)  # [BLOCK_M]
        x_scale = tl.math.div_rn(amax, tl.full([BLOCK_M], FP8_MAX, tl.float32))
        xq = tl.math.div_rn(xf, x_scale[:, None])
        xq = round_to_e4m3(tl.clamp(xq, -FP8_MAX, FP8_MAX)).to(tl.float8e4nv)
        part = tl.dot(xq, w, out_dtype=tl.float32)
        return acc + part * (x_scale[:, None] * w_scale[None, :])
    # Through fp32: exact, and the interpreter's direct e4m3 -> bf16 cast is wrong.
    w = w.to(tl.float32).to(DOT_DTYPE)
    part = tl.dot(x.to(DOT_DTYPE), w, input_precision=PREC, out_dtype=tl.float32)
    return acc + part * w_scale[None, :]


@triton.jit
def _split_partial(part_tile, s, SPLITS, stride_ps, mask):
    """Split ``s``'s fp32 partial tile, read past L1 (other programs wrote it); zeros for an
    ``s`` past the last split (read at the last one's address). Adding those zeros leaves the
    sum's bits: a sum started at +0.0 is never -0.0, and x + 0.0 is x for every other x."""
    p = tl.load(
        part_tile + tl.minimum(s, SPLITS - 1) * stride_ps, mask=mask, other=0.0,
        cache_modifier=".cg",
    )  # fmt: skip
    return tl.where(s < SPLITS, p, 0.0)


@triton.jit
def _store_y(acc, bias_ptr, y_ptr, stride_ym, stride_yn, offs_m, offs_n, mask_m, mask_n,
             HAS_BIAS: tl.constexpr):  # fmt: skip
    """Writes ``acc (+ bias)`` in y's dtype, rounded as torch rounds (``round_to``: the same bits
    under the interpreter); the bias is added in fp32 before the cast."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        round_to(acc, y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def fp8_linear_kernel(
    x_ptr, stride_xm, stride_xk,
    w_ptr, stride_wn, stride_wk,
    w_scale_ptr, stride_wsn, stride_wsk,
    bias_ptr,
    y_ptr, stride_ym, stride_yn,
    part_ptr, stride_ps, stride_pm, stride_pn,
    counter_ptr,
    M, N, K, KB_PER_SPLIT, SPLITS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEP: tl.constexpr,
    SPLIT: tl.constexpr, SUM_SPLITS: tl.constexpr,
    A8: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)  # split-K: this program's K blocks, its partial sum at part[pid_s]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    w_scale_row = w_scale_ptr + (offs_n // BLOCK_K) * stride_wsn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    kb_end = tl.minimum((pid_s + 1) * KB_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    k_limit = tl.minimum(K, kb_end * BLOCK_K)  # the split's last column + 1
    for kb in range(pid_s * KB_PER_SPLIT, kb_end, K_STEP):
        acc = _add_scaled_block(
            acc, kb, kb_end, k_limit, x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk,
            w_scale_row, stride_wsk, offs_m, offs_n, mask_m, mask_n,
            BLOCK_M, BLOCK_K, A8, DOT_DTYPE, PREC,
        )  # fmt: skip
        if K_STEP == 2:
            added = _add_scaled_block(
                acc, kb + 1, kb_end, k_limit, x_ptr, stride_xm, stride_xk, w_ptr, stride_wn,
                stride_wk, w_scale_row, stride_wsk, offs_m, offs_n, mask_m, mask_n,
                BLOCK_M, BLOCK_K, A8, DOT_DTYPE, PREC,
            )  # fmt: skip
            # A selection, not an add of zeros: a missing block leaves acc bit for bit.
            acc = tl.where(kb + 1 < kb_end, added, acc)
    if SPLIT:
        mask = mask_m[:, None] & mask_n[None, :]
        part_tile = part_ptr + offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn
        tl.store(part_tile + pid_s * stride_ps, acc, mask=mask)
        if SUM_SPLITS:
            tl.debug_barrier()  # every thread's partial store precedes the ticket (release)
            counter = counter_ptr + pid_m * tl.num_programs(1) + pid_n
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLITS - 1:
                # Four partials in flight per step, added one by one in split order.
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(0, SPLITS, 4):
                    p0 = _split_partial(part_tile, s, SPLITS, stride_ps, mask)
                    p1 = _split_partial(part_tile, s + 1, SPLITS, stride_ps, mask)
                    p2 = _split_partial(part_tile, s + 2, SPLITS, stride_ps, mask)
                    p3 = _split_partial(part_tile, s + 3, SPLITS, stride_ps, mask)
                    total += p0
                    total += p1
                    total += p2
                    total += p3
                _store_y(total, bias_ptr, y_ptr, stride_ym, stride_yn, offs_m, offs_n,
                         mask_m, mask_n, HAS_BIAS)  # fmt: skip
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        _store_y(acc, bias_ptr, y_ptr, stride_ym, stride_yn, offs_m, offs_n, mask_m, mask_n,
                 HAS_BIAS)  # fmt: skip
