"""``dhisparse plan`` over workers that span GPUs: the sessions of each layout on a hand-checked
case (the paper's GLM-5.3 profile and pool: TP holds one GPU's pool of sessions, DP attention N
of them, which is the paper's 4-GPU total), DeepSeek-V3.2's weights per GPU by part from its
released dims, the pool an HBM size leaves, the table and JSON of ``--layouts all``, and bad
flags refused by name. (The weights against the models the worker builds:
tests/capacity/test_plan_weights.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dhisparse.capacity import GIB, glm53, glm53_paper_deployment, host_bytes, session_bytes
from dhisparse.capacity.layouts import layouts_of
from dhisparse.capacity.plan import build_plan
from dhisparse.capacity.weights import PartBytes, model_weights_of
from dhisparse.cli import main
from dhisparse.family.parallel_layout import ParallelConfig
from tests.fixtures import CONFIGS

ROOT = Path(__file__).resolve().parents[2]
V32 = CONFIGS / "deepseek-v3.2"
NAMES = ["tp", "tp+ep", "dp-attention", "dp-attention+ep"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_sessions_per_layout_by_hand() -> None:
    """GLM-5.3 at 100,000 tokens on the paper's 22.75 GiB pool per GPU: 0.432 GiB a session in
    the hierarchy (52 per pool), 4.444 GiB resident (5), 35 and 3 with DFlash2. A TP worker's
    ranks all store every session: one pool's worth. Under DP attention each rank holds its
    own: 4 x 52 = 208 and 4 x 35 = 140, the paper's totals over 4 GPUs. A node of 8 GPUs runs
    two workers; its host holds one backup per session (4.494 GB each)."""
    profile, dep = glm53(), glm53_paper_deployment()
    assert dep.pool_bytes is not None
    drafter = profile.drafter("dflash2")
    hierarchy = session_bytes(profile, 100_000, "hierarchy")
    assert dep.pool_bytes // hierarchy.total == 52
    node = dep.with_overrides(gpus=8)
    plan = build_plan(profile, 100_000, drafter, node, layouts=layouts_of(4, "all"))
    assert [lp.name for lp in plan.layouts] == NAMES
    expected = {  # (mode, drafter) -> sessions per worker: TP, DP attention
        ("resident", None): (5, 20),
        ("hierarchy", None): (52, 208),
        ("resident", "dflash2"): (3, 12),
        ("hierarchy", "dflash2"): (35, 140),
    }
    for lp in plan.layouts:
        dp = lp.parallel.data_parallel_attention
        assert lp.workers == 2 and lp.weights is None and lp.pool_bytes == dep.pool_bytes
        for (mode, d), (tp_n, dp_n) in expected.items():
            a = lp.admitted(mode, d)
            assert a is not None
            assert a.per_gpu == tp_n
            assert a.per_worker == (dp_n if dp else tp_n)
            assert a.per_node == 2 * a.per_worker
        sessions = 2 * (208 if dp else 52)
        assert lp.host.sessions == sessions
        assert lp.host.bytes == sessions * host_bytes(profile, 100_000)
        assert lp.host.holds == 956  # a 4.3 TB host, whatever the layout
    dp_node = plan.layouts[2]
    assert round(dp_node.host.bytes / 2 / 1e12, 3) == 0.935  # the paper's 208 sessions


def test_deepseek_v32_weights_per_gpu_by_hand() -> None:
    """The released DeepSeek-V3.2 (FP8 e4m3, fp32 scales per 128 x 128 block) over 8 GPUs, from
    its dims: hidden 7168, 128 heads of 192 (q) and 128 (v) dims, q_lora 1536, kv_lora 512 +
    64 rope, 61 layers (3 dense), 256 experts of 2048, kv_b held in bf16 (absorbed MLA)."""
    weights = model_weights_of(V32)
    assert weights is not None and weights.fp8 and weights.dtype == "bfloat16"
    latent = (1536 * 7168 + 12 * 56 * 4 + 1536 * 2) + (576 * 7168 + 5 * 56 * 4 + 512 * 2)
    heads = (24576 * 1536 + 192 * 12 * 4) + 32768 * 512 * 2 + (7168 * 16384 + 56 * 128 * 4)
    expert = 3 * 2048 * 7168 + (2 * 16 * 56 + 56 * 16) * 4  # gate, up, down and their grids
    tp, tp_ep, dp, dp_ep = (weights.per_rank(c) for c in layouts_of(8, "all"))
    for w in (tp, tp_ep, dp, dp_ep):
        assert w.part("mla_latent") == PartBytes("mla_latent", 61 * latent, 0)
        assert w.part("routed_experts").split == 58 * 256 * expert // 8
        assert w.whole == weights.total
    assert tp.part("mla_heads").split == 61 * heads // 8
    assert dp.part("mla_heads").replicated == 61 * heads
    # under DP attention the vocabulary is whole on every rank: embed and lm_head in bf16
    assert dp.part("vocab").replicated == 2 * 129280 * 7168 * 2
    assert tp.part("vocab").split == 2 * 129280 * 7168 * 2 // 8
    assert tp.total == tp_ep.total < dp.total == dp_ep.total


def test_the_pool_an_hbm_size_leaves(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(V32), "--context", "131072", "--kv-cache-dtype", "fp8",
            "--tensor-parallel-size", "8", "--layouts", "all", "--gpu-gib", "139",
            "--reserve-gib", "10", "--gpus", "16", "--json"]  # fmt: skip
    rc, out, _ = run(argv, capsys)
    assert rc == 0
    plan = json.loads(out)
    session = plan["base"]["hierarchy"]["total"]
    weights = model_weights_of(V32)
    assert weights is not None
    for lp, cfg in zip(plan["layouts"], layouts_of(8, "all"), strict=True):
        pool = 139 * GIB - lp["weights"]["total"] - 10 * GIB
        assert lp["weights"]["total"] == weights.per_rank(cfg).total
        assert lp["pool_bytes"] == pool > 0
        assert lp["workers"] == 2 and lp["serving_ranks"] == (8 if "dp" in lp["name"] else 1)
        (hier,) = [a for a in lp["admissions"] if a["mode"] == "hierarchy"]
        assert hier["per_gpu"] == pool // session
        assert hier["per_worker"] == hier["per_gpu"] * lp["serving_ranks"]
        assert hier["per_node"] == 2 * hier["per_worker"]


def test_layouts_all_prints_every_layout(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(V32), "--context", "131072", "--tensor-parallel-size", "8",
            "--gpu-gib", "139"]  # fmt: skip
    rc, out, _ = run([*argv, "--layouts", "all"], capsys)
    assert rc == 0
    lines = out.splitlines()
    start = lines.index("workers of 8 GPUs, 8 GPUs per node (1 worker)")
    lines = lines[start:]
    assert lines[1].split() == NAMES
    for label in ("MLA latent (q_a, kv_a, norms)", "MLA heads (q_b, kv_b, o)", "routed experts",
                  "embeddings and lm_head", "total", "pool", "hierarchy"):  # fmt: skip
        (row,) = [line for line in lines if line.strip().startswith(label + " ")]
        cells = row.strip()[len(label) :].split()
        assert len([c for c in cells if c[0].isdigit()]) == 4, row
    heads = next(line for line in lines if "MLA heads" in line).split()[-8:]
    assert heads[1::2] == ["s", "s", "r", "r"]  # split by head under TP, whole under DP
    rc, out, _ = run([*argv, "--layouts", "tp+ep,dp-attention+ep"], capsys)
    assert rc == 0 and "tp+ep" in out and " tp " not in out
    # the worker's own flags: one layout
    rc, out, _ = run([*argv, "--data-parallel-attention", "--expert-parallel", "--json"], capsys)
    assert rc == 0
    assert [lp["name"] for lp in json.loads(out)["layouts"]] == ["dp-attention+ep"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--tensor-parallel-size", "8", "--layouts", "tp,bogus"], "--layouts 'tp,bogus'"),
        (["--layouts", "all"], "--layouts needs --tensor-parallel-size"),
        (["--tensor-parallel-size", "8", "--layouts", "all", "--expert-parallel"],
         "leave out --expert-parallel"),
        (["--expert-parallel"], "need --tensor-parallel-size >= 2"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1"),
        (["--tensor-parallel-size", "4", "--gpus", "6"], "--gpus 6 per node is not a multiple"),
        (["--tensor-parallel-size", "3"],
         "tp over 3 ranks splits attention heads (num_attention_heads) = 128 3 ways"),
        (["--reserve-gib", "8"], "--reserve-gib is taken from --gpu-gib"),
    ],
)  # fmt: skip
def test_bad_flags_are_refused_by_name(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run(["--model", str(V32), "--context", "1000", *extra], capsys)
    assert rc == 2
    assert err.startswith("dhisparse plan: error: ") and message in err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--gpu-gib", "80"], "--gpu-gib needs the model's weights"),
        (["--tensor-parallel-size", "4", "--dtype", "float32"],
         "--dtype and --weight-dtype size a model's weights"),
        (["--weight-dtype", "bf16"], "--dtype and --weight-dtype size the weights of a layout"),
    ],
)  # fmt: skip
def test_a_profile_without_weights(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run(["--profile", "glm-5.3", "--context", "1000", *extra], capsys)
    assert rc == 2 and message in err
    # its sessions per layout need only the pool
    rc, out, _ = run(["--profile", "glm-5.3", "--context", "1000", "--tensor-parallel-size", "4"],
                     capsys)  # fmt: skip
    assert rc == 0 and "weights per GPU: not known for glm-5.3" in out


def test_a_pool_and_an_hbm_size_exclude_each_other() -> None:
    with pytest.raises(SystemExit) as e:
        main(
            ["plan", "--profile", "glm-5.3", "--context", "1", "--pool-gib", "1", "--gpu-gib", "2"]
        )
    assert e.value.code == 2


def test_one_gpu_alone_is_the_single_layout() -> None:
    weights = model_weights_of(CONFIGS / "glm-5.2")
    assert weights is not None and not weights.fp8
    single = weights.per_rank(ParallelConfig())
    assert single.layout == "single" and single.split == 0 and single.total == weights.total


def test_layouts_import_no_torch() -> None:
    code = (
        "import sys\n"
        "from dhisparse.cli import main\n"
        f"assert main(['plan', '--model', {str(V32)!r}, '--context', '100', "
        "'--tensor-parallel-size', '8', '--layouts', 'all', '--gpu-gib', '139']) == 0\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
