"""The norm and RoPE kernels under the interpreter against their torch forms, on fresh random
inputs (perturbed norm weights and biases), several shapes, every dtype, both RoPE layouts and
the families' tables (V3.2's YaRN, GLM's theta 8e6) at positions up to 1M.

Exact where the math is: the residual add and every RoPE (the same fp32 products and sums, one
rounding to the output's dtype). A norm's output is within ``norm_rope_cases``' bound: one ulp
of its dtype plus the fp32 reassociation of its sums."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from services.worker.model.layers import RMSNorm
from services.worker.model.rotary import apply_rope
from services.worker.ops.norm_rope import (
    index_key_ref,
    index_key_triton,
    mla_row_ref,
    mla_row_triton,
)
from services.worker.ops.rms_norm import (
    add_rms_norm_ref,
    add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from services.worker.ops.rope import rope_ref, rope_triton
from tests.worker.ops.norm_rope_cases import (
    DTYPES,
    SPECS,
    assert_within,
    layer_norm_scale,
    norm_bound,
    norm_weight,
    randn,
    rotary,
    tiny,
    ulp_rel,
)

# (leading shape, D): the real rows (hidden 6144 / 7168, lora ranks 512 / 1536 / 2048), a
# ragged one, a leading shape of two dims
NORM_SHAPES = [((3,), 7168), ((2,), 6144), ((5,), 512), ((1,), 1536), ((2, 3), 2048), ((4,), 300)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(dtype) -> None:
    for i, (lead, d) in enumerate(NORM_SHAPES):
        g = torch.Generator().manual_seed(100 * i + len(str(dtype)))
        x = randn((*lead, d), g, scale=3.0).to(dtype)
        w = norm_weight(d, g).to(dtype)
        ref = rms_norm_ref(x, w, 1e-6)
        module = RMSNorm(d, 1e-6)  # its torch form on the CPU is the reference
        module.weight.data.copy_(w)
        assert torch.equal(ref, module(x))
        y = rms_norm_triton(x, w, 1e-6)
        assert_within(y, ref, norm_bound(ref, ref.abs(), d), f"{dtype} {lead} {d}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_unweighted_rms_norm_matches_torch(dtype) -> None:
    """DeepSeek-V4's ``rms_normalise`` (no weight): the kernel against its torch form, which is
    the line the model runs unfused."""
    # V4's flattened hyper-connection streams too (Flash 4 x 4096, Pro 4 x 7168)
    for i, (lead, d) in enumerate([*NORM_SHAPES, ((2,), 16384), ((1,), 28672)]):
        g = torch.Generator().manual_seed(300 * i + len(str(dtype)))
        x = randn((*lead, d), g, scale=3.0).to(dtype)
        ref = rms_norm_ref(x, None, 1e-6)
        xf = x.float()
        assert torch.equal(
            ref, (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        )
        y = rms_norm_triton(x, None, 1e-6)
        assert_within(y, ref, norm_bound(ref, ref.abs(), d), f"{dtype} {lead} {d} unweighted")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_sums_exactly_and_norms_within_the_bound(dtype) -> None:
    for i, (lead, d) in enumerate(NORM_SHAPES):
        g = torch.Generator().manual_seed(200 * i + len(str(dtype)))
        h = randn((*lead, d), g, scale=4.0).to(dtype)
        a = randn((*lead, d), g, scale=0.5).to(dtype)
        w = norm_weight(d, g).to(dtype)
        normed, summed = add_rms_norm_triton(a, h, w, 1e-5)
        ref_normed, ref_summed = add_rms_norm_ref(a, h, w, 1e-5)
        assert torch.equal(summed, h + a), f"{dtype} {lead} {d}: the sum is not torch's"
        assert torch.equal(ref_summed, h + a)
        what = f"{dtype} {lead} {d}"
        assert_within(normed, ref_normed, norm_bound(ref_normed, ref_normed.abs(), d), what)


def test_norms_take_strided_rows_and_weights_of_another_dtype() -> None:
    g = torch.Generator().manual_seed(9)
    big = randn((6, 700), g).to(torch.bfloat16)
    x, r = big[:, :512], big[:, 100:612]  # rows of stride 700
    w = norm_weight(512, g)  # fp32 weight, bf16 rows
    ref = rms_norm_ref(x, w, 1e-6)
    assert_within(rms_norm_triton(x, w, 1e-6), ref, norm_bound(ref, ref.abs(), 512), "strided")
    normed, summed = add_rms_norm_triton(x, r, w, 1e-6)
    assert torch.equal(summed, r + x)
    ref_n = rms_norm_ref(r + x, w, 1e-6)
    assert_within(normed, ref_n, norm_bound(ref_n, ref_n.abs(), 512), "strided add")
    assert rms_norm_triton(x[:0], w, 1e-6).shape == (0, 512)
    with pytest.raises(ValueError):
        add_rms_norm_triton(x, r.float(), w, 1e-6)
    with pytest.raises(ValueError):
        rms_norm_triton(randn((1, 32769), g), norm_weight(32769, g), 1e-6)  # past MAX_D


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_apply_rope_exactly(family, interleaved, dtype) -> None:
    """[N, d_rope], [N, H, D] with the rest copied, a column slice of q [N, H, 192] written into
    a column slice of a preallocated [N, H, 576]; d_rope 64 (released) and 16 (reduced)."""
    seed = len(family) + 2 * interleaved + len(str(dtype))
    g = torch.Generator().manual_seed(seed)
    for d_rope in (64, 16):
        for n in (1, 5, 11):
            rot = rotary(n, SPECS[family], seed + n)
            cos, sin = rot.tables(d_rope)
            x = randn((n, d_rope), g, 2.0).to(dtype)
            want = apply_rope(x, rot, interleaved=interleaved)
            assert torch.equal(rope_triton(x, cos, sin, interleaved), want)
            assert torch.equal(rope_ref(x, cos, sin, interleaved), want)
            heads = randn((n, 3, 2 * d_rope + 5), g, 2.0).to(dtype)
            want = torch.cat(
                [apply_rope(heads[..., :d_rope], rot, interleaved=interleaved),
                 heads[..., d_rope:]], -1,
            )  # fmt: skip
            assert torch.equal(rope_triton(heads, cos, sin, interleaved), want)
            assert torch.equal(rope_ref(heads, cos, sin, interleaved), want)
            q = randn((n, 4, 128 + d_rope), g, 2.0).to(dtype)
            out = torch.full((n, 4, 512 + d_rope), 7.0, dtype=dtype)
            rope_triton(q[..., 128:], cos, sin, interleaved, out=out[..., 512:])
            want = apply_rope(q[..., 128:], rot, interleaved=interleaved)
            assert torch.equal(out[..., 512:], want)
            assert bool((out[..., :512] == 7.0).all()), "wrote outside its columns"


def test_rope_rejects_tables_that_do_not_fit() -> None:
    g = torch.Generator().manual_seed(3)
    cos, sin = rotary(4, SPECS["glm"], 3).tables(64)
    with pytest.raises(ValueError):
        rope_triton(randn((4, 32), g), cos, sin, False)  # narrower than d_rope
    with pytest.raises(ValueError):
        rope_triton(randn((3, 64), g), cos, sin, False)  # another N
    with pytest.raises(ValueError):
        rope_triton(randn((4, 64), g), cos, sin, False, out=torch.empty(4, 65))


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_row_is_the_stored_row(family, dtype) -> None:
    """kv_a's output [N, 512 + 64] (released) and [N, 64 + 16] (reduced) -> the row the model's
    torch form stores: the RoPE part exactly, the norm within the bound."""
    seed = 7 * len(family) + len(str(dtype))
    g = torch.Generator().manual_seed(seed)
    for d_norm, d_rope in ((512, 64), (64, 16)):
        for n in (1, 6):
            rot = rotary(n, SPECS[family], seed + n)
            cos, sin = rot.tables(d_rope)
            kv = randn((n, d_norm + d_rope), g, 2.0).to(dtype)
            w = norm_weight(d_norm, g).to(dtype)
            ref = mla_row_ref(kv, w, 1e-6, cos, sin)
            latent, k_rope = kv.split([d_norm, d_rope], dim=-1)
            torch_form = torch.cat(  # MLA.token_rows' torch form
                [rms_norm_ref(latent, w, 1e-6), apply_rope(k_rope, rot, interleaved=True)], -1
            )
            assert torch.equal(ref, torch_form)
            y = mla_row_triton(kv, w, 1e-6, cos, sin)
            assert torch.equal(y[:, d_norm:], ref[:, d_norm:]), f"{dtype} rope"
            r = ref[:, :d_norm]
            assert_within(y[:, :d_norm], r, norm_bound(r, r.abs(), d_norm), f"{dtype} norm")


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_index_key_is_layer_norm_then_rope(family, interleaved, dtype) -> None:
    """wk's output [N, 128] (released) and [N, 32] (reduced), LayerNorm with a perturbed weight
    and bias, then RoPE of the first d_rope: the LayerNorm's elements within its bound; the
    rotated ones within that bound carried through the rotation (|cos|, |sin| <= the table's
    factor), plus the rounding of the rotation's output."""
    seed = 11 * len(family) + 3 * interleaved + len(str(dtype))
    g = torch.Generator().manual_seed(seed)
    for d, d_rope in ((128, 64), (32, 16)):
        for n in (1, 7):
            rot = rotary(n, SPECS[family], seed + n)
            cos, sin = rot.tables(d_rope)
            k = (randn((n, d), g, 2.0) + 0.5).to(dtype)
            w = norm_weight(d, g).to(dtype)
            b = (0.1 * torch.randn(d, generator=g)).to(dtype)
            ref = index_key_ref(k, w, b, 1e-6, cos, sin, interleaved)
            normed = F.layer_norm(k, (d,), w, b, 1e-6)
            torch_form = torch.cat(  # DSAIndexer.keys' torch form
                [apply_rope(normed[..., :d_rope], rot, interleaved=interleaved),
                 normed[..., d_rope:]], -1,
            )  # fmt: skip
            assert torch.equal(ref, torch_form)
            y = index_key_triton(k, w, b, 1e-6, cos, sin, interleaved)
            dn = norm_bound(normed, layer_norm_scale(k, w, b, 1e-6), d)  # [N, D]
            r, h = ref[:, d_rope:], d_rope // 2
            assert_within(y[:, d_rope:], r, dn[:, d_rope:], f"{dtype} rest")
            if interleaved:
                d1, d2 = dn[:, :d_rope:2], dn[:, 1:d_rope:2]
            else:
                d1, d2 = dn[:, :h], dn[:, h:d_rope]
            carried = torch.cat(
                [d1 * cos.abs() + d2 * sin.abs(), d2 * cos.abs() + d1 * sin.abs()], -1
            )
            rotated = ref[:, :d_rope].float()
            bound = carried + ulp_rel(dtype) * (2 * rotated.abs() + carried) + tiny(dtype)
            assert_within(y[:, :d_rope], ref[:, :d_rope], bound, f"{dtype} rotated")
