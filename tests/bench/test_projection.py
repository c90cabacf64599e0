"""``python -m bench projection``: its session counts are the capacity model's (the paper's
208 / 140 / 20 / 12 on the implied 4-GPU deployment, and per GPU times the GPUs on an 8-GPU
node), and the binding resource follows from the step-time terms."""

from __future__ import annotations

import json

import pytest

from bench.core.provenance import blob_hash
from bench.projection import project
from bench.serving.scaling import Hardware, TargetModel, pcie_break_even, step
from dhisparse.capacity import glm53, glm53_paper_deployment, sessions_per_gpu
from dhisparse.family.presets import preset_topology
from tests.bench.helpers import bench


def serving(host_share: float = 0.3) -> dict:
    """A serving result as ``python -m bench serving`` writes it, with just what the projection
    reads."""
    cfg = preset_topology("tiny-glm")
    sel = 6 * cfg.index_topk * cfg.d_kv * 4  # payload sources x k x row bytes (fp32)

    def run(mode: str, c: int, drafter: str = "off", **metrics) -> dict:
        engine = mode if drafter == "off" else f"{mode}/{drafter}/fixed"
        steps = {str(b): [10, 10 * (0.01 + 0.002 * b), 10 * b] for b in range(1, c + 1)}
        m = {"decode_step_by_batch": steps, "tpot_s": {"mean": 0.02 + 0.002 * c},
             "host_read_bytes_per_token": None if mode == "resident" else host_share * sel,
             "census": None, **metrics}  # fmt: skip
        return {"engine": engine, "metrics": m,
                "run": {"mode": mode, "drafter": drafter, "schedule": "fixed",
                        "concurrency": c, "input_len": 128}}  # fmt: skip

    runs = [run(m, c) for m in ("resident", "hisparse", "adaptive") for c in (1, 4)]
    runs.append(run("adaptive", 4, "dflash2", acceptance_length=2.5, width_steps={"8": 30},
                    tpot_s={"mean": 0.03}))  # fmt: skip
    return {"model": {"config": cfg.to_dict(), "dtype": "float32", "name": cfg.name},
            "prompts": {"input_lens": [128]}, "load": {"output_len": 8}, "spec_width": 8,
            "runs": runs, "command": "python bench/serving.py ..."}  # fmt: skip


def test_paper_deployment_counts_are_reproduced() -> None:
    p = project(serving(), Hardware(), TargetModel())
    assert p["paper_check"] == {
        "resident": 20, "hierarchy": 208, "resident+dflash2": 12, "hierarchy+dflash2": 140,
    }  # fmt: skip


@pytest.mark.parametrize("gpus", [4, 8])
def test_sessions_are_the_capacity_models(gpus: int) -> None:
    hw = Hardware(gpus=gpus)  # the pool the paper's counts imply, per GPU
    assert hw.pool_bytes == glm53_paper_deployment().pool_bytes
    p = project(serving(), hw, TargetModel())
    prof = glm53()
    for mode, cap in (
        ("resident", "resident"),
        ("hisparse", "hierarchy"),
        ("adaptive", "hierarchy"),
    ):
        per_gpu = sessions_per_gpu(prof, 100_000, cap, hw.pool_bytes)  # type: ignore[arg-type]
        assert p["modes"][mode]["sessions_per_gpu"] == per_gpu
        assert p["modes"][mode]["sessions_node"] == per_gpu * gpus  # host holds 956: no cap
        assert p["modes"][mode]["admission_binds"] == "gpu_memory"
    if gpus == 4:
        assert [p["modes"][m]["sessions_node"] for m in ("resident", "adaptive")] == [20, 208]
        assert p["spec"]["adaptive/dflash2/fixed"]["sessions_node"] == 140
    assert p["host_memory_sessions"] == 956  # "about 950"


def test_a_small_host_binds_admission() -> None:
    p = project(serving(), Hardware(host_bytes=round(0.5e12)), TargetModel())
    assert p["modes"]["adaptive"]["admission_binds"] == "host_memory"
    assert p["modes"]["adaptive"]["sessions_node"] == p["host_memory_sessions"] < 416
    assert p["modes"]["resident"]["admission_binds"] == "gpu_memory"


def test_binding_resource_follows_the_host_share() -> None:
    prof, model, hw = glm53(), TargetModel(), Hardware()
    f0 = pcie_break_even(prof, model, hw, 100_000, 52)
    assert 0 < f0 < 1
    assert step(prof, model, hw, 100_000, 52, 0.5 * f0).binds != "pcie"
    assert step(prof, model, hw, 100_000, 52, 2.0 * f0).binds == "pcie"
    low = project(serving(host_share=0.5 * f0), hw, model)["modes"]["adaptive"]
    high = project(serving(host_share=2.0 * f0), hw, model)["modes"]["adaptive"]
    assert low["host_fraction"] == pytest.approx(0.5 * f0)
    assert low["throughput_binds"] != "pcie" and high["throughput_binds"] == "pcie"
    assert high["decode_tokens_per_s_node"] < low["decode_tokens_per_s_node"]
    spec = project(serving(), hw, model)["spec"]["adaptive/dflash2/fixed"]
    assert spec["acceptance_length"] == 2.5 and spec["width"] == 8


def test_cli_writes_json_and_markdown(tmp_path) -> None:
    src = tmp_path / "serving.json"
    src.write_text(json.dumps(serving()))
    out = tmp_path / "projection.json"
    proc = bench("projection", "--serving", str(src), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    p = json.loads(out.read_text())
    # the serving result it derives from is named with its hash, the code it ran with theirs
    assert p["provenance"]["inputs"] == {str(src): blob_hash(src.read_bytes())}
    assert {"bench/projection.py", "bench/serving/scaling.py"} <= p["provenance"]["files"].keys()
    assert {"modes", "spec", "paper_check", "verdict", "assumptions", "capacity"} <= p.keys()
    assert p["hardware"]["gpus"] == 8 and p["context"] == 100_000
    assert p["modes"]["adaptive"]["sessions_node"] == 416
    md = (tmp_path / "projection.md").read_text()
    assert "| adaptive | 416 | gpu_memory |" in md and "Paper's claim" in md
