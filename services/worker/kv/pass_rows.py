"""What of a pass's rows its host knows before launch: the widths its passes gather rows at, and
the compressed rows its chunks complete.

A compressed source of rate m stores one row per m tokens (eq. 8): a pass completes row w of a
request when its chunk covers position ``(w + 1) * m - 1``. Which rows a pass completes is a
function of the batch's starts and lengths, so the host plans it (``plan_completions``) and
uploads it with one copy; a model pools and writes exactly those rows, with no shape read from
the device. A decode or verify pass pads its list to a power of two by repeating its last entry
(the same row pooled again from the same inputs, written again with the same bits), so a CUDA
graph captured for one count replays for every count of its bucket; a pass that completes no
row writes none. Widths are bucketed the same way (``key_rows``, ``visible_width``): eager and
captured passes use the same widths and compute the same bits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.transfers import to_device

if TYPE_CHECKING:
    from dhisparse.family.config import ModelConfig


def source_rates(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """(compression rate, lag) of each of the model's sources, as ``PassState`` takes them."""
    return tuple((src.compress, src.lag) for src in cfg.sources)


def key_rows(rows: int) -> int:
    """The index-key width a decode pass gathers when its longest request sees ``rows`` rows:
    rounded up to an eighth of its power of two (>= 256), so the width, and with it a captured
    decode graph, changes once every few thousand tokens, at most 12.5% (and 255 rows) over.
    Eager and captured passes use the same width, so they compute the same scores."""
    step = max(256, 1 << max(0, rows.bit_length() - 4))
    return -(-rows // step) * step


def visible_width(rows: int) -> int:
    """The width of a selection of every visible row (DeepSeek-V4's HCA layers) when the
    longest request sees ``rows`` rows: the next power of two up to 256, then ``key_rows``."""
    rows = max(1, rows)
    return 1 << (rows - 1).bit_length() if rows <= 256 else key_rows(rows)


def completion_bucket(count: int) -> int:
    """The entries a decode or verify pass's list of ``count`` completed rows is padded to."""
    return 0 if count == 0 else 1 << (count - 1).bit_length()


@dataclass(frozen=True)
class CompletedRows:
    """The rows of rate ``rate`` a pass completes: entry j is row ``rows[j]`` of batch request
    ``reqs[j]`` (device int64 [G]); entries past the real ones repeat the last real one."""

    rate: int
    reqs: torch.Tensor
    rows: torch.Tensor


def completed_pairs(
    starts: tuple[int, ...], lens: tuple[int, ...], rate: int
) -> tuple[list[int], list[int]]:
    """(batch request, row index) of every row of ``rate`` tokens the chunks complete: rows
    ``start // rate .. (start + len) // rate - 1`` of each request."""
    reqs, rows = [], []
    for r, (start, n) in enumerate(zip(starts, lens, strict=True)):
        span = range(start // rate, (start + n) // rate)
        reqs += [r] * len(span)
        rows += span
    return reqs, rows


def plan_completions(
    starts: tuple[int, ...],
    lens: tuple[int, ...],
    rates: tuple[int, ...],
    device: torch.device | str,
    pad: bool,
) -> tuple[dict[int, CompletedRows], torch.Tensor | None]:
    """Per rate (> 1) of ``rates``, the rows the chunks complete (none: no entry), and the one
    device tensor [2, G] every ``CompletedRows`` is a view of (None when there are none), so a
    CUDA graph's copy of it is refilled with one copy. ``pad``: each list padded to its
    ``completion_bucket`` (decode and verify passes)."""
    lists = {}
    for m in rates:
        reqs, rows = completed_pairs(starts, lens, m)
        if not reqs:
            continue
        extra = completion_bucket(len(reqs)) - len(reqs) if pad else 0
        lists[m] = (reqs + reqs[-1:] * extra, rows + rows[-1:] * extra)
    if not lists:
        return {}, None
    flat = to_device([[x for v in lists.values() for x in v[i]] for i in (0, 1)], device)
    out, at = {}, 0
    for m, (reqs, _) in lists.items():
        out[m] = CompletedRows(m, flat[0, at : at + len(reqs)], flat[1, at : at + len(reqs)])
        at += len(reqs)
    return out, flat
