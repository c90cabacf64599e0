"""One pass's grammar masks for its whole batch, filled by a thread of their own.

The masks are filled by a thread (``mask_filler.MaskFiller``, started at the first constrained
pass, stopped with the engine) with xgrammar's batch matcher, which fills a job's rows without
Python's interpreter lock, so the engine's thread goes on with its pass meanwhile. The thread
fills from the requests' own matchers (``GrammarState``): no copy of a matcher is kept
anywhere, nothing is sent between processes, and a decode step's work on the engine's thread is
a few operations per constrained request. While a job is queued or running its matchers are the
thread's: the engine advances a request's matcher (``emission``) only after ``apply``, which
waits for every job submitted.

- ``prefetch``, after a step's tokens are accepted: the next decode row of every constrained
  request still running is filled while the engine finishes that step and begins the next.
- ``fill``, after a pass is launched: the rows that were not filled ahead (a prefill's first
  token, a verify block with its drafts, a request whose tokens changed since) are asked for
  (``fill_decode``: a pass that samples one row per request, without building its blocks).
- ``apply``, once the pass's logits are shaped otherwise: the rows are gathered, copied to the
  device in one transfer and applied by one kernel; rows of unconstrained requests are left
  alone."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from services.worker.request.grammar_state import GrammarState
from services.worker.request.mask_filler import FillBlock, MaskFiller
from services.worker.request.request import Request

# the batch matcher's threads: one for every this many of the host's cores, at most MAX_THREADS
CORES_PER_THREAD, MAX_THREADS = 4, 4


def default_threads(cores: int | None = None) -> int:
    """The threads a host of ``cores`` (default: this one's) fills masks on: one per
    ``CORES_PER_THREAD`` cores, at least one, at most ``MAX_THREADS`` (the engine's thread
    and its device work keep the rest)."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    return max(1, min(MAX_THREADS, cores // CORES_PER_THREAD))


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


def decode_blocks(reqs: Sequence[Request]) -> list[Block]:
    """The blocks of a pass that samples one row per request, row j ``reqs[j]``'s."""
    return [Block(r.grammar, j, 1) for j, r in enumerate(reqs) if r.grammar is not None]


# a request's rows of one pass: (its grammar, first row, rows, drafts), as ``Block`` holds them
Rows = tuple[GrammarState, int, int, Sequence[int]]


class GrammarMasks:
    """The masks of one pass at a time."""

    def __init__(
        self, vocab_size: int, device: torch.device, max_rows: int, max_seqs: int | None = None,
        threads: int | None = None,
    ) -> None:  # fmt: skip
        """``vocab_size``: the logits' width (the compiled grammars' tokenizer info's);
        ``max_rows``: the most rows one pass samples (sequences times the verify width), the
        rows of the buffer filled on demand; ``max_seqs``: the most sequences a pass holds,
        the rows of the buffer filled ahead (one per decoding sequence; default ``max_rows``);
        ``threads``: the batch matcher's threads (default ``default_threads()``)."""
        self.vocab_size = vocab_size
        self.device = device
        self.words = xgr.get_bitmask_shape(1, vocab_size)[1]
        self.max_rows = max_rows
        self.max_seqs = min(max_rows, max_seqs or max_rows)
        self.threads = default_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"at least one thread fills grammar masks, not {self.threads}")
        self._filler: MaskFiller | None = None  # started by the first constrained pass
        self._filled_ahead = np.zeros((self.max_seqs, self.words), dtype=np.int32)
        self._filled = np.zeros((max_rows, self.words), dtype=np.int32)
        self._ahead: dict[int, tuple[int, int]] = {}  # request id -> (row, tokens) filled ahead
        # the pass's rows: (the logits' rows that have a mask; those of the rows filled ahead
        # and theirs there; those filled on demand, in order)
        self._pending: tuple[list[int], list[int], list[int], list[int]] | None = None
        pinned = device.type == "cuda"
        self._host = torch.empty((max_rows, self.words), dtype=torch.int32, pin_memory=pinned)
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host

    @property
    def started(self) -> bool:
        """A constrained pass has started the filling thread (and no failure stopped it)."""
        return self._filler is not None

    def prefetch(self, running: Sequence[Request], ahead: bool) -> None:
        """After a step's tokens are accepted: with ``ahead`` (the next pass decodes one row
        each) the next rows of the constrained requests of ``running`` are filled while the
        engine goes on, at most ``max_seqs`` of them."""
        self._ahead = {}
        if self._filler is None or not ahead:
            return
        blocks: list[FillBlock] = []
        filled: dict[int, tuple[int, int]] = {}
        for r in running:
            st = r.grammar
            if st is None or st.terminated:
                continue
            if len(blocks) == self.max_seqs:
                break
            filled[st.id] = (len(blocks), len(st.tokens))
            blocks.append((st.matcher, len(blocks), 1, ()))
        if blocks:
            self._submit(self._filled_ahead, blocks)
            self._ahead = filled

    def fill(self, blocks: Sequence[Block]) -> None:
        """Asks for the blocks' masks for the next ``apply`` (no block: it does nothing). Row i
        of a block is the mask after its output and ``drafts[:i]``; rows after a draft its
        grammar rejects, or after one that terminates it, allow everything: a verification
        that reaches them has accepted that draft, which the mask of its own row forbids (or
        the output ended at it)."""
        self._ask([(b.grammar, b.first, b.rows, b.drafts) for b in blocks])

    def fill_decode(self, reqs: Sequence[Request]) -> None:
        """``fill(decode_blocks(reqs))``, without building the blocks: row j is ``reqs[j]``'s
        one row."""
        self._ask([(r.grammar, j, 1, ()) for j, r in enumerate(reqs) if r.grammar is not None])

    def _ask(self, blocks: list[Rows]) -> None:
        """Queues what the blocks' masks need beyond the rows filled ahead; the next ``apply``
        gathers them."""
        self._pending = None
        if not blocks:
            return
        if sum(b[2] for b in blocks) > self.max_rows:
            raise ValueError(f"{sum(b[2] for b in blocks)} rows, at most {self.max_rows}")
        rows: list[int] = []
        ahead_dst: list[int] = []
        ahead_src: list[int] = []
        asked: list[FillBlock] = []
        asked_dst: list[int] = []
        at = 0
        filled = self._ahead
        for st, first, count, drafts in blocks:
            ahead = filled.get(st.id)
            if count == 1 and ahead is not None and ahead[1] == len(st.tokens):
                rows.append(first)
                ahead_dst.append(first)
                ahead_src.append(ahead[0])
                continue
            asked.append((st.matcher, at, count, list(drafts[: count - 1])))
            rows.extend(range(first, first + count))
            asked_dst.extend(range(first, first + count))
            at += count
        if asked:
            self._submit(self._filled, asked)
        self._pending = (rows, ahead_dst, ahead_src, asked_dst)

    def _submit(self, out: np.ndarray, blocks: list[FillBlock]) -> None:
        if self._filler is None:
            self._filler = MaskFiller(self.threads)
        try:
            self._filler.submit(out, blocks)
        except RuntimeError:
            self.close()  # the next constrained pass starts another
            raise

    def apply(self, logits: torch.Tensor) -> None:
        """logits: the pass's [n, V] fp32 rows, shaped otherwise: every token a row's grammar
        forbids is set to -inf, in place, by the masks of the last ``fill``. For a GPU the
        masks go in one copy without blocking, whose end the next apply waits for."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits of {logits.shape[-1]} tokens, masks of {self.vocab_size}")
        rows, ahead_dst, ahead_src, asked_dst = pending
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        filler = self._filler
        assert filler is not None, "a pass with masks started the filler"
        try:
            filler.wait(filler.last)  # every job: the matchers are the engine's again
        except RuntimeError:
            self.close()  # the next constrained pass starts another
            raise
        host = self._host[: max(rows) + 1]  # row r masks logits row r (the kernel's indices)
        out = host.numpy()
        if ahead_dst:
            out[ahead_dst] = self._filled_ahead[ahead_src]
        if asked_dst:
            out[asked_dst] = self._filled[: len(asked_dst)]
        mask = host
        if logits.is_cuda:
            mask = host.to(logits.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)

    def close(self) -> None:
        """Stops the filling thread once its jobs are done (a later constrained pass starts
        another)."""
        filler, self._filler = self._filler, None
        if filler is not None:
            filler.stop()
        self._ahead = {}
