"""The MTP drafter on the GPU (H200), over the tiny checkpoints with an appended MTP layer:
speculative greedy output, in every serving mode, is transformers' greedy continuation (fp32),
with the MTP layer drafting every round. The Triton resolver and sparse attention serve target
and MTP layer alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.ops.fusion import FUSED_OPS, fused_without
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from tests import hf_tiny
from tests.worker.mtp_fixture import FAMILIES, mtp_checkpoint
from tests.worker.mtp_reference import MTPReference

pytestmark = pytest.mark.gpu

LENGTHS = (200, 90, 260, 60)
NEW_TOKENS = 32
# fp32 logits closer than this are a tie that kernels rounding otherwise may break either way
# (the prompts keep every index row's and expert's selection clear of such ties:
# ``hf_tiny.well_posed_prompts``)
TIE = 1e-3


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[MTPReference, Path]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return mtp_checkpoint(request.param, tmp_path_factory)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_mtp_speculation_on_the_gpu_is_transformers_greedy(family, mode: str, fused: bool) -> None:
    """``fused``: the engine's passes run the fused kernels (``--fused-kernels``), whose
    rounding differs from the torch ops transformers runs: a token may then take the other side
    of one of transformers' near-ties (``TIE``), never more."""
    ref, path = family
    prompts = hf_tiny.well_posed_prompts(ref.target, LENGTHS, 23, NEW_TOKENS)
    cfg = EngineConfig(
        model=str(path), mode=mode, device="cuda", dtype="float32", kv_pool_mib=96,
        host_arena_mib=64, max_num_seqs=4, max_model_len=1024, page_size=16,
        max_prefill_tokens=128, hot_cache_rows=None if mode == "resident" else 32,
        speculation=SpeculationConfig("mtp", 4, "fixed"), fused_kernels=fused,
    )  # fmt: skip
    eng = Engine(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = [r.output_ids for r in eng.generate(prompts, params)]
    assert eng.speculator is not None and eng.speculator.counters.drafts > 0
    eng.close()
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out) == NEW_TOKENS
        if not fused:
            assert out == hf_tiny.greedy_under_reference(ref.target, prompt, out)
            continue
        check_within_ties(ref, prompt, out)


def check_within_ties(ref: MTPReference, prompt: list[int], out: list[int]) -> None:
    """Every token of ``out`` is transformers' greedy choice after ``prompt`` and the tokens
    before it, or within a near-tie (``TIE``) of it; the failure names the token and its
    slack."""
    slack = hf_tiny.greedy_slack(ref.target, prompt, out)
    worst = max(range(len(slack)), key=slack.__getitem__)
    assert slack[worst] <= TIE, (
        f"token {worst} of a prompt of {len(prompt)}: its logit is {slack[worst]:.3g} below "
        f"transformers' largest (near-ties: {TIE}); slacks {[f'{s:.1e}' for s in slack]}"
    )


@pytest.mark.parametrize("op", FUSED_OPS)
def test_each_fused_kernel_alone_keeps_transformers_greedy(tmp_path_factory, op: str) -> None:
    """GLM-5 (IndexShare, its RoPE layout, one MoE group) speculating with MTP in resident
    mode, with one fused kernel on and every other op in its torch form: transformers' greedy
    within near-ties. A fused kernel that computes otherwise fails here by its name."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ref, path = mtp_checkpoint("glm_moe_dsa", tmp_path_factory)
    prompts = hf_tiny.well_posed_prompts(ref.target, LENGTHS, 23, NEW_TOKENS)
    cfg = EngineConfig(
        model=str(path), mode="resident", device="cuda", dtype="float32", kv_pool_mib=96,
        max_num_seqs=4, max_model_len=1024, page_size=16, max_prefill_tokens=128,
        speculation=SpeculationConfig("mtp", 4, "fixed"), fused_kernels=True,
    )  # fmt: skip
    eng = Engine(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with fused_without(*(o for o in FUSED_OPS if o != op)):
        outs = [r.output_ids for r in eng.generate(prompts, params)]
    eng.close()
    for prompt, out in zip(prompts, outs, strict=True):
        check_within_ties(ref, prompt, out)
