"""``python -m bench fp4-moe`` on the CPU: its options parse and are checked, and it refuses to
run without CUDA; the timing itself needs CUDA."""

from __future__ import annotations

import pytest
import torch

from bench.core import UsageError
from tests.bench.helpers import bench


def test_help_lists_the_options() -> None:
    proc = bench("fp4-moe", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for opt in ("--experts", "--tokens", "--top-k", "--limit", "--scale-spread", "--no-graph"):
        assert opt in proc.stdout


def test_arguments_parse_and_are_checked() -> None:
    from bench.cli import parser_for
    from bench.fp4_moe import parse, run

    _, parser = parser_for("fp4-moe")
    args = parser.parse_args([])
    assert parse(args) == [(e, t) for e in (256, 32) for t in (1, 4, 16, 64)]
    assert (args.top_k, args.d_model, args.intermediate, args.limit) == (6, 4096, 2048, 10.0)
    assert args.out == "docs/results/fp4_moe.json" and not args.no_graph
    args = parser.parse_args(["--experts", "16", "--tokens", "1,3", "--top-k", "2"])
    assert parse(args) == [(16, 1), (16, 3)]
    with pytest.raises(UsageError, match="--top-k"):
        run(parser.parse_args(["--experts", "4"]))
    with pytest.raises(UsageError, match="multiples of 32"):
        run(parser.parse_args(["--d-model", "100"]))
    with pytest.raises(UsageError, match="--limit"):
        run(parser.parse_args(["--limit", "0"]))
    if not torch.cuda.is_available():
        assert run(parser.parse_args(["--tokens", "1"])) == 2  # needs a CUDA device


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_fails_fast_without_cuda() -> None:
    proc = bench("fp4-moe", "--tokens", "1", "--out", "/tmp/unused_fp4_moe.json", timeout=120)
    assert proc.returncode != 0
    assert "needs a CUDA device" in proc.stderr
