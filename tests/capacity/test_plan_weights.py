"""``dhisparse plan``'s weights per GPU against the models the worker builds. Under each layout
(TP, TP + EP, DP attention, DP attention + EP) over 2 ranks of a real gloo group, every
parameter and buffer each rank loads has the bytes the plan gives it (``held_weights`` cut by
the layout table), and the plan's totals are the sums: on tiny checkpoints of both families and
on the shipped FP8 checkpoint (FP8 blocks and scales, ``modules_to_not_convert``, its MTP
layer). FP8 block grids under TP and EP cuts, on models built in their rank-local shapes; and
a layout the worker refuses at start-up, the plan refuses with the same message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dhisparse.capacity.weights import ModelWeights, model_weights, model_weights_of
from dhisparse.cli import main
from dhisparse.family.hf_config import parse_config, topology
from dhisparse.family.hf_dir import read_config
from dhisparse.family.parallel_layout import LayoutError, ParallelConfig, RankLayout
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.weight_format import WeightFormat
from services.worker.parallel.comm import LOCAL
from services.worker.parallel.shards import Shards
from tests import hf_tiny, ranks
from tests.group import run_group

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "glm-dsa-mini"  # FP8, modules_to_not_convert, an MTP layer
LAYOUTS = ranks.LAYOUTS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = []
    for config in (hf_tiny.v32_config(), hf_tiny.glm_config()):
        path = tmp_path_factory.mktemp(config.model_type)
        hf_tiny.save_hub_style(hf_tiny.build(config, seed=5), path)
        out.append(path)
    return out


def _planned(weights: ModelWeights, cfg: ParallelConfig, rank: int) -> dict[str, int]:
    return {name: nbytes for name, (nbytes, _) in weights.on_rank(cfg, rank).items()}


def test_each_rank_holds_the_bytes_the_plan_gives(
    checkpoints: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # the shipped FP8 model splits over 2 ranks only as DP attention + EP (its 64-wide shared
    # experts and routed experts' halves would cut 128 x 128 blocks)
    loads = [(path, layout, False) for path in checkpoints for layout in LAYOUTS.values()]
    loads.append((SHIPPED, LAYOUTS["dp-attention+ep"], True))
    group = run_group(ranks.held_bytes, 2, loads)
    for i, (path, layout, mtp) in enumerate(loads):
        weights = model_weights_of(path, mtp=mtp)
        assert weights is not None
        cfg = ParallelConfig(2, **layout)
        for rank in range(2):
            assert group[rank][i] == _planned(weights, cfg, rank), (path.name, cfg.name, rank)
        planned = weights.per_rank(cfg)
        assert planned.total == sum(group[0][i].values())
        # split tensors are halves: the whole model is what one process loads
        assert planned.whole == weights.total
    one = ranks.held_bytes(LOCAL, [(SHIPPED, None, True)])[0]
    shipped = model_weights_of(SHIPPED, mtp=True)
    assert shipped is not None and shipped.fp8
    assert one == _planned(shipped, ParallelConfig(), 0)
    # the plan's table and JSON: every layout, with the totals each rank loaded
    for path, offset in zip(checkpoints, (0, 4), strict=True):
        argv = ["plan", "--model", str(path), "--context", "256", "--tensor-parallel-size", "2"]
        assert main([*argv, "--layouts", "all", "--json"]) == 0
        got = json.loads(capsys.readouterr().out)["layouts"]
        assert [lp["name"] for lp in got] == list(LAYOUTS)
        for j, lp in enumerate(got):
            assert lp["weights"]["total"] == sum(group[0][offset + j].values())


def _fp8_config() -> dict:
    """A config whose every cut over 2 and 4 ranks falls on 128 x 128 blocks."""
    return hf_tiny.v32_config(
        hidden_size=256, intermediate_size=1024, moe_intermediate_size=512,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, vocab_size=512,
        index_head_dim=128,
    ).to_dict()  # fmt: skip


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_block_grids_under_every_cut(n: int, layout: str) -> None:
    """FP8 weights and their block scales, rank by rank, as the model's constructor shapes
    them (the shapes the loader fills): dense grids cut by blocks, the routed experts' grids
    by expert (EP) or by blocks of their intermediate dimension, gate's and up's apart."""
    raw = _fp8_config()
    cfg = parse_config(raw)
    weights = model_weights(cfg, None, weight_dtype="fp8", dtype="bfloat16")
    par = ParallelConfig(n, **LAYOUTS[layout])
    for rank in range(n):
        with torch.device("meta"):
            model = MLADecoder(
                cfg, topology(cfg, "fp8"), WeightFormat(fp8=True),
                Shards(RankLayout(par, rank, cfg)),
            )  # fmt: skip
        model.cast(torch.bfloat16)
        tensors = [*model.named_parameters(), *model.named_buffers()]
        held = {name: t.numel() * t.element_size() for name, t in tensors}
        assert held == _planned(weights, par, rank)
    scales = [t for t in weights.tensors if t.name.endswith("_scale_inv")]
    assert any("experts" in t.name for t in scales)


def test_a_layout_the_worker_refuses_the_plan_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_config(read_config(SHIPPED))
    with pytest.raises(LayoutError) as refused, torch.device("meta"):
        MLADecoder(cfg, topology(cfg, "mini"), WeightFormat(fp8=True),
                   Shards(RankLayout(ParallelConfig(2), 0, cfg)))  # fmt: skip
    argv = ["plan", "--model", str(SHIPPED), "--context", "1000", "--tensor-parallel-size", "2"]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"dhisparse plan: error: {refused.value}\n"
    # held in bf16, no cut falls inside a block: the same layout is sized
    assert main([*argv, "--weight-dtype", "bf16", "--json"]) == 0
    (tp,) = json.loads(capsys.readouterr().out)["layouts"]
    bf16 = model_weights(cfg, None, weight_dtype="bf16")
    assert tp["name"] == "tp" and tp["weights"]["total"] == bf16.per_rank(ParallelConfig(2)).total
