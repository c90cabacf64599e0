"""One pass's grammar masks for its whole batch, filled by another process.

The masks are filled by a process of their own (``mask_filler``, started at the first
constrained pass, stopped with the engine): it mirrors every constrained request's matcher, advanced by the tokens the
engine accepted, and writes masks into shared memory, so the engine's thread never fills one
(a fill holds the interpreter's lock, and a step's host work is the decode step's bottleneck).

- ``prefetch``, after a step's tokens are accepted: the next decode row of every constrained
  request still running is filled while the engine finishes that step and begins the next.
- ``fill``, after a pass is launched: the rows that were not filled ahead (a prefill's first
  token, a verify block with its drafts, a request whose tokens changed since) are asked for.
- ``apply``, once the pass's logits are shaped otherwise: the rows are gathered, copied to the
  device in one transfer and applied by one kernel; rows of unconstrained requests are left
  alone."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import numpy as np
import torch
import xgrammar as xgr

from services.worker.request import mask_filler
from services.worker.request.grammar_state import GrammarState
from services.worker.request.request import Request

AHEAD, ON_DEMAND = 0, 1  # the two shared-memory regions


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


class _Filler:
    """The filler process, its pipe and its two shared-memory regions of mask rows."""

    def __init__(self, tokenizer: xgr.TokenizerInfo, rows: tuple[int, int], words: int) -> None:
        self.rows = rows
        self.shms = [
            shared_memory.SharedMemory(create=True, size=max(1, r) * words * 4) for r in rows
        ]
        self.views = [
            np.ndarray((r, words), dtype=np.int32, buffer=shm.buf)
            for shm, r in zip(self.shms, rows, strict=True)
        ]
        regions = [(shm.name, r, words) for shm, r in zip(self.shms, rows, strict=True)]
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, mask_filler.__file__, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self._send((tokenizer.serialize_json(), regions))
        self.opened: dict[int, int] = {}  # request id -> tokens the mirror has accepted
        self._queue: list[tuple] = []  # commands sent with the next fill, in one message
        self.keys: set[str] = set()  # grammars whose compiled form the process holds
        self.tags = 0
        self.answered = 0  # fills answered so far (answers come in order)
        self._stop = weakref.finalize(self, _stop, self.conn, self.proc, self.shms)

    def sync(self, st: GrammarState) -> None:
        """The process's mirror of ``st`` at ``st``'s tokens (from the next fill on)."""
        done = self.opened.get(st.id)
        if done is None:
            blob = None if st.key in self.keys else st.compiled.serialize_json()
            self.keys.add(st.key)
            self._queue.append(("open", st.id, st.key, blob, list(st.tokens)))
        elif done < len(st.tokens):
            self._queue.append(("advance", st.id, st.tokens[done:]))
        self.opened[st.id] = len(st.tokens)

    def close_except(self, live: set[int]) -> None:
        for rid in [r for r in self.opened if r not in live]:
            del self.opened[rid]
            self._queue.append(("close", rid))

    def fill(self, region: int, entries: list[tuple[int, int, int, list[int]]]) -> int:
        """Asks for ``entries``' rows of ``region``; the tag to wait for."""
        self.tags += 1
        self._queue.append(("fill", self.tags, region, entries))
        self._send(("batch", self._queue))
        self._queue = []
        return self.tags

    def wait(self, tag: int) -> None:
        """Until fill ``tag`` (and every earlier one) is written. Raises RuntimeError when the
        process has died."""
        while self.answered < tag:
            try:
                self.answered = self.conn.recv()
            except (EOFError, OSError) as e:
                raise self._died() from e

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError as e:
            raise self._died() from e

    def _died(self) -> RuntimeError:
        try:
            code = self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        return RuntimeError(f"the grammar mask process died (exit code {code})")

    def stop(self) -> None:
        self._stop()


def _stop(conn: Connection, proc: subprocess.Popen, shms: list) -> None:
    with contextlib.suppress(OSError, ValueError):  # the process may be gone already
        conn.send(("stop",))
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    conn.close()
    for shm in shms:
        shm.close()
        shm.unlink()


class GrammarMasks:
    """The masks of one pass at a time."""

    def __init__(
        self, vocab_size: int, device: torch.device, max_rows: int, max_seqs: int | None = None
    ) -> None:
        """``vocab_size``: the logits' width (the compiled grammars' tokenizer info's);
        ``max_rows``: the most rows one pass samples (sequences times the verify width), the
        on-demand region's rows; ``max_seqs``: the most sequences a pass holds, the rows of
        the region filled ahead (one per decoding sequence; default ``max_rows``)."""
        self.vocab_size = vocab_size
        self.device = device
        self.words = xgr.get_bitmask_shape(1, vocab_size)[1]
        self.max_rows = max_rows
        self.max_seqs = min(max_rows, max_seqs or max_rows)
        self._filler: _Filler | None = None  # started by the first constrained pass
        self._ahead: dict[int, tuple[int, int]] = {}  # request id -> (row, tokens) filled ahead
        self._ahead_tag = 0
        self._pending: tuple[list[int], list[tuple[int, int]], int] | None = None
        pinned = device.type == "cuda"
        self._host = torch.empty((max_rows, self.words), dtype=torch.int32, pin_memory=pinned)
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host

    @property
    def region_rows(self) -> tuple[int, int] | None:
        """The filler's shared-memory rows by region (``AHEAD``, ``ON_DEMAND``); None before
        the first constrained pass starts it."""
        return None if self._filler is None else self._filler.rows

    def prefetch(self, running: Sequence[Request], ahead: bool) -> None:
        """After a step's tokens are accepted: the process forgets every request but the
        constrained ones of ``running``, and with ``ahead`` (the next pass decodes one row
        each) their next rows are filled while the engine goes on."""
        f = self._filler
        self._ahead = {}
        if f is None:
            return
        states = [r.grammar for r in running if r.grammar is not None]
        live = [st for st in states if not st.terminated][: self.max_seqs] if ahead else []
        try:
            f.close_except({st.id for st in states})
            for st in live:
                f.sync(st)
            if live:
                self._ahead_tag = f.fill(AHEAD, [(st.id, i, 1, []) for i, st in enumerate(live)])
        except RuntimeError:
            self.close()  # the next constrained pass starts another
            raise
        self._ahead = {st.id: (i, len(st.tokens)) for i, st in enumerate(live)}

    def fill(self, blocks: Sequence[Block]) -> None:
        """Asks for the blocks' masks for the next ``apply`` (no block: it does nothing). Row i
        of a block is the mask after its output and ``drafts[:i]``; rows after a draft its
        grammar rejects, or after one that terminates it, allow everything: a verification
        that reaches them has accepted that draft, which the mask of its own row forbids (or
        the output ended at it)."""
        self._pending = None
        if not blocks:
            return
        if sum(b.rows for b in blocks) > self.max_rows:
            raise ValueError(f"{sum(b.rows for b in blocks)} rows, at most {self.max_rows}")
        f = self._filler
        if f is None:
            f = self._filler = _Filler(
                # rows by region: AHEAD, then ON_DEMAND
                blocks[0].grammar.compiled.tokenizer_info, (self.max_seqs, self.max_rows),
                self.words,
            )  # fmt: skip
        try:
            self._pending = self._ask(f, blocks)
        except RuntimeError:
            self.close()  # the next constrained pass starts another
            raise

    def _ask(
        self, f: _Filler, blocks: Sequence[Block]
    ) -> tuple[list[int], list[tuple[int, int]], int]:
        """Sends what the blocks' masks need: (the logits' rows, where each row's mask is,
        the fill to wait for)."""
        rows: list[int] = []  # the logits' rows that have a mask
        sources: list[tuple[int, int]] = []  # (region, row) of each
        entries = []
        at = 0
        for b in blocks:
            st = b.grammar
            ahead = self._ahead.get(st.id)
            if b.rows == 1 and ahead is not None and ahead[1] == len(st.tokens):
                rows.append(b.first)
                sources.append((AHEAD, ahead[0]))
                continue
            f.sync(st)
            entries.append((st.id, at, b.rows, list(b.drafts[: b.rows - 1])))
            for i in range(b.rows):
                rows.append(b.first + i)
                sources.append((ON_DEMAND, at + i))
            at += b.rows
        tag = f.fill(ON_DEMAND, entries) if entries else self._ahead_tag
        return rows, sources, tag

    def apply(self, logits: torch.Tensor) -> None:
        """logits: the pass's [n, V] fp32 rows, shaped otherwise: every token a row's grammar
        forbids is set to -inf, in place, by the masks of the last ``fill``. For a GPU the
        masks go in one copy without blocking, whose end the next apply waits for."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits of {logits.shape[-1]} tokens, masks of {self.vocab_size}")
        rows, sources, tag = pending
        f = self._filler
        assert f is not None
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        try:
            f.wait(tag)
        except RuntimeError:
            self.close()  # the next constrained pass starts another
            raise
        host = self._host[: max(rows) + 1]  # row r masks logits row r (the kernel's indices)
        out = host.numpy()
        for region in (AHEAD, ON_DEMAND):
            at = [k for k, (r, _) in enumerate(sources) if r == region]
            if at:
                out[[rows[k] for k in at]] = f.views[region][[sources[k][1] for k in at]]
        mask = host
        if logits.is_cuda:
            mask = host.to(logits.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)

    @property
    def filler_pid(self) -> int | None:
        """The filler process's id (None: not started)."""
        return None if self._filler is None else self._filler.proc.pid

    def close(self) -> None:
        """Stops the filler process (a later constrained pass starts another)."""
        if self._filler is not None:
            self._filler.stop()
            self._filler = None
            self._ahead = {}
