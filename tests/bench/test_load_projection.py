"""``python -m bench load-projection``: the arithmetic by hand on small numbers, and a run on the
archived roofline files (sessions from ``dhisparse plan``, every curve capped by them)."""

from __future__ import annotations

import json

import pytest

from bench.cli import main as bench_main
from bench.load.pool import plan_pool
from bench.load.projection import (
    Measured,
    Node,
    Shape,
    Step,
    adaptive_share,
    at,
    device_s,
    exchange_s,
    experts_read,
    host_s,
    tokens_per_s,
)


def test_interpolation() -> None:
    assert at({1: 10.0, 4: 40.0}, 2) == pytest.approx(20.0)
    assert at({1: 10.0, 4: 40.0}, 8) == pytest.approx(80.0)  # beyond: the last two's line
    assert at({1: 10.0, 4: 40.0, 16: 100.0}, 10) == pytest.approx(70.0)
    assert at({1: 10.0, 4: 40.0, 16: 100.0}, 4) == pytest.approx(40.0)
    assert at({5: 7.0}, 100) == 7.0


def test_experts_read() -> None:
    assert experts_read(256, 8, 8, 1) == pytest.approx(1.0)  # one token: 8 of 256, 1/8 here
    assert experts_read(4, 2, 2, 2) == pytest.approx(2 * (1 - 0.5**2))


SCALED = Shape(layers=2, producers=1, moe_layers=1, dense_layers=1, experts=4, top_k=2)
FULL = Shape(layers=4, producers=2, moe_layers=3, dense_layers=1, experts=8, top_k=2)
REGIONS = {"attn.sparse": 100.0, "indexer.select": 50.0, "mlp.experts": 40.0, "lm_head": 10.0,
           "mlp.gate_proj": 20.0}  # fmt: skip
MEASURED = Measured(
    regions={1: REGIONS, 3: {r: 2 * v for r, v in REGIONS.items()}},
    step_ms={1: 0.3, 3: 0.5}, device_us={1: 220.0, 3: 440.0}, experts_hit={1: 2.0, 3: 4.0},
    visible_rows=100.0,
)  # fmt: skip


def test_device_time_by_hand() -> None:
    node = Node(gpus=2, hbm_ratio=0.5)
    got = {r: v * 1e6 for r, v in device_s(MEASURED, SCALED, FULL, node, 1, 200).items()}
    assert got["attn.sparse"] == pytest.approx(100 * 4 / 2 * 0.5)  # layers
    assert got["indexer.select"] == pytest.approx(50 * 2 / 1 * 200 / 100 * 0.5)  # producers, rows
    assert got["lm_head"] == pytest.approx(10 * 0.5)  # once a step
    assert got["mlp.gate_proj"] == pytest.approx(20 * 0.5)  # dense layers: 1 and 1
    # 40 µs over 1 MoE layer × 2 experts: 20 µs an expert; 2 GPUs × 1 token pick 2 of 8, a GPU
    # holds 4: 4 × (1 - (6/8)^2) = 1.75 read, in 3 MoE layers
    assert got["mlp.experts"] == pytest.approx(20 * 3 * 1.75 * 0.5)
    assert got["launch"] == pytest.approx((300 - 220) * 4 / 2)  # outside kernels: not scaled
    at2 = {r: v * 1e6 for r, v in device_s(MEASURED, SCALED, FULL, node, 2, 200).items()}
    assert at2["attn.sparse"] == pytest.approx(150 * 4 / 2 * 0.5)  # halfway between C 1 and 3
    # per expert at C 2: halfway between 40/2 and 80/4 = 20; 4 tokens: 4 × (1 - 0.75^4)
    assert at2["mlp.experts"] == pytest.approx(20 * 3 * 4 * (1 - 0.75**4) * 0.5)


def test_host_exchange_and_rates_by_hand() -> None:
    node = Node(gpus=2, pcie_gbs=0.001, row_bytes=100, link_gbs=1e-6, latency_s=1e-3, hidden=10)
    # 3 sessions × 0.25 of 4 rows × 2 layers × 100 B = 600 B at 1 MB/s
    assert host_s(0.25, 4, 2, node, 3) == pytest.approx(6e-4)
    # 4 sessions × 2 copies × 1/2 off the GPU × 10 × 3 B = 120 B at 1,000 B/s, plus 2 ms, × 3
    assert exchange_s(FULL, node, 4) == pytest.approx(3 * (2e-3 + 0.12))
    assert adaptive_share(0.3, 10, 40) == pytest.approx(0.225)
    assert adaptive_share(0.3, 10, 5) == 0.0
    s = Step(device={"a": 0.01, "b": 0.02}, host=0.05, exchange=0.001)
    assert s.seconds == pytest.approx(0.081) and s.overlapped == pytest.approx(0.051)
    assert tokens_per_s(10, 0.1) == pytest.approx(100.0)


def test_projection_of_the_archived_rooflines(tmp_path) -> None:
    assert bench_main(["load-projection", "--contexts", "100000",
                       "--out", str(tmp_path / "p.json"), "--md", str(tmp_path / "p.md"),
                       "--plot", str(tmp_path / "p.png")]) == 0  # fmt: skip
    doc = json.loads((tmp_path / "p.json").read_text())
    assert set(doc["provenance"]["inputs"]) == {
        "docs/results/archive/13c7700/roofline_v32-scaled_8k.json",
        "docs/results/archive/13c7700/roofline_glm5-scaled_8k.json",
        "docs/results/census_trace.npz",
    }
    assert (tmp_path / "p.png").stat().st_size > 0 and "| v32 full | 100K |" in (
        tmp_path / "p.md"
    ).read_text()
    shares = doc["host_shares"]["100000"]  # the shipped model's 16K selections, replayed
    assert shares["trace"].endswith("trained_16384") and shares["expansion"] == 4
    assert shares["hot_rows"] == 4096 and 0 < shares["host"] < 1
    assert shares["direct"] + shares["hot"] + shares["host"] == pytest.approx(1)
    for family, f in doc["families"].items():
        plan = plan_pool(family, 100_000)
        assert f["full"]["layers"] == plan.full_layers
        for variant in ("fused", "unfused"):
            x = f["variants"][variant]["100000"]
            caps = x["sessions_per_gpu"]
            assert caps == {"resident": plan.sessions_per_gpu["resident"],
                            "hisparse": plan.sessions_per_gpu["hierarchy"],
                            "adaptive": plan.sessions_per_gpu["hierarchy"]}  # fmt: skip
            for r in x["curve"]:
                assert r["sessions"] == r["concurrency"] <= caps[r["mode"]]
                assert r["step_ms"] == pytest.approx(
                    r["device_ms"] + r["host_ms"] + r["exchange_ms"], abs=2e-3
                )
                assert r["tokens_per_s_per_gpu"] == pytest.approx(
                    r["sessions"] / r["step_ms"] * 1e3, rel=1e-3
                )
                if r["mode"] == "resident":
                    assert r["host_ms"] == 0
    # the fused kernels' steps are the shorter at every point
    f = doc["families"]["glm5-scaled"]["variants"]
    for a, b in zip(f["fused"]["100000"]["curve"], f["unfused"]["100000"]["curve"], strict=True):
        assert a["device_ms"] < b["device_ms"]
    # every mode's curve reaches its sessions per GPU
    for mode, cap in f["fused"]["100000"]["sessions_per_gpu"].items():
        assert (
            max(r["concurrency"] for r in f["fused"]["100000"]["curve"] if r["mode"] == mode) == cap
        )
