"""The real families on the GPU (H200): the engine's kernels (Triton resolver and sparse
attention) and CUDA graphs over a tiny glm_moe_dsa / deepseek_v32 checkpoint. Greedy output
equals transformers' in fp32; in bf16 the hierarchy modes give resident serving's tokens, and
speculation gives plain decoding's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from tests import hf_tiny

pytestmark = pytest.mark.gpu

FAMILIES = {"deepseek_v32": hf_tiny.v32_config, "glm_moe_dsa": hf_tiny.glm_config}
LENGTHS = (200, 90, 260, 60)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ref = hf_tiny.build(FAMILIES[request.param](), seed=3)
    path = tmp_path_factory.mktemp(request.param)
    hf_tiny.save_hub_style(ref, path)
    return ref, path


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return [torch.randint(0, hf_tiny.VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _serve(path: Path, mode: str, dtype: str, **kw) -> list[list[int]]:
    cfg = EngineConfig(
        model=str(path), mode=mode, device="cuda", dtype=dtype, kv_pool_mib=96, host_arena_mib=64,
        max_num_seqs=4, max_model_len=1024, page_size=16, max_prefill_tokens=128,
        hot_cache_rows=None if mode == "resident" else 32, **kw,
    )  # fmt: skip
    eng = Engine(cfg)
    assert eng.graphs_off_reason is None, eng.graphs_off_reason
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    out = [r.output_ids for r in eng.generate(_prompts(), params)]
    eng.close()
    return out


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_fp32_greedy_on_the_gpu_is_transformers_greedy(family, mode: str) -> None:
    ref, path = family
    for prompt, out in zip(_prompts(), _serve(path, mode, "float32"), strict=True):
        assert out == hf_tiny.greedy_under_reference(ref, prompt, out)


def test_bf16_hierarchy_modes_give_resident_tokens(family) -> None:
    _, path = family
    want = _serve(path, "resident", "bfloat16")
    assert _serve(path, "hisparse", "bfloat16") == want
    assert _serve(path, "adaptive", "bfloat16") == want


@pytest.mark.parametrize("drafter", ["dflash", "dspark"])
def test_bf16_speculation_gives_plain_tokens(family, drafter: str) -> None:
    _, path = family
    want = _serve(path, "hisparse", "bfloat16")
    spec = SpeculationConfig(drafter, 4, "fixed")
    assert _serve(path, "hisparse", "bfloat16", speculation=spec) == want
