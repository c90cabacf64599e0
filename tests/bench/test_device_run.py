"""``python -m bench device-run``: every step of every part is a command its subcommand
accepts, a step past its limit is killed with its children, and the part's table reports
each step's status."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest

from bench import device_run, ratios
from bench.cli import COMMANDS, parser_for
from bench.device_run import PARTS, Outcome, Step, report, run_step


@pytest.mark.parametrize("part", sorted(PARTS))
def test_every_step_parses(part: str, tmp_path) -> None:
    for step in PARTS[part]:
        argv = step.argv(tmp_path)[1:]
        assert argv[0] == "-m"
        if argv[1] == "bench":
            name = argv[2]
            assert name in COMMANDS and COMMANDS[name].results, step.name
            _, parser = parser_for(name)
            args = parser.parse_args(argv[3:])
            assert str(args.out).startswith(str(tmp_path)), step.name  # results land in OUT
        else:
            assert argv[1] == "pytest"
    # each step fits the part's default budget (540 s; the budget, not the steps' sum, bounds
    # the part: a step left without time is skipped)
    assert all(s.timeout_s <= 540 for s in PARTS[part])


def test_the_v4_steps_test_v4_on_the_gpu_then_run_what_v4_runs_with(tmp_path) -> None:
    """``scaled-v4``: V4's GPU tests first (the quantized weights', the FP4 MoE's, the index
    scores' and V4.1's candidate blocks' with them), the FP4 MoE's and the fp32 index scores'
    benchmarks, then each weight format with the random model's own selections at 8K and 32K,
    nothing the engine does not serve V4 with."""
    from bench import scaled

    _, parser = parser_for("scaled")
    tests, moe, scores, *runs = PARTS["scaled-v4"]
    assert tests.name == "v4-tests" and "test_v4_gpu.py" in tests.command
    assert "test_v4_quantized_gpu.py" in tests.command and "test_fp4_moe_gpu.py" in tests.command
    assert "test_index_scores_paged.py" in tests.command
    assert "test_v41_candidates.py" in tests.command
    assert moe.command.startswith("-m bench fp4-moe")
    assert scores.command.startswith("-m bench index-scores")
    runs_of = []
    for step in runs:
        args = parser.parse_args(step.argv(tmp_path)[4:])
        fams, ctxs, cs, modes = scaled.parse(args)
        assert (fams, cs, modes) == (["v4flash-scaled"], [1, 4], list(scaled.MODES))
        assert scaled.v4_refused(args, "cuda") == []
        runs_of += [(args.weights, c) for c in ctxs]
    assert runs_of == [(w, c) for w in ("fp8", "fp4", "bf16") for c in (8192, 32768)]


def test_a_step_past_its_limit_is_killed_with_its_children(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "child.wait()\n"
    )
    t0 = time.monotonic()
    done = run_step(Step("sleep", shlex.quote(str(script)), 60), tmp_path, 3, tmp_path / "s.log")
    assert done.status == "timed out after 3 s" and time.monotonic() - t0 < 15
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is delivered; the orphan is reaped by init
        if not Path(f"/proc/{child}").exists() or "Z" in _state(child):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the step's child {child} outlived the step")
    failing = run_step(Step("fail", "-c 'raise SystemExit(3)'", 30), tmp_path, 30,
                       tmp_path / "fail.log")  # fmt: skip
    assert failing.status == "failed (exit 3)"
    assert (tmp_path / "fail.log").read_text().startswith("$ ")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_table_reports_each_step(tmp_path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / f"{device_run.GPU_TESTS.name}.log").write_text("...\n36 passed in 50.1s\n")
    outcomes = [Outcome("gpu-tests", "ok", 51.0), Outcome("spec", "timed out after 90 s", 90)]
    md = report("main", outcomes, tmp_path, logs)
    assert "| gpu-tests | ok | 51 |" in md and "| spec | timed out after 90 s | 90 |" in md
    assert "36 passed in 50.1s" in md and "provenance from git" in md
    assert "| result |" not in md  # no result written: no rows
    # README's rows of the results the part wrote (``bench ratios``), only those
    totals = {"passed": 36, "failed": 0, "error": 0, "skipped": 0, "collection_errors": 0}
    (tmp_path / "gpu_tests.json").write_text(json.dumps({"totals": totals, "provenance": {}}))
    md = report("tests", outcomes, tmp_path, logs)
    assert "| the GPU test suite" in md and "| 36 passed, 0 failed, 0 errors, 0 skipped |" in md
    assert ratios.NOT_MEASURED not in md
