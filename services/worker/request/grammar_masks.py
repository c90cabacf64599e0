"""One pass's grammar masks for its whole batch: every constrained request's rows filled into
one host bitmask by xgrammar's batch matcher (its threads, all requests at once), copied to the
device in one transfer and applied to the pass's logits by one kernel.

A pass fills its masks right after it launches its forward, so the host fills them while the
device computes; the copy and the kernel queue behind the forward on the logits' stream."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from services.worker.request.grammar_state import GrammarState


@dataclass(frozen=True)
class Block:
    """A request's rows in a pass's logits: ``rows`` rows from row ``first``; row i scores its
    next token after its output and ``drafts[:i]`` (a decode row: one row, no drafts; a verify
    block of K rows: its K - 1 proposals, later ones ignored)."""

    grammar: GrammarState
    first: int
    rows: int
    drafts: Sequence[int] = ()

    def __post_init__(self) -> None:
        if len(self.drafts) < self.rows - 1:
            raise ValueError(
                f"{self.rows} rows need {self.rows - 1} drafts, given {len(self.drafts)}"
            )


def default_threads() -> int:
    """Threads that fill a pass's masks: half the machine's cores (xgrammar's advice), at most
    8, at least 1."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


@functools.cache
def _batch_matcher(threads: int) -> xgr.BatchGrammarMatcher:
    """One batch matcher, with its pool of ``threads`` threads, per thread count for the
    whole process: every engine of the process fills its masks with it."""
    return xgr.BatchGrammarMatcher(threads)


class GrammarMasks:
    """The masks of one pass at a time, in one reused host buffer (pinned for a GPU)."""

    def __init__(self, vocab_size: int, device: torch.device, threads: int | None = None) -> None:
        """``vocab_size``: the logits' width (the compiled grammars' tokenizer info's);
        ``threads``: the fill's threads (None: ``default_threads()``)."""
        self.vocab_size = vocab_size
        self.device = device
        self.threads = default_threads() if threads is None else threads
        self.words = xgr.get_bitmask_shape(1, vocab_size)[1]
        self._matcher = _batch_matcher(self.threads)
        self._host = torch.empty((0, self.words), dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None  # the last copy out of the host buffer
        self._pending: tuple[torch.Tensor, list[int]] | None = None  # filled, not yet applied

    def fill(self, blocks: Sequence[Block]) -> None:
        """Fills the blocks' masks on the host for the next ``apply`` (no block: it does
        nothing). Row i of a block is the mask after its output and ``drafts[:i]``: the drafts
        are accepted depth by depth while filling and rolled back after, so every grammar's
        state is unchanged. Rows after a draft its grammar rejects, or after one that terminates
        it, allow everything: a verification that reaches them has accepted that draft, which
        the mask of its own row forbids (or the output ended at it)."""
        self._pending = None
        if not blocks:
            return
        host = self._buffer(max(b.first + b.rows for b in blocks))
        rows = [b.first + i for b in blocks for i in range(b.rows)]
        host[rows] = -1
        accepted = [0] * len(blocks)
        alive = [n for n, b in enumerate(blocks) if not b.grammar.terminated]
        depth = 0
        while alive:
            self._matcher.batch_fill_next_token_bitmask(
                [blocks[n].grammar.matcher for n in alive],
                host,
                [blocks[n].first + depth for n in alive],
            )
            alive = [n for n in alive if depth < blocks[n].rows - 1]
            if not alive:
                break
            ok = xgr.BatchGrammarMatcher.batch_accept_token(
                [blocks[n].grammar.matcher for n in alive], [blocks[n].drafts[depth] for n in alive]
            )
            alive = [n for n, good in zip(alive, ok, strict=True) if good]
            for n in alive:
                accepted[n] += 1
            alive = [n for n in alive if not blocks[n].grammar.terminated]
            depth += 1
        back = [n for n, k in enumerate(accepted) if k]
        if back:
            xgr.BatchGrammarMatcher.batch_rollback(
                [blocks[n].grammar.matcher for n in back], [accepted[n] for n in back]
            )
        self._pending = (host, rows)

    def apply(self, logits: torch.Tensor) -> None:
        """logits: the pass's [n, V] fp32 rows, shaped otherwise: every token a row's grammar
        forbids is set to -inf, in place, by the masks of the last ``fill``; the rows of
        unconstrained requests are left alone. For a GPU the masks go in one copy without
        blocking, whose end the next fill waits for."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits of {logits.shape[-1]} tokens, masks of {self.vocab_size}")
        host, rows = pending
        mask = host
        if logits.is_cuda:
            mask = host.to(logits.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)

    def _buffer(self, rows: int) -> torch.Tensor:
        """The host buffer's first ``rows`` rows, once the last copy out of it has been read."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._host.shape[0] < rows:
            size = max(rows, 2 * self._host.shape[0])
            pinned = self.device.type == "cuda"
            self._host = torch.empty((size, self.words), dtype=torch.int32, pin_memory=pinned)
        return self._host[:rows]
