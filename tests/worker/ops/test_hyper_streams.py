"""DeepSeek-V4's hyper-connection streams collapsed and merged by one kernel each
(``ops/hyper_streams_triton.py``) against their torch forms (``v4_hyper.collapse`` and
``hyper_merge`` outside fusion): under the Triton interpreter on the CPU and on the GPU
(``gpu``), over random streams, weights off their initial values, hc_mult 4 (the releases')
and 3 (masked lanes), widths that end inside a block, fp32 and bf16 streams (bf16: the torch
form's roundings made at the same points, so at most a bf16 ulp apart where fp32 sums of four
values are ordered differently)."""

from __future__ import annotations

import pytest
import torch

from services.worker.model.v4_hyper import collapse, hyper_merge
from services.worker.ops.fusion import kernel_fusion
from services.worker.ops.hyper_streams_triton import hyper_collapse_triton, hyper_merge_triton


def _inputs(n: int, h: int, d: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(n, h, d, generator=g).to(dtype)
    out = (torch.randn(n, d, generator=g) * 2).to(dtype)
    pre = torch.rand(n, h, generator=g) + 0.1
    post = 2 * torch.rand(n, h, generator=g)
    comb = torch.rand(n, h, h, generator=g)
    comb = comb / comb.sum(dim=-2, keepdim=True)
    return [t.to(device) for t in (streams, out, pre, post, comb)]


def _references(streams, out, pre, post, comb):
    with kernel_fusion(False):
        return collapse(streams, pre), hyper_merge(streams, out, post, comb)


def _assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    # bf16: equal but where an fp32 sum's last bit moved a rounding (one bf16 ulp)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    assert got.numel() == 0 or (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "h", "d"), [(3, 4, 300), (2, 3, 256), (1, 4, 64), (0, 4, 64)])
def test_the_kernels_give_the_torch_forms(n: int, h: int, d: int, dtype: torch.dtype) -> None:
    streams, out, pre, post, comb = _inputs(n, h, d, dtype, seed=n + 10 * h + d)
    want_collapsed, want_merged = _references(streams, out, pre, post, comb)
    _assert_near(hyper_collapse_triton(streams, pre), want_collapsed)
    _assert_near(hyper_merge_triton(streams, out, post, comb), want_merged)


def test_bad_shapes_are_refused() -> None:
    streams, out, pre, post, comb = _inputs(2, 4, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"does not start \[N, H\]"):
        hyper_collapse_triton(streams, pre[:, :3])
    with pytest.raises(ValueError, match=r"comb \(2, 3, 3\) is not \[2, 4, 4\]"):
        hyper_merge_triton(streams, out, post, comb[:, :3, :3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_the_gpu_the_kernels_give_the_torch_forms(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    streams, out, pre, post, comb = _inputs(64, 4, 4096, dtype, seed=7, device="cuda")
    want_collapsed, want_merged = _references(streams, out, pre, post, comb)
    with kernel_fusion(True):
        got_collapsed = collapse(streams, pre)
        got_merged = hyper_merge(streams, out, post, comb)
    _assert_near(got_collapsed, want_collapsed)
    _assert_near(got_merged, want_merged)
