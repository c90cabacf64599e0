"""The decode indexer's fused scoring kernel against the torch form (keys gathered through the
page table, widened, then ``index_scores``): interpreter on the CPU, @gpu on the device; keys in
the serving dtype and in the FP8 index-key format, random page tables, ragged visible counts,
widths that are no multiple of the kernel's block, head counts below tl.dot's minimum."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.fp8_kv_format import Fp8RowFormat, index_key_format
from services.worker.ops.fp8_kv import fp8_gather_ref
from services.worker.ops.fp8_kv_codec import pack
from services.worker.ops.index_scores_paged import index_scores_paged
from services.worker.ops.indexer import index_scores


def reference(q, w, keys, table, page, slots, visible, width, fmt):
    rows = torch.arange(width, device=q.device).expand(len(slots), width)
    rows = torch.where(rows < visible.unsqueeze(1), rows, -1)  # as PagedRows.padded_locations
    r = rows.clamp(min=0)
    loc = torch.where(rows >= 0, table[slots.unsqueeze(1), r // page] * page + r % page, -1)
    if fmt is None:
        gathered = keys[loc.clamp(min=0)].masked_fill((loc < 0).unsqueeze(-1), 0)
    else:
        flat = fp8_gather_ref(fmt, keys[:, : fmt.row_bytes], loc.reshape(-1), q.dtype)
        gathered = flat.view(*loc.shape, fmt.width)
    return index_scores(q, w, gathered)


def case(seed, r, h, d, page, pages, dtype, fp8, device, pad_bytes=32, q_dtype=None):
    """R requests with random visible counts over a shuffled page pool; the storage holds
    other rows too (pages no request owns), as a shared pool does."""
    g = torch.Generator().manual_seed(seed)
    slots_total = r + 2
    per_slot = 6
    total_pages = slots_total * per_slot + 3
    table = torch.full((slots_total, per_slot), -1, dtype=torch.int64)
    perm = torch.randperm(total_pages, generator=g)
    for s in range(slots_total):
        table[s] = perm[s * per_slot : (s + 1) * per_slot]
    slots = torch.randperm(slots_total, generator=g)[:r]
    visible = torch.randint(0, per_slot * page + 1, (r,), generator=g)
    visible[0] = per_slot * page  # one request sees every row it has
    width = int(visible.max()) + 5
    table[:, -1] = torch.where(torch.rand(slots_total, generator=g) < 0.5, table[:, -1], -1)
    visible = torch.minimum(visible, (table >= 0).sum(1)[slots] * page)
    n_rows = total_pages * page
    values = torch.randn(n_rows, d, generator=g) * torch.rand(n_rows, 1, generator=g) * 4
    fmt: Fp8RowFormat | None = None
    if fp8:
        fmt = index_key_format(d)
        packed = pack(fmt, values)
        keys = torch.zeros(n_rows, fmt.row_bytes + pad_bytes, dtype=torch.uint8)
        keys[:, : fmt.row_bytes] = packed
    else:
        keys = values.to(dtype)
    q = (torch.randn(r, h, d, generator=g) * 0.5).to(q_dtype or dtype)
    w = torch.randn(r, h, generator=g).float()
    t = [x.to(device) for x in (q, w, keys, table, slots, visible)]
    return (*t[:4], page, t[4], t[5], width, fmt)


def check(args, **kwargs) -> None:
    got = index_scores_paged(*args, **kwargs)
    want = reference(*args)
    assert got.shape == want.shape and got.dtype == torch.float32
    visible, width = args[6], args[7]
    beyond = torch.arange(width, device=got.device).unsqueeze(0) >= visible.unsqueeze(1)
    assert torch.all(got[beyond] == 0)
    scale = want.abs().amax().clamp(min=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=float(scale) * 2e-6)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(
    ("seed", "r", "h", "d", "page", "dtype"),
    [
        (0, 3, 4, 32, 16, torch.float32),
        (1, 2, 32, 128, 64, torch.bfloat16),
        (2, 4, 5, 64, 8, torch.float16),
    ],
)
def test_kernel_matches_torch_form(seed, r, h, d, page, dtype, fp8) -> None:
    check(case(seed, r, h, d, page, 6, dtype, fp8, "cpu"))


@pytest.mark.parametrize("fp8", [False, True])
def test_a_verify_round_scores_each_token_as_a_decode_query(fp8: bool) -> None:
    """A verify round passes K query tokens per request, each with its request's slot and its
    own visible count (``select_rows``): each token's scores are the torch form's, and equal
    bit for bit what the same query scored alone, as a decode pass scores it."""
    q, w, keys, table, page, slots, visible, width, fmt = case(
        4, 3, 8, 64, 16, 6, torch.bfloat16, fp8, "cpu"
    )
    k = 4
    tok_slots = slots.repeat_interleave(k)
    tok_visible = (visible.clamp(min=k) - k).repeat_interleave(k) + torch.arange(k).repeat(3) + 1
    g = torch.Generator().manual_seed(5)
    tq = (torch.randn(3 * k, *q.shape[1:], generator=g) * 0.5).to(q.dtype)
    tw = torch.randn(3 * k, w.shape[1], generator=g)
    args = (tq, tw, keys, table, page, tok_slots, tok_visible, width, fmt)
    check(args)
    got = index_scores_paged(*args)
    for t in (0, 5, 3 * k - 1):
        alone = index_scores_paged(tq[t : t + 1], tw[t : t + 1], keys, table, page,
                                   tok_slots[t : t + 1], tok_visible[t : t + 1], width, fmt)  # fmt: skip
        assert torch.equal(alone[0], got[t])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("split", [None, True, False])
def test_fp32_queries_over_bf16_keys(fp8: bool, split: bool | None) -> None:
    """DeepSeek-V4's indexer queries are fp32 over keys of the serving dtype: scored as three
    bf16 parts (None: chosen so) or by the IEEE dot, each the torch form's exact products."""
    check(case(6, 3, 64, 128, 16, 6, torch.bfloat16, fp8, "cpu", q_dtype=torch.float32),
          split=split)  # fmt: skip


def test_split_needs_fp32_queries_over_keys_bf16_holds() -> None:
    args = case(7, 2, 4, 32, 16, 6, torch.float16, False, "cpu", q_dtype=torch.float32)
    with pytest.raises(ValueError, match="split scores fp32 queries"):
        index_scores_paged(*args, split=True)
    check(args)  # fp16 keys: the IEEE dot


def test_rejects_a_format_of_several_tiles() -> None:
    args = list(case(3, 2, 4, 32, 16, 6, torch.float32, True, "cpu"))
    args[8] = Fp8RowFormat(32, 0, 16, -22)
    with pytest.raises(ValueError, match="one scaled tile"):
        index_scores_paged(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("r", "h", "page"), [(1, 64, 64), (16, 32, 64), (64, 64, 16)])
def test_kernel_matches_torch_form_on_gpu(r, h, page, fp8) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    args = case(r + h, r, h, 128, page, 6, torch.bfloat16, fp8, "cuda")
    check(args)
    # a request's scores do not depend on the rest of the batch
    one = index_scores_paged(*[a[:1] if i in (0, 1, 5, 6) else a for i, a in enumerate(args)])
    assert torch.equal(one[0], index_scores_paged(*args)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("r", [1, 16])
def test_fp32_queries_split_on_gpu(r: int, fp8: bool) -> None:
    """The tensor-core split (three bf16 parts) against the torch form and against the IEEE
    dot: the same exact products summed in another order."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    args = case(r + 11, r, 64, 128, 64, 6, torch.bfloat16, fp8, "cuda", q_dtype=torch.float32)
    check(args, split=True)
    split, ieee = (index_scores_paged(*args, split=s) for s in (True, False))
    scale = float(ieee.abs().amax().clamp(min=1e-6))
    torch.testing.assert_close(split, ieee, rtol=1e-5, atol=scale * 2e-6)
