"""The model's fused paths under the interpreter: with ``fused`` forced on, MLA's stored row
and queries, the indexer's keys and queries, RMSNorm and its residual join run the Triton
kernels on CPU tensors, and give the torch forms' outputs at the reduced V3.2 (YaRN,
rotate-half indexer) and GLM (theta 8e6, interleaved indexer) dims in bf16: the residual sum and
the stored row's RoPE bit for bit; the rest, downstream of a norm (one bf16 ulp apart at most,
``test_norm_rope``), within 2**-8 relative (Frobenius), a bf16 ulp's worth through the GEMMs."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.hf_config import parse_config
from services.worker.model import layers, mla_attention, mla_indexer
from services.worker.model.layers import RMSNorm
from services.worker.model.mla_attention import MLA
from services.worker.model.mla_indexer import DSAIndexer
from services.worker.model.rotary import Rotary
from tests.worker.model import hf_slice

SLICES = {"deepseek_v32": hf_slice.v32_slice, "glm_moe_dsa": hf_slice.glm_slice}


def _outputs(cfg, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    mla, indexer = MLA(cfg).bfloat16(), DSAIndexer(cfg).bfloat16()
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).bfloat16()
    indexer.weights_proj.float()
    with torch.no_grad():
        for module in (mla, indexer, norm):
            for name, p in module.named_parameters():
                if "norm" in name:  # norm weights and the LayerNorm's bias off their init
                    p.add_(0.2 * torch.randn_like(p))
    n = 6
    x = torch.randn(n, cfg.hidden_size).bfloat16()
    a = torch.randn(n, cfg.hidden_size).bfloat16()
    rotary = Rotary(torch.tensor([0, 9, 4096, 100_000, 163_839, 1_000_000]), cfg.rope)
    with torch.no_grad():
        q, q_latent = mla.queries(x, rotary)
        iq, iw = indexer.queries(x, q_latent, rotary)
        rows = mla.token_rows(x, rotary)
        keys = indexer.keys(x, rows, rotary)
        return [rows, q, q_latent, keys, iq, iw, *norm.add_norm(a, x), norm(x)]


@pytest.mark.parametrize("family", sorted(SLICES))
def test_the_fused_paths_give_the_torch_forms_outputs(family: str, monkeypatch) -> None:
    cfg = parse_config(SLICES[family](small=True).to_dict())
    plain = _outputs(cfg, seed=1)
    for module in (layers, mla_attention, mla_indexer):
        monkeypatch.setattr(module, "fused", lambda t, op: True)
    fused = _outputs(cfg, seed=1)
    names = ["rows", "q", "q_latent", "keys", "index q", "index w", "normed", "summed", "norm"]
    for name, f, p in zip(names, fused, plain, strict=True):
        assert f.dtype == p.dtype and f.shape == p.shape, name
        rel = ((f.float() - p.float()).norm() / p.float().norm()).item()
        assert rel <= 2.0**-8, f"{family} {name}: {rel:.3g}"
    assert torch.equal(fused[7], plain[7])  # the residual sum
    assert torch.equal(fused[0][:, cfg.kv_lora_rank :], plain[0][:, cfg.kv_lora_rank :])
