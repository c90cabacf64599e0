"""``python -m bench sparse-attention`` and ``python -m bench select-topk`` on the CPU: their
options are checked, and every variant they time gives the baseline's result at small shapes
(interpreter); the timing itself needs CUDA."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench.core import UsageError


def test_sparse_attention_variants_agree_with_the_default() -> None:
    from bench.sparse_attention import variants

    args = argparse.Namespace(pool_rows=64, k=32)
    g = torch.Generator().manual_seed(0)
    for kv in ("bf16", "fp8"):
        fns, shapes, read = variants(16, 1, kv, args, g, torch.device("cpu"))
        assert set(fns) == set(shapes) and read == 32 * (1152 if kv == "bf16" else 656)
        want = fns["default" if kv == "bf16" else "gather+default"]().float()
        for name, fn in fns.items():
            torch.testing.assert_close(fn().float(), want, rtol=2e-2, atol=2e-2, msg=name)


def test_select_topk_variants_give_torch_positions() -> None:
    from bench.select_topk import variants

    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 600, generator=g)
    visible = torch.tensor([600, 350])
    fns = variants(scores, visible, 16)
    want = fns["torch"]()
    assert {"torch", "bitonic"} < set(fns)
    for name, fn in fns.items():
        assert torch.equal(fn(), want), name


def test_options_are_checked() -> None:
    from bench.cli import parser_for
    from bench.select_topk import run as run_topk
    from bench.sparse_attention import run as run_attention

    _, parser = parser_for("sparse-attention")
    with pytest.raises(UsageError, match="--kv"):
        run_attention(parser.parse_args(["--kv", "fp4"]))
    with pytest.raises(UsageError, match="--families"):
        run_attention(parser.parse_args(["--families", "v4"]))
    _, parser = parser_for("select-topk")
    with pytest.raises(UsageError, match="positive"):
        run_topk(parser.parse_args(["--k", "0"]))
    if not torch.cuda.is_available():
        assert run_topk(parser.parse_args([])) == 2  # needs a CUDA device
        assert run_attention(parser_for("sparse-attention")[1].parse_args([])) == 2
