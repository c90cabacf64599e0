"""DeepSeek-V4's hyper-connection weights as one kernel (``ops/hyper_mix_triton.py``) against
their torch reference (``v4_hyper.hyper_weights_ref``): under the Triton interpreter on the
CPU, and on the GPU (``gpu``), over random logits, bases and scales off their initial values,
hc_mult 4 (the releases') and 3 (masked lanes), Sinkhorn's 20 iterations and one; a whole V4
block through ``hyper_mix`` fused and unfused on the GPU."""

from __future__ import annotations

import pytest
import torch

from services.worker.model.v4_hyper import hyper_mix, hyper_weights_ref
from services.worker.ops.fusion import kernel_fusion
from services.worker.ops.hyper_mix_triton import hyper_weights_triton

EPS = 1e-6


def _inputs(n: int, h: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    width = (2 + h) * h
    logits = torch.randn(n, width, generator=g) * 3
    base = torch.randn(width, generator=g) * 0.5
    scale = 1 + 0.3 * torch.randn(3, generator=g)
    return logits.to(device), base.to(device), scale.to(device)


@pytest.mark.parametrize(("n", "h", "iters"), [(5, 4, 20), (3, 3, 20), (1, 4, 1), (0, 4, 20)])
def test_the_kernel_gives_the_references_weights(n: int, h: int, iters: int) -> None:
    logits, base, scale = _inputs(n, h, seed=n + 10 * h + iters)
    got = hyper_weights_triton(logits, base, scale, h, iters, EPS)
    want = hyper_weights_ref(logits, base, scale, h, iters, EPS)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.reshape(g.shape).shape
        torch.testing.assert_close(g, w.reshape(g.shape), rtol=2e-6, atol=1e-7)
    if n:
        comb = got[2]
        # doubly stochastic after Sinkhorn: columns sum to 1 (the last normalisation)
        torch.testing.assert_close(comb.sum(dim=-2), torch.ones(n, h), rtol=1e-5, atol=1e-5)
        assert (got[1] > 0).all() and (got[1] < 2).all()


def test_bad_shapes_are_refused() -> None:
    logits, base, scale = _inputs(2, 4, seed=1)
    with pytest.raises(ValueError, match=r"not \[N, \(2 \+ 3\)"):
        hyper_weights_triton(logits, base, scale, 3, 20, EPS)


@pytest.mark.gpu
def test_on_the_gpu_fused_and_unfused_mixes_agree() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    h, d, n = 4, 4096, 64
    logits, base, scale = _inputs(n, h, seed=3, device="cuda")
    got = hyper_weights_triton(logits, base, scale, h, 20, EPS)
    want = hyper_weights_ref(logits, base, scale, h, 20, EPS)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.reshape(g.shape), rtol=2e-6, atol=1e-7)
    gen = torch.Generator(device="cuda").manual_seed(4)
    streams = torch.randn(n, h, d, generator=gen, device="cuda").to(torch.bfloat16)
    fn = torch.randn((2 + h) * h, h * d, generator=gen, device="cuda") / (h * d) ** 0.5
    with kernel_fusion(True):
        fused_out = hyper_mix(streams, fn, base, scale, 20, EPS, 1e-6)
    with kernel_fusion(False):
        plain = hyper_mix(streams, fn, base, scale, 20, EPS, 1e-6)
    for f, p in zip(fused_out, plain, strict=True):
        torch.testing.assert_close(f.float(), p.float(), rtol=1e-2, atol=1e-2)
