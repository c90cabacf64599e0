"""DeepSeek-V4 served on the GPU with its projections in FP8 and its routed experts in FP8 or FP4
(``--weight-dtype fp8`` / ``fp4``: the block-scaled FP8 matmul, the grouped output projection
per group, the fused MoE over e4m3 or packed e2m1 weights with V4's clamped SwiGLU), from a
tiny checkpoint in the released form (128x128 blocks; ``o_lora_rank`` 128, so each group of the
output projection begins on a block row): in fp32 every mode's greedy tokens are those of the
same quantized model on the CPU (the kernels' torch references; within near-ties), in bf16 the
hierarchy modes give resident's logits bit for bit, and replayed passes give the eager passes'
logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.request.request import SamplingParams
from services.worker.weights.v4_names import load_v4_served
from tests import hf_tiny_v4
from tests.worker.model import serving

pytestmark = pytest.mark.gpu

LENGTHS = (120, 45, 90)
NEW_TOKENS = 16
TIE = 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ref = hf_tiny_v4.build(hf_tiny_v4.v4_config(o_lora_rank=128), seed=6)
    return hf_tiny_v4.save_released_form(ref, tmp_path_factory.mktemp("v4-fp8"), block=128)


def _engine(path: Path, mode: str, dtype: str, weights: str, **kw) -> Engine:
    return Engine(EngineConfig(
        model=str(path), mode=mode, device="cuda", dtype=dtype, max_num_seqs=4,
        max_model_len=512, page_size=4, hot_cache_rows=None if mode == "resident" else 8,
        max_prefill_tokens=32, kv_pool_mib=64, host_arena_mib=64, weight_dtype=weights, **kw,
    ))  # fmt: skip


def _prompts() -> list[list[int]]:
    return [hf_tiny_v4.token_ids(n, 700 + n).tolist() for n in LENGTHS]


def _emitted(eng: Engine, params: SamplingParams) -> dict[tuple[int, int], torch.Tensor]:
    seen = serving.recorded_emits(eng)
    index = {r.request_id: i for i, r in enumerate(eng.generate(_prompts(), params))}
    return {(index[r], n): logits for r, n, logits in seen}


@pytest.mark.parametrize("weights", ["fp8", "fp4"])
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_every_mode_gives_the_quantized_models_greedy_tokens(checkpoint, mode, weights) -> None:
    eng = _engine(checkpoint, mode, "float32", weights)
    experts = eng.passes.model.net.layers[2].ffn.experts
    assert type(experts).__name__ == ("FP4Experts" if weights == "fp4" else "FP8Experts")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts()
    outs = [r.output_ids for r in eng.generate(prompts, params)]
    if mode == "hisparse":  # adaptive keeps every row on the device while the pool holds them
        assert eng.kv.payload.census.host > 0, eng.kv.payload.census
    eng.close()
    cpu = load_v4_served(checkpoint, "cpu", torch.float32, False, weights, 1).net
    for prompt, out in zip(prompts, outs, strict=True):
        logits = cpu(torch.tensor(prompt + out[:-1]), cpu.new_state())[len(prompt) - 1 :]
        chosen = logits.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)
        slack = (logits.amax(dim=-1) - chosen).tolist()
        assert max(slack) <= TIE, f"a prompt of {len(prompt)}: slacks {slack}"


@pytest.mark.parametrize("weights", ["fp8", "fp4"])
def test_bf16_hierarchy_and_replays_give_eager_residents_logits(checkpoint, weights) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eager = _engine(checkpoint, "resident", "bfloat16", weights, graphs=GraphConfig(False))
    want = _emitted(eager, params)
    eager.close()
    for mode in ("resident", "hisparse", "adaptive"):
        eng = _engine(checkpoint, mode, "bfloat16", weights)
        got = _emitted(eng, params)
        graphs = eng.passes.graphs
        assert graphs is not None and graphs.replays >= 16, "decode passes not replayed"
        eng.close()
        assert got.keys() == want.keys()
        for key, logits in want.items():
            assert torch.equal(got[key], logits), f"{mode}: {key}: logits differ"
