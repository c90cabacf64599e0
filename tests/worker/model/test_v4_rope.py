"""DeepSeek-V4's rotary tables shared by a pass's layers (``v4_rope.PassRope``): one table per
(rope, width), equal to the per-call table, and ``rope_tail`` through it equal to ``rope_tail``
at the bare positions, for both of V4's ropes (plain, YaRN), forward and inverse."""

from __future__ import annotations

import torch

from dhisparse.family.rope_spec import RopeSpec
from services.worker.model.v4_rope import PassRope, rope_tables, rope_tail

YARN = RopeSpec(
    theta=160000.0, kind="yarn", factor=16.0, original_max_position=65536, beta_fast=32.0,
    beta_slow=1.0,
)  # fmt: skip
ROPES = (RopeSpec(theta=10000.0), YARN)


def test_a_pass_computes_each_table_once_and_rotates_as_per_call() -> None:
    g = torch.Generator().manual_seed(11)
    positions = torch.randint(0, 100_000, (6,), generator=g)
    at = PassRope(positions)
    for rope in ROPES:
        first = at.tables(rope, 64)
        assert at.tables(rope, 64) is first
        for got, want in zip(first, rope_tables(positions, rope, 64), strict=True):
            assert torch.equal(got, want)
        x = torch.randn(6, 4, 512, generator=g).to(torch.bfloat16)
        for inverse in (False, True):
            assert torch.equal(
                rope_tail(x, at, rope, 64, inverse), rope_tail(x, positions, rope, 64, inverse)
            )
    assert at.tables(ROPES[0], 32) is not at.tables(ROPES[0], 64)
