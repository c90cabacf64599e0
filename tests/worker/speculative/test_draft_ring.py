"""The draft KV ring (eq. 9/10): live positions never collide, slots are disjoint, and the
window a drafter reads equals the last W positions of a plain full history."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse.capacity import ring_address, ring_rows
from services.worker.speculative.draft_ring import DraftRing


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(1, 300),
    k_max=st.integers(1, 16),
    page=st.integers(1, 64),
    lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
)
def test_live_positions_never_collide(
    window: int, k_max: int, page: int, lengths: list[int]
) -> None:
    """At frontier n a slot's live positions are its window n-W .. n-1 and the block of at
    most K_max positions a round commits after reading it: all of them, over all slots, land
    on distinct rows, each inside its slot's range."""
    rd = ring_rows(window, k_max, page)
    seen: set[int] = set()
    for slot, n in enumerate(lengths):
        live = range(max(0, n - window), n + k_max)
        rows = {ring_address(slot, t, rd) for t in live}
        assert len(rows) == len(live)
        assert all(slot * rd <= r < (slot + 1) * rd for r in rows)
        assert not rows & seen
        seen |= rows


@settings(max_examples=50, deadline=None)
@given(
    window=st.integers(1, 40),
    k_max=st.integers(1, 8),
    page=st.integers(1, 16),
    seed=st.integers(0, 10**6),
)
def test_tensor_addresses_are_eq_10(window: int, k_max: int, page: int, seed: int) -> None:
    ring = DraftRing(1, 1, 4, window, k_max, page)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, 4, (64,), generator=g)
    pos = torch.randint(0, 10_000, (64,), generator=g)
    want = [
        ring_address(s, t, ring.rows_per_slot)
        for s, t in zip(slots.tolist(), pos.tolist(), strict=True)
    ]
    assert ring.addresses(slots, pos).tolist() == want


def _rows(slot: int, positions: torch.Tensor, layers: int) -> torch.Tensor:
    """[L, N, 2] recognisable values: (slot*1000 + layer, position)."""
    lay = torch.arange(layers, dtype=torch.float32).view(-1, 1)
    a = (slot * 1000 + lay).expand(layers, len(positions))
    b = positions.float().view(1, -1).expand(layers, -1)
    return torch.stack([a, b], dim=-1)


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(1, 24),
    k_max=st.integers(1, 8),
    page=st.integers(1, 8),
    num_slots=st.integers(1, 4),
    seed=st.integers(0, 10**6),
)
def test_window_equals_full_history(
    window: int, k_max: int, page: int, num_slots: int, seed: int
) -> None:
    """Random prefills, then rounds committing 1..K_max positions, interleaved across slots;
    after every write the window of every slot equals the reference's last W positions."""
    layers = 2
    ring = DraftRing(layers, 2, num_slots, window, k_max, page)
    g = torch.Generator().manual_seed(seed)
    history: dict[int, list[int]] = {s: [] for s in range(num_slots)}  # positions written
    for s in range(num_slots):
        ring.clear(s)
    for _ in range(30):
        s = int(torch.randint(0, num_slots, (1,), generator=g))
        n = len(history[s])
        size = (
            int(torch.randint(1, 3 * window + 5, (1,), generator=g))
            if n == 0
            else int(torch.randint(1, k_max + 1, (1,), generator=g))
        )
        pos = torch.arange(n, n + size)
        rows = _rows(s, pos, layers)
        ring.write(torch.full((size,), s), pos, rows, -rows)
        history[s].extend(pos.tolist())
        slots = torch.arange(num_slots)
        ns = torch.tensor([len(history[i]) for i in range(num_slots)])
        win = ring.window_of(slots, ns)
        for i in range(num_slots):
            want_pos = torch.arange(ns[i] - window, ns[i])
            assert torch.equal(win.positions[i], want_pos)
            assert torch.equal(win.valid[i], want_pos >= 0)
        for layer in range(layers):
            k, v = ring.read(layer, win)
            for i in range(num_slots):
                ok = win.valid[i]
                want = _rows(i, win.positions[i][ok], layers)[layer]
                assert torch.equal(k[i][ok], want)
                assert torch.equal(v[i][ok], -want)


def test_a_reader_never_sees_older_or_unwritten_rows() -> None:
    ring = DraftRing(1, 2, 2, window=4, k_max=2, page_size=1)
    pos = torch.arange(10)
    rows = _rows(0, pos, 1)
    ring.write(torch.zeros(10, dtype=torch.int64), pos, rows, rows)
    # R_d = 6 rows hold positions 4..9. Asking for an earlier frontier shows only the rows
    # still holding the positions asked for: 1..3 were overwritten by 7..9.
    assert ring.rows_per_slot == 6
    win = ring.window_of(torch.tensor([0, 0, 1]), torch.tensor([10, 5, 3]))
    assert win.valid[0].all()
    assert win.positions[1].tolist() == [1, 2, 3, 4]
    assert win.valid[1].tolist() == [False, False, False, True]
    assert not win.valid[2].any()  # slot 1 was never written
    ring.clear(0)
    assert not ring.window_of(torch.tensor([0]), torch.tensor([10])).valid.any()


def test_ring_size_is_eq_9() -> None:
    ring = DraftRing(6, 8, 35, window=2048, k_max=8, page_size=64)
    assert ring.rows_per_slot == ring_rows(2048, 8, 64) == 2176
    assert ring.k.shape == (6, 35 * 2176, 8)
    assert ring.row_bytes == 2 * 6 * 8 * 4 and ring.nbytes == 35 * 2176 * ring.row_bytes
