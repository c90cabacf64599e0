"""The MLA training forward on a GPU, at the shipped recipe's dimensions, as the H200 trains it:
bf16 autocast through the fused SDPA kernels (flash or memory-efficient only, so a fallback to
the math kernel fails) gives fp32's logits and MTP logits within bf16 rounding at the median
position (top-2 routing over a random router's near-tied scores changes some positions'
experts under bf16, and with them their logits) and fp32's indexer KL; in sparse attention
the logits are compared where every row is selected (positions before ``index_topk``: bf16
index scores reorder near-tied rows past it, and a changed row changes a logit by more than
rounding), and past it bf16 selects nearly fp32's rows; and
at T = 4096 both attention modes run forward and backward with every gradient finite, the
indexer's KL on sampled queries and on all of them."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from training.recipe import SHIPPED
from training.target.family import MLAFamily
from training.target.forward import lm_loss
from training.target.mla_forward import mla_train_forward

pytestmark = pytest.mark.gpu
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


@pytest.fixture(scope="module")
def model():
    family = MLAFamily(SHIPPED.config(eos_id=SHIPPED.tokenizer_vocab - 7, pad_id=0))
    return family.build(seed=0).to("cuda")


def _tokens(b: int, t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHIPPED.tokenizer_vocab, (b, t), generator=g).to("cuda")


def _median_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """The median over positions of each position's largest logit error over its largest
    logit."""
    per_position = (got.float() - want).abs().amax(-1) / want.abs().amax(-1)
    return float(per_position.flatten().median())


def _shared_share(got: torch.Tensor, want: torch.Tensor, start: int) -> float:
    """Of the rows ``want`` [B, T, k] selects at positions from ``start`` (all k real), the
    share ``got`` selects too."""
    got, want = got[:, start:], want[:, start:]
    width = int(max(got.max(), want.max())) + 1
    seen = torch.zeros(*want.shape[:2], width, dtype=torch.bool, device=want.device)
    seen.scatter_(2, want, True)
    return float(seen.gather(2, got).float().mean())


def test_bf16_autocast_in_fused_kernels_gives_fp32s_outputs(model) -> None:
    with torch.no_grad():  # the tied embedding starts N(0, 1/d): the logits are not zero
        tokens = _tokens(2, 1024, 1)  # > index_topk: sparse selects
        topk = model.cfg.index_topk
        for mode in ("dense", "sparse"):
            ref = mla_train_forward(model, tokens, mode)
            with torch.autocast("cuda", torch.bfloat16), sdpa_kernel(FUSED):
                low = mla_train_forward(model, tokens, mode)
            upto = tokens.shape[1] if mode == "dense" else topk - 1  # MTP's i reads i + 1
            assert _median_rel(low.logits[:, :upto], ref.logits[:, :upto]) < 3e-2, mode
            assert _median_rel(low.mtp_logits[:, :upto], ref.mtp_logits[:, :upto]) < 3e-2, mode
            assert abs(float(low.index_kl) - float(ref.index_kl)) < 3e-2 * float(ref.index_kl)
            for layer, sel in ref.selections.items():
                share = _shared_share(low.selections[layer], sel, topk)
                print(f"layer {layer}: bf16 selects {share:.4f} of fp32's rows past top-k")
                assert share > 0.9, layer


@pytest.mark.parametrize("mode", ["dense", "sparse"])
@pytest.mark.parametrize("kl_queries", [256, None])
def test_a_4k_step_backpropagates_finite_gradients(model, mode: str, kl_queries) -> None:
    model.zero_grad(set_to_none=True)
    tokens = _tokens(2, 4097, 2)
    gen = torch.Generator().manual_seed(3)
    with torch.autocast("cuda", torch.bfloat16), sdpa_kernel(FUSED):
        out = mla_train_forward(model, tokens[:, :-1], mode, kl_queries=kl_queries, gen=gen)
        loss = (
            lm_loss(out.logits, tokens[:, 1:])
            + 0.3 * lm_loss(out.mtp_logits, tokens[:, 2:])
            + out.index_kl
        )
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
