"""DeepSeek-V4 served on the GPU (``model/v4_serving.py`` through the Triton resolver and sparse
attention, the heads' sinks in the kernel; decode and verify passes and the MTP layer's draft
steps replayed as CUDA graphs): on a tiny random checkpoint, greedy tokens of every serving
mode in fp32 are transformers' (within near-ties the kernels' rounding may break either way),
the hierarchy modes in bf16 give resident's logits bit for bit, replayed passes give the eager
passes' logits bit for bit, and speculation with V4's MTP layer gives plain greedy's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from tests import hf_tiny, hf_tiny_v4
from tests.worker.model import serving
from tests.worker.mtp_fixture import v4_mtp_checkpoint

pytestmark = pytest.mark.gpu

LENGTHS = (120, 45, 90, 200)
NEW_TOKENS = 16
TIE = 1e-3  # fp32 logits closer than this may take either side under other rounding


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ref = hf_tiny_v4.build(hf_tiny_v4.v4_config(), seed=5)
    return ref, hf_tiny_v4.save_hub_style(ref, tmp_path_factory.mktemp("v4-gpu"))


def _engine(path: Path, mode: str, dtype: str, **kw) -> Engine:
    return Engine(EngineConfig(
        model=str(path), mode=mode, device="cuda", dtype=dtype, max_num_seqs=4,
        max_model_len=512, page_size=4, hot_cache_rows=None if mode == "resident" else 8,
        max_prefill_tokens=32, kv_pool_mib=64, host_arena_mib=64, **kw,
    ))  # fmt: skip


def _prompts() -> list[list[int]]:
    return [hf_tiny_v4.token_ids(n, 900 + n).tolist() for n in LENGTHS]


@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_every_mode_on_the_gpu_is_transformers_greedy(checkpoint, mode: str) -> None:
    ref, path = checkpoint
    eng = _engine(path, mode, "float32")
    assert eng.graphs_off_reason is None
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts()
    outs = [r.output_ids for r in eng.generate(prompts, params)]
    if mode == "hisparse":  # adaptive keeps every row on the device while the pool holds them
        assert eng.kv.payload.census.host > 0, eng.kv.payload.census
    eng.close()
    for prompt, out in zip(prompts, outs, strict=True):
        slack = hf_tiny.greedy_slack(ref, prompt, out)
        assert max(slack) <= TIE, f"a prompt of {len(prompt)}: slacks {slack}"


def test_the_hierarchy_in_bf16_on_the_gpu_gives_residents_logits(checkpoint) -> None:
    """bf16 rows (the tensors V4 holds in fp32 kept so): hisparse and adaptive give every
    emitted token's logits bit for bit as resident does."""
    _, path = checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = {}
    for mode in ("resident", "hisparse", "adaptive"):
        eng = _engine(path, mode, "bfloat16")
        assert eng.passes.model.net.layers[1].attn.attn_sink.dtype == torch.float32
        seen = serving.recorded_emits(eng)
        index = {r.request_id: i for i, r in enumerate(eng.generate(_prompts(), params))}
        eng.close()
        assert len(seen) == len(LENGTHS) * NEW_TOKENS
        runs[mode] = [(index[r], n, logits) for r, n, logits in seen]
    want = {(r, n): logits for r, n, logits in runs["resident"]}
    for mode in ("hisparse", "adaptive"):
        got = {(r, n): logits for r, n, logits in runs[mode]}
        assert got.keys() == want.keys()
        for key, logits in want.items():
            assert torch.equal(got[key], logits), f"{mode}: {key}: logits differ"


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_mtp_speculation_on_the_gpu_is_plain_greedy(tmp_path_factory, mode: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, path = v4_mtp_checkpoint(tmp_path_factory)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = _engine(path, mode, "float32")
    want = [r.output_ids for r in plain.generate(_prompts(), params)]
    plain.close()
    eng = _engine(path, mode, "float32", speculation=SpeculationConfig("mtp", 4, "fixed"))
    assert [r.output_ids for r in eng.generate(_prompts(), params)] == want
    assert eng.speculator is not None and eng.speculator.counters.drafts > 0
    eng.close()


def _emitted(eng: Engine, params: SamplingParams) -> dict[tuple[int, int], torch.Tensor]:
    """(prompt index, output tokens before it) -> the logits of the tokens each emission gave."""
    seen = serving.recorded_emits(eng)
    index = {r.request_id: i for i, r in enumerate(eng.generate(_prompts(), params))}
    return {(index[r], n): logits for r, n, logits in seen}


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_replayed_passes_equal_the_eager_passes(tmp_path_factory, checkpoint, mode, mtp) -> None:
    """Decode passes (with MTP speculation: verify passes and the MTP layer's draft steps too)
    replayed from CUDA graphs give every emitted token's logits bit for bit as eager passes:
    the compressed rows a pass completes are written from the host's plan (padded to a power of
    two; counts that change from step to step), the HCA layers' widths bucketed, the window
    and the compressors' state read from the token rings inside the graph."""
    path = v4_mtp_checkpoint(tmp_path_factory)[1] if mtp else checkpoint[1]
    spec = SpeculationConfig("mtp", 4, "fixed") if mtp else SpeculationConfig()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    eager = _engine(path, mode, "float32", graphs=GraphConfig(False), speculation=spec)
    want = _emitted(eager, params)
    eager.close()
    eng = _engine(path, mode, "float32", speculation=spec)
    got = _emitted(eng, params)
    graphs = eng.passes.graphs
    assert graphs is not None and graphs.captures > 1, "no graph captured"
    assert graphs.replays > 20, f"{graphs.replays} replays, {graphs.eager} eager passes"
    if mode != "resident":
        assert eng.kv.payload.census.host > 0
    eng.close()
    assert got.keys() == want.keys()
    for key, logits in want.items():
        assert torch.equal(got[key], logits), f"{key}: logits differ"
