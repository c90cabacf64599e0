"""``python -m bench roofline`` on the CPU with a tiny GLM-5.2-family model (IndexShare
followers; weights in fp32, which the CPU runs fast: FP8 weights' bytes are
``test_roofline_cost.py``'s): the whole command once, its output's structure and
content checked against the model itself; and the replay path's alignment, driven on the CPU
by profiling eager steps as if they were replays."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench import roofline
from bench.core import UsageError
from bench.core.steps import steady_engine
from bench.roofline.attribution import UNATTRIBUTED, labelled_step, profile_steps
from bench.roofline.models import build
from bench.roofline.variants import Served
from dhisparse.tokenizer import ByteTokenizer
from services.worker.graphs.cuda_graph import GraphConfig

FAMILY = "glm5-scaled"
MUST = ("embed", "attn_norm", "attn.q_a_proj", "attn.q_b_proj", "attn.kv_a_proj_with_mqa",
        "attn.o_proj", "attn.sparse", "indexer.wq_b", "indexer.wk", "indexer.select",
        "mlp.gate", "mlp.experts", "mlp.shared_experts.down_proj", "mlp_norm", "norm",
        "lm_head", "kv.resolve")  # fmt: skip


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    roofline.add_arguments(ap)
    return ap.parse_args(list(argv))


def test_arguments_are_checked_before_anything_runs() -> None:
    for bad in (["--scaled", "v4"], ["--variants", "fused,fused"], ["--variants", "fast"],
                ["--concurrency", "0"], ["--concurrency", "4k"],
                ["--concurrency", "", "--prefill", ""]):  # fmt: skip
        with pytest.raises(UsageError):
            roofline.run(_args("--device", "cpu", "--tiny", *bad))


@pytest.fixture(scope="module")
def result() -> dict:
    return roofline.run(_args(
        "--device", "cpu", "--tiny", "--scaled", FAMILY, "--concurrency", "2,1",
        "--context", "32", "--steps", "2", "--warmup", "0", "--profile-steps", "1",
        "--prefill", "40", "--weights", "dense",
    ))  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return build(FAMILY, "cpu", tiny_model=True, fp8=False)[1]


def _bytes(module, first: bool = False) -> int:
    """A module's weights in bytes (``first``: of the first expert of each tensor)."""
    ts = [*module.parameters(), *module.buffers()]
    return sum((t[0] if first else t).numel() * t.element_size() for t in ts)


def test_the_result_has_every_family_concurrency_and_variant(result: dict) -> None:
    assert result["bench"] == "roofline" and result["config"]["concurrency"] == [1, 2]
    lim = result["limits"]
    assert lim["copy_bytes_per_s"] > 0 and lim["peak_bf16"] is None  # the CPU has no table peak
    assert lim["compute"] == lim["matmul_flops_per_s"] > 0
    fam = result["families"][FAMILY]
    assert fam["graphs"] is False and set(fam["decode"]) == {"1", "2"}
    for c in ("1", "2"):
        for v in ("fused", "unfused"):
            assert fam["decode"][c]["admit_s"] > 0
            r = fam["decode"][c]["variants"][v]
            assert r["attribution"] == "labelled" and r["graph_launch_us_per_step"] is None
            assert r["step"]["samples"] == 2 and r["step"]["median_ms"] > 0
            assert r["step"]["min_ms"] <= r["step"]["median_ms"] <= r["step"]["max_ms"]
            assert r["kernels_per_step"] > 100 and r["kernels_per_layer"] > 25
            assert r["kernels_per_step"] == r["eager_kernels"]
            assert sum(k["count"] for k in r["kernels"]) == pytest.approx(r["kernels_per_step"])
            roof = r["roofline"]
            assert roof["bytes"] > 0 and roof["flops"] > 0 and 0 < roof["ratio"] < 1
            assert roof["roofline_s"] == max(roof["memory_s"], roof["compute_s"])


def test_every_region_that_must_be_there_is_there_with_kernels(result: dict) -> None:
    r = result["families"][FAMILY]["decode"]["2"]["variants"]["fused"]
    rows = {row["region"]: row for row in r["regions"]}
    missing = [m for m in MUST if m not in rows]
    assert not missing, missing
    for m in MUST:
        assert rows[m]["kernels"] > 0 and rows[m]["us"] > 0, m
    assert rows["attn.q_a_proj"]["frac_copy_rate"] > 0
    assert "unattributed" not in rows  # no alignment on the CPU: every kernel is labelled


def test_projection_bytes_are_the_weights_and_activations_of_the_model(result: dict, model) -> None:
    r = result["families"][FAMILY]["decode"]["2"]["variants"]["fused"]
    rows = {row["region"]: row for row in r["regions"]}
    n, act = 2, 4  # two decode tokens, fp32 activations on the CPU
    want = 0
    for layer in model.layers:
        p = layer.attn.q_a_proj
        want += _bytes(p) + n * (p.in_features + p.out_features) * act
    assert rows["attn.q_a_proj"]["bytes"] == want
    assert rows["attn.q_a_proj"]["flops"] == 2 * n * p.in_features * p.out_features * 4


def test_expert_bytes_follow_the_experts_the_router_chose(result: dict, model) -> None:
    r = result["families"][FAMILY]["decode"]["2"]["variants"]["fused"]
    chosen = r["experts"]
    moe = [i for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "gate")]
    assert sorted(int(i) for i in chosen) == moe
    top_k = model.family.moe.top_k
    assert all(top_k <= n <= 2 * top_k for n in chosen.values())  # two tokens' distinct picks
    one = _bytes(model.layers[moe[0]].mlp.experts, first=True)
    rows = {row["region"]: row for row in r["regions"]}
    acts = len(moe) * 2 * 2 * model.family.hidden_size * 4
    assert rows["mlp.experts"]["bytes"] == sum(chosen.values()) * one + acts


def test_prefill_reports_its_time_flops_and_regions(result: dict) -> None:
    pre = result["families"][FAMILY]["prefill"]["40"]
    for v in ("fused", "unfused"):
        r = pre[v]
        assert r["ttft_s"] > 0 and r["passes"] >= 1 and r["forward_passes"] >= 1
        assert r["flops"] > 0 and 0 < r["frac_peak"] < 1 and r["kernels"] > 100
        regions = {row["region"] for row in r["regions"] if row["kernels"] > 0}
        assert {"attn.sparse", "indexer.select", "mlp.experts", "lm_head"} <= regions


def test_replayed_steps_take_the_regions_of_the_aligned_eager_step() -> None:
    """On the CPU a "replayed" step is an eager one: aligned with the labelled step, nearly
    every kernel finds its counterpart and the regions come out as labelled."""
    _, model = build(FAMILY, "cpu", tiny_model=True, fp8=False)
    prompts = [list(range(2, 34)), list(range(40, 72))]
    eng = steady_engine("resident", prompts, 32, 0.0, f"{FAMILY}-tiny", model, ByteTokenizer(),
                        device="cpu", graphs=GraphConfig(False), kv_pool_mib=None)  # fmt: skip

    class AsReplayed(Served):
        graphs = True  # profile_steps takes the replay path

    served = AsReplayed(eng, ["fused"])
    v = served.variants[0]
    labelled, _ = labelled_step(served, v)
    sk = profile_steps(served, v, 1)
    eng.close()
    assert sk.source == "aligned" and sk.steps == 1 and sk.lost == 0
    assert sk.graph_launch_us == 0 and sk.graph_launches == 0  # no graphs on the CPU
    regions = sk.by_region()
    total = sum(n for n, _ in regions.values())
    assert total >= 0.9 * len(labelled)
    assert regions.get(UNATTRIBUTED, (0.0, 0.0))[0] <= 0.05 * total
    labelled_regions = {r for _, r in labelled}
    assert (
        {"attn.q_a_proj", "mlp.experts", "indexer.select"}
        <= set(regions)
        <= (labelled_regions | {UNATTRIBUTED})
    )


def test_each_variant_steps_with_its_own_fusion_and_graphs() -> None:
    """A variant's steps run the engine's passes fused (``fused``) or not (``unfused``), whatever
    the engine was configured with, and the engine gets its own choice back after each."""
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import Engine
    from services.worker.ops.fusion import fused

    eng = Engine(
        EngineConfig(model="tiny-glm", kv_pool_mib=32, max_num_seqs=2, fused_kernels=False)
    )
    served = Served(eng, ["fused", "unfused"])
    seen = {}
    for v in served.variants:
        with served.as_variant(v):
            seen[v.name] = eng.passes.fused
    assert seen == {"fused": True, "unfused": False}
    assert eng.passes.fused is False and eng.passes.graphs is served.variants[0].graphs
    assert not fused(torch.zeros(1), "rms_norm")  # the CPU runs the torch forms either way
    eng.close()
