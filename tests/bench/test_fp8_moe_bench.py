"""``python -m bench fp8-moe`` on the CPU: its options parse and are checked, and it refuses to
run without CUDA; the timing itself needs CUDA (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from bench.core import UsageError
from tests.bench.helpers import bench


def test_help_lists_the_options() -> None:
    proc = bench("fp8-moe", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for opt in ("--experts", "--tokens", "--top-k", "--repeats", "--inner", "--no-graph", "--out"):
        assert opt in proc.stdout


def test_arguments_parse_and_are_checked() -> None:
    from bench.cli import parser_for
    from bench.fp8_moe import parse, run

    _, parser = parser_for("fp8-moe")
    args = parser.parse_args([])
    assert parse(args) == [(e, t) for e in (64, 256) for t in (1, 16, 64, 256)]
    assert (args.top_k, args.d_model, args.intermediate) == (8, 7168, 2048)
    assert args.out == "docs/results/fp8_moe.json" and not args.no_graph
    args = parser.parse_args(["--experts", "16", "--tokens", "1,3", "--top-k", "2", "--no-graph"])
    assert parse(args) == [(16, 1), (16, 3)] and args.no_graph
    with pytest.raises(UsageError, match="--top-k"):
        run(parser.parse_args(["--experts", "4"]))
    with pytest.raises(UsageError, match="--tokens"):
        run(parser.parse_args(["--tokens", "0"]))
    with pytest.raises(UsageError, match="--experts"):
        run(parser.parse_args(["--experts", "x"]))
    if not torch.cuda.is_available():
        assert run(parser.parse_args(["--tokens", "1"])) == 2  # needs a CUDA device


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_fails_fast_without_cuda() -> None:
    proc = bench("fp8-moe", "--tokens", "1", "--out", "/tmp/unused_fp8_moe.json", timeout=120)
    assert proc.returncode != 0
    assert "needs a CUDA device" in proc.stderr
