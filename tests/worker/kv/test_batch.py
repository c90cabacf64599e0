"""ForwardBatch against a plain-Python construction, decode steps (the fast path) included."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker.kv.batch import ForwardBatch


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("decode", [True, False])
def test_build_matches_a_plain_construction(seed: int, decode: bool, device: str) -> None:
    """On a GPU the batch crosses in one asynchronous copy out of pinned memory."""
    rng = random.Random(seed)
    r = rng.randint(1, 9)
    slots = rng.sample(range(32), r)
    starts = [rng.randint(0, 500) for _ in range(r)]
    lens = [1 if decode else rng.randint(1, 7) for _ in range(r)]
    b = ForwardBatch.build(slots, starts, lens, device)
    req = [i for i, n in enumerate(lens) for _ in range(n)]
    assert b.token_req.tolist() == req
    assert b.positions.tolist() == [starts[i] + j for i, n in enumerate(lens) for j in range(n)]
    assert b.token_slot.tolist() == [slots[i] for i in req]
    assert b.cu_lens.tolist() == [sum(lens[:i]) for i in range(r + 1)] == list(b.cu)
    assert b.slot_ids == tuple(slots)  # the host copy the hierarchy reads without a sync
    assert b.slots.tolist() == slots and b.starts_t.tolist() == starts
    assert b.is_decode == decode or max(lens) == 1
    for t in (b.slots, b.positions, b.token_req, b.token_slot, b.cu_lens, b.starts_t):
        assert t.dtype == torch.int64 and t.device.type == device
