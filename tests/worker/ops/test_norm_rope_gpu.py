"""The norm and RoPE kernels on the GPU (all @gpu): each kernel at the released models' shapes
against its torch form, with ``norm_rope_cases``' bounds (RoPE exactly: the launch turns fp
fusion off); the model's functions (MLA's stored row and queries, the indexer's keys and
queries, the residual joins) fused against ``unfused_kernels()``; and a whole slice of each
family served both ways with the unfused pass's discrete choices injected into the fused one.

Through a model a norm's one-ulp differences pass through GEMMs, so there the bound is a
relative one: ``|fused - unfused| / |unfused|`` (Frobenius) below 2**-6 for one function, and
the slice's logits below 2e-2 (bf16 noise over four layers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dhisparse.family.hf_config import parse_config
from services.worker.model.layers import RMSNorm
from services.worker.model.mla_attention import MLA
from services.worker.model.mla_indexer import DSAIndexer
from services.worker.model.rotary import Rotary
from services.worker.ops.fusion import kernel_fusion, unfused_kernels
from services.worker.ops.norm_rope import (
    index_key_ref,
    index_key_triton,
    mla_row_ref,
    mla_row_triton,
)
from services.worker.ops.rms_norm import add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from services.worker.ops.rope import rope_ref, rope_triton
from services.worker.weights.model_io import load_model
from tests import hf_tiny
from tests.worker.model import hf_slice
from tests.worker.ops.norm_rope_cases import (
    POSITIONS,
    SPECS,
    assert_within,
    layer_norm_scale,
    norm_bound,
)


@pytest.fixture(autouse=True)
def _fused_kernels():
    """Fusion on (the engine's ``--fused-kernels``): each test's unfused side opts out."""
    with kernel_fusion():
        yield


pytestmark = pytest.mark.gpu

SLICES = {"deepseek_v32": hf_slice.v32_slice, "glm_moe_dsa": hf_slice.glm_slice}
BF16 = torch.bfloat16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _positions(n: int) -> torch.Tensor:
    return torch.tensor([POSITIONS[i % len(POSITIONS)] for i in range(n)], device="cuda")


@pytest.mark.parametrize("n", [1, 16, 128])
def test_kernels_at_real_shapes(n: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda").to(BF16)

    for d in (7168, 6144, 2048, 1536, 512):
        x, r, w = randn(n, d), randn(n, d), 1 + 0.2 * randn(d)
        ref = rms_norm_ref(x, w, 1e-6)
        assert_within(rms_norm_triton(x, w, 1e-6), ref, norm_bound(ref, ref.abs(), d), f"{d}")
        normed, summed = add_rms_norm_triton(x, r, w, 1e-6)
        assert torch.equal(summed, r + x), f"the sum of rows of {d}"
        ref = rms_norm_ref(r + x, w, 1e-6)
        assert_within(normed, ref, norm_bound(ref, ref.abs(), d), f"add {d}")
    for family, spec in SPECS.items():
        cos, sin = Rotary(_positions(n), spec).tables(64)
        for interleaved in (False, True):
            q = randn(n, 128, 192)  # MLA's q: rope the last 64 of each head
            out = torch.empty(n, 128, 576, dtype=BF16, device="cuda")
            rope_triton(q[..., 128:], cos, sin, interleaved, out=out[..., 512:])
            assert torch.equal(out[..., 512:], rope_ref(q[..., 128:], cos, sin, interleaved))
            iq = randn(n, 64, 128)  # the indexer's q: rope the first 64, keep the rest
            want = rope_ref(iq, cos, sin, interleaved)
            assert torch.equal(rope_triton(iq, cos, sin, interleaved), want), family
            k, w, b = randn(n, 128), 1 + 0.2 * randn(128), 0.1 * randn(128)
            ref = index_key_ref(k, w, b, 1e-6, cos, sin, interleaved)
            y = index_key_triton(k, w, b, 1e-6, cos, sin, interleaved)
            assert _rel(y, ref) < 2.0**-7, f"{family} index key"
            rest = norm_bound(ref, layer_norm_scale(k, w, b, 1e-6), 128)[:, 64:]
            assert_within(y[:, 64:], ref[:, 64:], rest, f"{family} index key")
        kv, w = randn(n, 576), 1 + 0.2 * randn(512)
        ref = mla_row_ref(kv, w, 1e-6, cos, sin)
        y = mla_row_triton(kv, w, 1e-6, cos, sin)
        assert torch.equal(y[:, 512:], ref[:, 512:]), f"{family} stored row's rope"
        assert_within(
            y[:, :512], ref[:, :512], norm_bound(ref[:, :512], ref[:, :512].abs(), 512), family
        )


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:  # norm weights and the LayerNorm's bias off their init values
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return module.to("cuda", BF16).eval()


@pytest.mark.parametrize("family", sorted(SLICES))
def test_model_functions_fused_match_unfused(family: str) -> None:
    cfg = parse_config(SLICES[family]().to_dict())
    mla, indexer = _perturbed(MLA(cfg), 1), _perturbed(DSAIndexer(cfg), 2)
    norm = _perturbed(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), 3)
    indexer.weights_proj.float()
    n = 24
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(n, cfg.hidden_size, generator=g, device="cuda").to(BF16)
    a = torch.randn(n, cfg.hidden_size, generator=g, device="cuda").to(BF16)
    rotary = Rotary(_positions(n), cfg.rope)

    def run() -> list[torch.Tensor]:
        q, q_latent = mla.queries(x, rotary)
        iq, iw = indexer.queries(x, q_latent, rotary)
        normed, summed = norm.add_norm(a, x)
        rows = mla.token_rows(x, rotary)
        return [rows, q, q_latent, indexer.keys(x, rows, rotary), iq, iw, normed, summed]

    with torch.no_grad():
        fused = run()
        with unfused_kernels():
            plain = run()
    names = ["rows", "q", "q_latent", "keys", "index q", "index w", "normed", "summed"]
    for name, f, p in zip(names, fused, plain, strict=True):
        assert f.dtype == p.dtype and f.shape == p.shape, name
        assert _rel(f, p) < 2.0**-6, f"{family} {name}: {_rel(f, p):.3g}"
    assert torch.equal(fused[0][:, cfg.kv_lora_rank :], plain[0][:, cfg.kv_lora_rank :])
    assert torch.equal(fused[-1], plain[-1])  # the residual sum


@pytest.mark.parametrize("family", sorted(SLICES))
def test_a_slice_served_fused_matches_unfused(family: str, tmp_path: Path) -> None:
    ref = hf_slice.build_on(SLICES[family](small=True), "cpu", BF16, seed=5)
    hf_tiny.save_hub_style(ref, tmp_path)
    ours = load_model(tmp_path, device="cuda", dtype=BF16)
    ids = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(6))
    with unfused_kernels():
        plain = hf_slice.run_ours(ours, ids, chunk=32)
    fused = hf_slice.run_ours(ours, ids, 32, plain.selections, plain.experts)
    assert _rel(fused.logits, plain.logits) < 2e-2


def test_a_pass_that_records_gradients_runs_the_torch_form() -> None:
    norm = RMSNorm(512, 1e-6).to("cuda")
    x = torch.randn(3, 512, device="cuda", requires_grad=True)
    norm(x).sum().backward()  # the torch form: the gradient reaches x and the weight
    assert x.grad is not None and norm.weight.grad is not None


def test_every_kernel_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed on new inputs copied into the captured ones: the same outputs as
    eager calls (no host sync, no data-dependent allocation or grid)."""
    g = torch.Generator(device="cuda").manual_seed(8)
    n = 16
    x, r, kv, k = (torch.empty(n, d, dtype=BF16, device="cuda") for d in (7168, 7168, 576, 128))
    w, w_lat, w_k, b_k = (
        1 + 0.2 * torch.randn(d, generator=g, device="cuda") for d in (7168, 512, 128, 128)
    )
    cos, sin = Rotary(_positions(n), SPECS["v32"]).tables(64)

    def step() -> list[torch.Tensor]:
        return [
            rms_norm_triton(x, w, 1e-6), *add_rms_norm_triton(x, r, w, 1e-6),
            mla_row_triton(kv, w_lat, 1e-6, cos, sin),
            index_key_triton(k, w_k, b_k, 1e-6, cos, sin, False),
            rope_triton(k, cos, sin, True),
        ]  # fmt: skip

    for t in (x, r, kv, k):
        t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in (x, r, kv, k):
        t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
    graph.replay()
    for got, want in zip(captured, step(), strict=True):
        assert torch.equal(got, want)
