"""The thread that fills grammar masks (``grammar_masks.GrammarMasks`` starts it): jobs of rows
to fill, done in the order they were submitted, each by xgrammar's batch matcher, which releases
Python's interpreter lock while it fills (its threads fill the rows side by side), so the
engine's thread goes on with the pass meanwhile.

A job is ``(out, blocks)``: for each block ``(matcher, row, rows, drafts)`` rows ``row .. row +
rows - 1`` of ``out`` ([R, words] int32): row i the mask after the matcher's tokens and
``drafts[:i]``; the drafts are accepted while filling and rolled back after. Rows after a draft
the grammar rejects, or after one that terminates it, allow everything. While a job is queued
or running its matchers are the thread's: their owner advances them only once ``wait`` has
returned for it."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import xgrammar as xgr

# a request's rows of one job: (its matcher, first row, rows, drafts)
FillBlock = tuple[xgr.GrammarMatcher, int, int, Sequence[int]]


def fill_blocks(batch: xgr.BatchGrammarMatcher, out: np.ndarray, blocks: list[FillBlock]) -> None:
    """Fills the blocks' rows of ``out`` as the module docstring says: depth by depth, every
    block's row at a depth in one batch call, its draft accepted in one batch call."""
    for _, row, rows, _ in blocks:
        out[row : row + rows] = -1
    accepted = [0] * len(blocks)
    live = [j for j, b in enumerate(blocks) if not b[0].is_terminated()]
    depth = 0
    while live:
        batch.batch_fill_next_token_bitmask(
            [blocks[j][0] for j in live], out, [blocks[j][1] + depth for j in live]
        )
        live = [j for j in live if depth < blocks[j][2] - 1]
        if not live:
            break
        ok = batch.batch_accept_token(
            [blocks[j][0] for j in live], [int(blocks[j][3][depth]) for j in live]
        )
        live = [j for j, good in zip(live, ok, strict=True) if good]
        for j in live:
            accepted[j] += 1
        live = [j for j in live if not blocks[j][0].is_terminated()]
        depth += 1
    for (matcher, *_), n in zip(blocks, accepted, strict=True):
        if n:
            matcher.rollback(n)


class MaskFiller:
    """One filling thread and its queue of jobs."""

    def __init__(self, threads: int) -> None:
        """``threads``: the batch matcher's own threads (xgrammar fills a job's rows on them)."""
        self._batch = xgr.BatchGrammarMatcher(threads)
        self._cv = threading.Condition()
        self._jobs: list[tuple[np.ndarray, list[FillBlock]]] = []
        self._submitted = 0
        self._done = 0
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="grammar-masks", daemon=True)
        self._thread.start()

    def submit(self, out: np.ndarray, blocks: list[FillBlock]) -> int:
        """Queues a job; the tag ``wait`` takes."""
        with self._cv:
            if self._error is not None or self._stopping:
                raise RuntimeError(f"the grammar mask thread has stopped: {self._error!r}")
            self._jobs.append((out, blocks))
            self._submitted += 1
            self._cv.notify_all()
            return self._submitted

    @property
    def last(self) -> int:
        """The tag of the last job submitted (0: none)."""
        return self._submitted

    def wait(self, tag: int) -> None:
        """Until job ``tag`` and every earlier one are done. Raises RuntimeError when a job
        failed (the filler takes no more)."""
        with self._cv:
            while self._done < tag and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise RuntimeError(f"filling grammar masks failed: {self._error!r}")

    def stop(self) -> None:
        """Ends the thread once its queued jobs are done."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopping:
                    self._cv.wait()
                if not self._jobs:
                    return
                out, blocks = self._jobs.pop(0)
            try:
                fill_blocks(self._batch, out, blocks)
            except BaseException as e:  # handed to whoever waits: a thread has no caller
                with self._cv:
                    self._error = e
                    self._jobs.clear()
                    self._cv.notify_all()
                return
            with self._cv:
                self._done += 1
                self._cv.notify_all()
