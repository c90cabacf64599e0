"""Prompt logprobs of DeepSeek-V3.2 and GLM-5 from their Hugging Face format against
transformers 5.17.0 (the oracle), in fp32 on tiny random checkpoints: the engine's scores of
each prompt token, its prefill in chunks of 64 tokens beside another request's, equal
``log_softmax`` of transformers' logits over the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import hf_tiny
from tests.worker.model import serving

FAMILIES = {"deepseek_v32": hf_tiny.v32_config, "glm_moe_dsa": hf_tiny.glm_config}
TOP = 4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """(the transformers reference, its checkpoint saved hub-style)."""
    ref = hf_tiny.build(FAMILIES[request.param](), seed=3)
    path = tmp_path_factory.mktemp(request.param)
    hf_tiny.save_hub_style(ref, path)
    return ref, path


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hf_tiny.VOCAB, (n,), generator=g).tolist()


def test_prompt_logprobs_equal_transformers(family) -> None:
    ref, path = family
    eng = serving.engine(path, "resident", kv_pool_mib=48)
    prompt, beside = _ids(170, 1), _ids(90, 2)
    got, want = serving.scored_prompt(
        eng, lambda p: hf_tiny.reference_logits(ref, torch.tensor(p)), prompt, beside, TOP
    )
    top_v, top_i = torch.topk(want, TOP, dim=-1)
    for j, lp in enumerate(got):
        torch.testing.assert_close(
            torch.tensor([v for _, v in lp.top]), top_v[j], atol=2e-4, rtol=0
        )
        # ids agree wherever the reference's alternatives are not near-tied
        gaps = (top_v[j, :-1] - top_v[j, 1:]).abs()
        if bool((gaps > 1e-3).all()):
            assert [t for t, _ in lp.top] == top_i[j].tolist()
    eng.close()
