"""``python -m bench fp8-linear`` on the CPU: its options parse and are checked; the timing
itself needs CUDA (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from bench.core import UsageError
from tests.bench.helpers import bench


def test_help_lists_the_options() -> None:
    proc = bench("fp8-linear", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for opt in ("--shapes", "--m", "--repeats", "--inner", "--no-graph", "--scale-dtype", "--out"):
        assert opt in proc.stdout


def test_arguments_parse_and_are_checked() -> None:
    from bench.cli import parser_for
    from bench.fp8_linear import SHAPES, parse, run

    _, parser = parser_for("fp8-linear")
    args = parser.parse_args([])
    assert parse(args) == (list(SHAPES), [1, 16, 64, 256])
    assert args.out == "docs/results/fp8_linear.json" and not args.no_graph
    args = parser.parse_args(["--shapes", "kv_a_proj_with_mqa", "--m", "1,3", "--no-graph"])
    assert parse(args) == (["kv_a_proj_with_mqa"], [1, 3]) and args.no_graph
    with pytest.raises(UsageError, match="unknown shapes"):
        run(parser.parse_args(["--shapes", "o_proj"]))
    with pytest.raises(UsageError, match="--m"):
        run(parser.parse_args(["--m", "0"]))
    if not torch.cuda.is_available():
        assert run(parser.parse_args(["--m", "1"])) == 2  # needs a CUDA device


def test_alternate_rotates_the_first_timer() -> None:
    from bench.core.lockstep import alternate

    calls: list[str] = []

    def timer(name: str):
        return lambda: calls.append(name) or float(len(calls))

    times = alternate({v: timer(v) for v in "abc"}, 4)
    assert calls == list("abcbcacababc")
    assert times == {
        "a": [1.0, 6.0, 8.0, 10.0],
        "b": [2.0, 4.0, 9.0, 11.0],
        "c": [3.0, 5.0, 7.0, 12.0],
    }
