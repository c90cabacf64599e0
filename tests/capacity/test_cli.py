"""``dhisparse plan``: table, JSON, profile sources, errors, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dhisparse.capacity import GIB, glm53, session_bytes
from dhisparse.cli import main
from dhisparse.family.presets import PRESETS, preset_topology

PAPER = ["plan", "--profile", "glm-5.3", "--context", "100000", "--drafter", "dflash2"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_paper_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(PAPER, capsys)
    assert rc == 0
    for figure in ("4.444", "0.432", "4.469", "0.492", "ratio 10.3×", "R_d=2176"):
        assert figure in out
    for figure in ("0.872 GiB", "1.230 GiB", "23.994 GiB", "÷19.5", "0.060 GiB", "6.600 GiB"):
        assert figure in out
    assert "5 (20)" in out and "52 (208)" in out
    assert "3 (12)" in out and "35 (140)" in out
    assert "0.935 TB" in out and "956 sessions" in out
    assert "140/208 = 0.67" in out


def test_paper_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run([*PAPER, "--json", "--tpot-ratio", "0.71"], capsys)
    assert rc == 0
    data = json.loads(out)
    expected = session_bytes(glm53(), 100_000, "hierarchy", glm53().drafter("dflash2"))
    assert data["spec"]["hierarchy"]["total"] == expected.total
    assert data["slots"]["ring_rows"] == 2176
    assert data["speculation"] == {
        "n_spec": 140,
        "n_base": 208,
        "load": None,
        "share": 140 / 208,
        "tpot_ratio": 0.71,
        "pays": False,
    }
    assert round(data["base"]["resident"]["total"] / GIB, 3) == 4.444


def test_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*PAPER, "--pool-gib", "80", "--gpus", "1", "--slots", "35", "--host-tb", "2"]
    rc, out, _ = run([*argv, "--hot-cache-rows", "2048", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["profile"]["hot_cache_rows"] == 2048
    assert data["deployment"]["note"] == ""  # a given pool is not the paper's implied one
    spec = [a for a in data["admissions"] if a["drafter"] == "dflash2"]
    assert max(a["per_gpu"] for a in spec) == 35  # capped by the slots


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["plan", "--profile", name, "--context", "4096", "--pool-gib", "1"], capsys)
    assert rc == 0
    assert f"dhisparse plan: {name} at 4,096 tokens" in out


def test_model_dir_and_custom_drafter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    preset_topology("tiny-glm").save(tmp_path / "config.json")
    drafter = ["--draft-window", "64", "--draft-k-max", "4", "--draft-row-bytes", "512"]
    argv = ["plan", "--model", str(tmp_path), "--context", "1000", "--pool-gib", "0.5"]
    rc, out, _ = run([*argv, *drafter], capsys)
    assert rc == 0
    assert "drafter custom" in out and "R_d=192" in out


@pytest.mark.parametrize(
    "extra",
    [
        ["--draft-window", "64"],  # a custom drafter needs all three sizes
        ["--kv-dtype-bytes", "2"],  # built-in profiles give bytes
        ["--drafter", "no-such-drafter"],
    ],
)
def test_errors(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["plan", "--profile", "glm-5.3", "--context", "1000", *extra], capsys)
    assert rc == 2
    assert "dhisparse plan: error:" in err


def test_plan_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from dhisparse.cli import main\n"
        "assert main(['plan', '--profile', 'tiny-dsv4', '--context', '100']) == 0\n"
        "assert main(['plan', '--profile', 'glm-5.3', '--context', '100', '--json']) == 0\n"
        "import dhisparse.capacity, dhisparse.family.config, dhisparse.family.presets\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
