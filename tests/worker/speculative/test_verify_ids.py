"""The verify pass's new tokens built on the device (``proposal.verify_ids``) against the host's
list: anchor, the first K_r - 1 proposals, then the anchor again up to the queries passed."""

from __future__ import annotations

import pytest
import torch

from services.worker.speculative.proposal import finish, verify_ids


def host_ids(tokens: list[list[int]], anchors, widths, passed) -> list[int]:
    ids: list[int] = []
    for r, anchor in enumerate(anchors):
        ids.extend([anchor, *tokens[r][: widths[r] - 1]])
        ids.extend([anchor] * (passed[r] - widths[r]))
    return ids


@pytest.mark.parametrize("seed", range(6))
def test_device_ids_equal_the_hosts(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    r = int(torch.randint(1, 7, (1,), generator=g))
    kmax = int(torch.randint(1, 9, (1,), generator=g))
    widths = torch.randint(1, kmax + 1, (r,), generator=g).tolist()
    # every request at K_max, or each at its own width (a request near its end without room)
    passed = [kmax] * r if seed % 2 else list(widths)
    anchors = torch.randint(0, 1000, (r,), generator=g).tolist()
    prop = finish(torch.randint(0, 1000, (r, max(kmax - 1, 0)), generator=g), None, widths)
    got = verify_ids(prop.tokens, anchors, widths, passed)
    assert got.dtype == torch.int64
    assert got.tolist() == host_ids(prop.tokens.tolist(), anchors, widths, passed)


def test_every_request_at_full_width() -> None:
    """The usual round: every request verifies K_max queries (its anchor, then K_max - 1
    proposals)."""
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    got = verify_ids(finish(tokens, None, [4, 4]).tokens, [1, 2], [4, 4], [4, 4])
    assert got.tolist() == [1, 5, 6, 7, 2, 8, 9, 10]
