"""The FP8 block-scaled matmul against its torch references (interpreter on the CPU; @gpu on
the device at real DeepSeek-V3.2 shapes), and FP8Linear built from a checkpoint's pair.

Tolerance (CPU, and W8A16 on the GPU): kernel and reference multiply the same numbers (for
W8A8 the kernel quantizes x bit for bit as ``act_quant_ref``: checked directly and by the bound
being far below one e4m3 step), so they differ only in the order of the fp32 sums and where
the block scales are multiplied in. A sum of K products in fp32 is off by at most about
``K * u * sum|x||w|`` (u = 2**-24), plus a few u per product for the scale multiplies; the bound
used is ``(K + 16) * 2**-23 * (|x| @ |W|^T)`` elementwise, twice that. A bf16 output adds one
bf16 ulp (``2**-7 * |y|``): the two fp32 results may round to neighbouring bf16 values."""

from __future__ import annotations

import json

import pytest
import torch
import triton
import triton.language as tl
from safetensors.torch import save_file
from torch import nn

from services.worker.model.fp8_linear_layer import FP8Linear
from services.worker.ops.fp8_bits import round_to_e4m3
from services.worker.ops.fp8_blockwise import (
    FP8_DTYPE,
    quantize_blockwise,
    scale_to_float,
)
from services.worker.ops.fp8_linear import (
    act_dequant_ref,
    act_quant_ref,
    fp8_linear_ref,
    fp8_linear_triton,
)
from tests.worker.ops.fp8_linear_cases import EPS32, assert_within, bound, make_case

SHAPES = [(m, n, k) for m in (1, 3, 17, 64) for n in (128, 200, 384) for k in (128, 300, 512)]


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("scale_dtype", ["F32", "F8_E8M0"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(mode, scale_dtype, x_dtype) -> None:
    # A third of the (M, N, K) grid per case, each shape with its own seed, so that the eight
    # cases cover every shape in every mode (interpreted programs are slow); some with a bias.
    offset = len(mode) + len(scale_dtype) + (x_dtype == torch.bfloat16)
    for i, (m, n, k) in enumerate(SHAPES):
        if (i + offset) % 3:
            continue
        seed = 1000 * i + offset
        x, w_fp8, scale, bias = make_case(seed, m, n, k, scale_dtype, x_dtype)
        b = bias if i % 2 == 0 else None
        y = fp8_linear_triton(x, w_fp8, scale, b, mode)
        y_ref = fp8_linear_ref(x, w_fp8, scale, b, mode)
        assert y.dtype == x_dtype and y.shape == (m, n)
        assert_within(y, y_ref, bound(x, w_fp8, scale, mode, y_ref, (k + 16) * EPS32))


def test_split_k_sums_the_splits_in_order() -> None:
    """Split-K (the decode path for long K on a GPU) under the interpreter: 2 and 3 splits of
    4 K blocks (one split shorter), with and without a bias, equal the reference as closely as
    one split does."""
    from services.worker.ops.fp8_linear_splits import k_splits

    assert k_splits(9, 56, interpret=False) == 30 and k_splits(300, 56, interpret=False) == 1
    assert k_splits(9, 3, interpret=False) == 3 and k_splits(9, 56, interpret=True) == 1
    x, w_fp8, scale, bias = make_case(77, 5, 72, 500, "F32", torch.float32)
    for splits, b in ((2, bias), (3, None)):
        for mode in ("w8a16", "w8a8"):
            y = fp8_linear_triton(x, w_fp8, scale, b, mode, splits=splits)
            y_ref = fp8_linear_ref(x, w_fp8, scale, b, mode)
            assert_within(y, y_ref, bound(x, w_fp8, scale, mode, y_ref, 516 * EPS32))


def test_leading_dims_strides_and_raw_e8m0_scale() -> None:
    """x [3, 4, K] and a non-contiguous x; the scale grid as stored (float8_e8m0fnu), which the
    wrapper widens to fp32 itself."""
    g = torch.Generator().manual_seed(5)
    w_fp8, raw = quantize_blockwise(torch.randn(200, 300, generator=g), (128, 128), "F8_E8M0")
    assert raw.dtype == torch.float8_e8m0fnu
    scale, bias = scale_to_float(raw), torch.randn(200, generator=g)
    x3 = torch.randn(3, 4, 300, generator=g)
    xt = torch.randn(300, 12, generator=g).T
    for mode in ("w8a16", "w8a8"):
        y = fp8_linear_triton(x3, w_fp8, raw, bias, mode)
        y_ref = fp8_linear_ref(x3, w_fp8, scale, bias, mode)
        assert y.shape == (3, 4, 200)
        assert_within(y, y_ref, bound(x3, w_fp8, scale, mode, y_ref, 316 * EPS32))
        yt = fp8_linear_triton(xt, w_fp8, raw, None, mode)
        yt_ref = fp8_linear_ref(xt, w_fp8, raw, None, mode)
        assert_within(yt, yt_ref, bound(xt, w_fp8, scale, mode, yt_ref, 316 * EPS32))


@triton.jit
def _round_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, round_to_e4m3(v).to(tl.float8e4nv), mask=mask)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kernel_rounds_to_e4m3_as_torch_casts(device) -> None:
    """The kernel's rounding equals torch's round-to-nearest-even cast on every e4m3 value,
    every midpoint between neighbours (ties), and values just beside them, over [-448, 448]."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()  # sorted, 0 .. 448
    mid = (grid[1:] + grid[:-1]) / 2
    nudge = torch.cat([mid * (1 - 2**-20), mid * (1 + 2**-20), grid * (1 - 2**-20)])
    g = torch.Generator().manual_seed(0)
    rand = torch.rand(4000, generator=g) * torch.exp2(torch.randint(-12, 9, (4000,), generator=g))
    v = torch.cat([grid, mid, nudge, rand]).clamp(max=448.0)
    v = torch.cat([v, -v]).to(device)
    out = torch.empty_like(v, dtype=FP8_DTYPE)
    _round_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    assert torch.equal(out.float(), v.to(FP8_DTYPE).float())


def test_act_quant_ref_groups() -> None:
    """Per (row, group of 128): the scale is amax / 448, the group's largest value maps to
    +-448, and dequantization is within half an e4m3 step (2**-4 relative, or 2**-10 * scale
    in the subnormal range)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, generator=g) * torch.exp(3 * torch.randn(5, 1, generator=g))
    x_fp8, s = act_quant_ref(x)
    assert x_fp8.dtype == FP8_DTYPE and s.shape == (5, 3)
    for j, (a, b) in enumerate([(0, 128), (128, 256), (256, 300)]):
        amax = x[:, a:b].abs().amax(dim=1)
        torch.testing.assert_close(s[:, j], amax / 448, rtol=0, atol=0)
        assert (x_fp8[:, a:b].float().abs().amax(dim=1) == 448).all()
    err = (act_dequant_ref(x_fp8, s) - x).abs()
    per_col = s.repeat_interleave(128, 1)[:, :300]
    assert (err <= torch.maximum(x.abs() * 2**-4, per_col * 2**-10) * (1 + 1e-6)).all()


def test_w8a8_error_against_w8a16(capsys) -> None:
    """Reports W8A8's error relative to W8A16 on the same data (both Triton kernels):
    the cost of quantizing activations, on top of the weight's own quantization."""
    lines = []
    for seed, (m, n, k) in enumerate([(17, 384, 512), (64, 200, 300)]):
        x, w_fp8, scale, _ = make_case(seed, m, n, k, "F32", torch.float32)
        y16 = fp8_linear_triton(x, w_fp8, scale, None, "w8a16")
        y8 = fp8_linear_triton(x, w_fp8, scale, None, "w8a8")
        rel_fro = ((y8 - y16).norm() / y16.norm()).item()
        rel_max = ((y8 - y16).abs().max() / y16.abs().max()).item()
        lines.append(f"  M={m} N={n} K={k}: rel. Frobenius {rel_fro:.2e}, max/max {rel_max:.2e}")
        assert rel_fro < 0.05  # e4m3 rounds to 2**-4 relative at worst; errors mostly cancel
    with capsys.disabled():
        print("\nW8A8 vs W8A16 (fp32 x, F32 scales):\n" + "\n".join(lines))


@pytest.mark.parametrize("scale_dtype", ["F32", "F8_E8M0"])
def test_fp8_linear_from_checkpoint_matches_nn_linear(tmp_path, scale_dtype) -> None:
    """A pair written by write_fp8_checkpoint, read back by Checkpoint.get_fp8, in FP8Linear:
    equal to nn.Linear on the dequantized weight; the CPU forward is fp8_linear_ref itself."""
    from services.worker.weights.checkpoint import Checkpoint
    from services.worker.weights.fp8_writer import write_fp8_checkpoint

    name = "model.layers.0.mlp.down_proj.weight"
    g = torch.Generator().manual_seed(11)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    save_file({name: torch.randn(200, 300, generator=g) * 0.05}, str(src / "model.safetensors"))
    write_fp8_checkpoint(src, dst, block=(128, 128), scale_dtype=scale_dtype)
    quant = json.loads((dst / "config.json").read_text())["quantization_config"]
    with Checkpoint(dst, quant) as ckpt:
        w_fp8, scale = ckpt.get_fp8(name)
        w_deq = ckpt.get(name, torch.float32)
    assert w_fp8.dtype == FP8_DTYPE and scale.shape == (2, 3)
    if scale_dtype == "F8_E8M0":
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two

    linear = nn.Linear(300, 200, bias=False)
    linear.weight.data.copy_(w_deq)
    x = torch.randn(7, 300, generator=g)
    fp8 = FP8Linear.from_checkpoint(w_fp8, scale)
    assert fp8.weight.dtype == FP8_DTYPE and fp8.weight_scale_inv.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(fp8(x), linear(x))
        assert torch.equal(fp8(x), fp8_linear_ref(x, w_fp8, scale))
        fp8.mode = "w8a8"
        assert torch.equal(fp8(x), fp8_linear_ref(x, w_fp8, scale, mode="w8a8"))
        bias = torch.randn(200, generator=g)
        linear.bias = nn.Parameter(bias)
        with_bias = FP8Linear.from_checkpoint(w_fp8, scale, bias)
        torch.testing.assert_close(with_bias(x), linear(x))


def test_contract_errors() -> None:
    x, w_fp8, scale, _ = make_case(0, 3, 200, 300, "F32", torch.float32)
    with pytest.raises(ValueError, match="mode"):
        fp8_linear_triton(x, w_fp8, scale, mode="w4a16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grid"):
        fp8_linear_triton(x, w_fp8, scale[:, :2])
    with pytest.raises(ValueError, match="K disagrees"):
        fp8_linear_ref(x[:, :299], w_fp8, scale)
    with pytest.raises(ValueError, match="weight must be"):
        fp8_linear_ref(x, w_fp8.float(), scale)
    with pytest.raises(ValueError, match="grid"):
        FP8Linear.from_checkpoint(w_fp8, scale.T)
