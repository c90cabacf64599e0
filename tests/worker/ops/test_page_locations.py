"""The page-table lookup kernel equals its torch form exactly (interpreter on the CPU, @gpu on
the device): random page tables with unassigned pages, -1 rows, one slot per row and one slot
per group of rows (a selection [N, k] with each token's slot)."""

from __future__ import annotations

import pytest
import torch

from services.worker.ops.page_locations import page_locations, page_locations_ref


def case(seed: int, slots_total: int, pages: int, page: int, shape: tuple[int, ...], device):
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(slots_total * pages * 2, generator=g)[: slots_total * pages]
    table = table.view(slots_total, pages)
    held = torch.randint(1, pages + 1, (slots_total,), generator=g)
    table[torch.arange(pages).unsqueeze(0) >= held.unsqueeze(1)] = -1
    slots = torch.randint(0, slots_total, (shape[0],), generator=g)
    limit = (held[slots] * page).view(-1, *([1] * (len(shape) - 1)))
    rows = (torch.rand(shape, generator=g) * limit).long()
    rows[torch.rand(shape, generator=g) < 0.2] = -1
    return table.to(device), slots.to(device), rows.to(device)


@pytest.mark.parametrize(
    ("seed", "page", "shape"), [(0, 64, (7,)), (1, 16, (5, 33)), (2, 8, (3, 2, 9)), (3, 4, (0,))]
)
def test_kernel_equals_torch_form(seed, page, shape) -> None:
    table, slots, rows = case(seed, 6, 5, page, shape, "cpu")
    want = page_locations_ref(table, page, slots, rows)
    assert torch.equal(page_locations(table, page, slots, rows), want)
    full = slots.view(-1, *([1] * (len(shape) - 1))).expand(shape)
    assert torch.equal(page_locations(table, page, full.contiguous(), rows), want)
    assert torch.equal(page_locations_ref(table, page, full, rows), want)


def test_rejects_slots_that_do_not_index_the_rows() -> None:
    table, slots, rows = case(4, 6, 5, 16, (5, 3), "cpu")
    with pytest.raises(ValueError, match="do not index"):
        page_locations(table, 16, slots[:4], rows)


@pytest.mark.gpu
def test_kernel_equals_torch_form_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for seed, shape in enumerate([(64,), (64, 2048), (16, 4, 2048)]):
        table, slots, rows = case(seed, 300, 200, 64, shape, "cuda")
        want = page_locations_ref(table, 64, slots, rows)
        assert torch.equal(page_locations(table, 64, slots, rows), want)
