"""One pass's grammar masks for its whole batch, filled by other processes.

The masks are filled by processes of their own (``mask_filler``, started at the first
constrained pass, stopped with the engine): each mirrors the matchers of its share of the
constrained requests (a request's share: its grammar's id modulo the processes), advanced by
the tokens the engine accepted, and writes masks into shared memory of its own, so the engine's
thread never fills one (a fill holds the interpreter's lock, and a step's host work is the
decode step's bottleneck) and a batch's rows are filled side by side (one process fills 64
rows slower than a small model's decode step takes: ``default_processes``).

- ``prefetch``, after a step's tokens are accepted: the next decode row of every constrained
  request still running is filled while the engine finishes that step and begins the next.
- ``fill``, after a pass is launched: the rows that were not filled ahead (a prefill's first
  token, a verify block with its drafts, a request whose tokens changed since) are asked for
  (``fill_decode``: a pass that samples one row per request, without building its blocks).
- ``apply``, once the pass's logits are shaped otherwise: the rows are gathered, copied to the
  device in one transfer and applied by one kernel; rows of unconstrained requests are left
  alone.

A decode step's work on the engine's thread is a few operations per constrained request (its
rows and sources kept by process and region as they are decided, so a gather is one array copy
per process and region): at C = 64 it is what a step's grammar costs once the processes fill
in time."""

from __future__ import annotations

import contextlib
import os
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

AHEAD, ON_DEMAND = 0, 1  # the two shared-memory regions of each process
# a process for every this many of the host's cores, at most MAX_PROCESSES
CORES_PER_PROCESS, MAX_PROCESSES = 4, 4


def default_processes(cores: int | None = None) -> int:
    """The filler processes a host of ``cores`` (default: this one's) runs: one per
    ``CORES_PER_PROCESS`` cores, at least one, at most ``MAX_PROCESSES`` (the engine's thread
    and its device work keep the rest)."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    return max(1, min(MAX_PROCESSES, cores // CORES_PER_PROCESS))


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


# a request's rows of one pass: (its grammar, first row, rows, drafts), as ``Block`` holds them
Rows = tuple[GrammarState, int, int, Sequence[int]]
# the rows of one process and region a pass gathers: (process, region, logits' rows, its rows)
Gather = tuple[int, int, list[int], list[int]]


class GrammarMasks:
    """The masks of one pass at a time."""

    def __init__(
        self, vocab_size: int, device: torch.device, max_rows: int, max_seqs: int | None = None,
        processes: int | None = None,
    ) -> None:  # fmt: skip
        """``vocab_size``: the logits' width (the compiled grammars' tokenizer info's);
        ``max_rows``: the most rows one pass samples (sequences times the verify width), the
        on-demand region's rows; ``max_seqs``: the most sequences a pass holds, the rows of
        the region filled ahead (one per decoding sequence; default ``max_rows``);
        ``processes``: the filler processes (default ``default_processes()``)."""
        self.vocab_size = vocab_size
        self.device = device
        self.words = xgr.get_bitmask_shape(1, vocab_size)[1]
        self.max_rows = max_rows
        self.max_seqs = min(max_rows, max_seqs or max_rows)
        self.processes = default_processes() if processes is None else processes
        if self.processes < 1:
            raise ValueError(f"at least one filler process, not {self.processes}")
        self._fillers: list[_Filler] = []  # started by the first constrained pass
        self._ahead: dict[int, tuple[int, int, int]] = {}  # id -> (process, row, tokens) ahead
        self._ahead_tags: list[int] = []  # per process: the fill of its rows ahead
        self._mirrored: set[int] = set()  # the requests the processes mirror
        self._pending: tuple[list[int], list[Gather], list[int]] | None = None
        pinned = device.type == "cuda"
        self._host = torch.empty((max_rows, self.words), dtype=torch.int32, pin_memory=pinned)
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host

    @property
    def region_rows(self) -> tuple[int, int] | None:
        """Each filler's shared-memory rows by region (``AHEAD``, ``ON_DEMAND``); None before
        the first constrained pass starts them."""
        return self._fillers[0].rows if self._fillers else None

    def prefetch(self, running: Sequence[Request], ahead: bool) -> None:
        """After a step's tokens are accepted: the processes forget every request but the
        constrained ones of ``running``, and with ``ahead`` (the next pass decodes one row
        each) their next rows are filled while the engine goes on."""
        self._ahead = {}
        fillers = self._fillers
        if not fillers:
            return
        n = len(fillers)
        states = [r.grammar for r in running if r.grammar is not None]
        ahead_rows: dict[int, tuple[int, int, int]] = {}
        try:
            ids = {st.id for st in states}
            if ids != self._mirrored:
                for f in fillers:
                    f.close_except(ids)
                self._mirrored = ids
            if not ahead:
                return
            entries: list[list[tuple[int, int, int, Sequence[int]]]] = [[] for _ in fillers]
            for st in states:
                if st.terminated:
                    continue
                if len(ahead_rows) == self.max_seqs:
                    break
                k = st.id % n
                share = entries[k]
                fillers[k].sync(st)
                ahead_rows[st.id] = (k, len(share), len(st.tokens))
                share.append((st.id, len(share), 1, ()))
            for k, share in enumerate(entries):
                if share:
                    self._ahead_tags[k] = fillers[k].fill(AHEAD, share)
        except RuntimeError:
            self.close()  # the next constrained pass starts others
            raise
        self._ahead = ahead_rows

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
        """Sends what the blocks' masks need; the next ``apply`` gathers them."""
        self._pending = None
        if not blocks:
            return
        if sum(b[2] for b in blocks) > self.max_rows:
            raise ValueError(f"{sum(b[2] for b in blocks)} rows, at most {self.max_rows}")
        try:
            if not self._fillers:
                info = blocks[0][0].compiled.tokenizer_info
                for _ in range(self.processes):  # rows by region: AHEAD, then ON_DEMAND
                    self._fillers.append(_Filler(info, (self.max_seqs, self.max_rows), self.words))
                self._ahead_tags = [0] * self.processes
            self._pending = self._send_asks(blocks)
        except RuntimeError:
            self.close()  # the next constrained pass starts others
            raise

    def _send_asks(self, blocks: list[Rows]) -> tuple[list[int], list[Gather], list[int]]:
        """Asks the processes for the rows not filled ahead: (the logits' rows that have a
        mask, the gathers that bring them, the fill to wait for of each process)."""
        fillers = self._fillers
        n = len(fillers)
        rows: list[int] = []  # the logits' rows that have a mask
        # per process: (logits' rows, its rows) of the region filled ahead, then on demand
        ahead_dst: list[list[int]] = [[] for _ in fillers]
        ahead_src: list[list[int]] = [[] for _ in fillers]
        asked_dst: list[list[int]] = [[] for _ in fillers]
        entries: list[list[tuple[int, int, int, Sequence[int]]]] = [[] for _ in fillers]
        tags = [0] * n
        at = [0] * n
        filled = self._ahead
        for st, first, count, drafts in blocks:
            ahead = filled.get(st.id)
            if count == 1 and ahead is not None and ahead[2] == len(st.tokens):
                k = ahead[0]
                rows.append(first)
                ahead_dst[k].append(first)
                ahead_src[k].append(ahead[1])
                tags[k] = self._ahead_tags[k]
                continue
            k = st.id % n
            fillers[k].sync(st)
            entries[k].append((st.id, at[k], count, list(drafts[: count - 1])))
            rows.extend(range(first, first + count))
            asked_dst[k].extend(range(first, first + count))
            at[k] += count
        gathers: list[Gather] = []
        for k in range(n):
            if ahead_dst[k]:
                gathers.append((k, AHEAD, ahead_dst[k], ahead_src[k]))
            if entries[k]:
                tags[k] = fillers[k].fill(ON_DEMAND, entries[k])
                gathers.append((k, ON_DEMAND, asked_dst[k], list(range(at[k]))))
        return rows, gathers, tags

    def apply(self, logits: torch.Tensor) -> None:
        """logits: the pass's [n, V] fp32 rows, shaped otherwise: every token a row's grammar
        forbids is set to -inf, in place, by the masks of the last ``fill``. For a GPU the
        masks go in one copy without blocking, whose end the next apply waits for."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits of {logits.shape[-1]} tokens, masks of {self.vocab_size}")
        rows, gathers, tags = pending
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        try:
            for f, tag in zip(self._fillers, tags, strict=True):
                f.wait(tag)
        except RuntimeError:
            self.close()  # the next constrained pass starts others
            raise
        host = self._host[: max(rows) + 1]  # row r masks logits row r (the kernel's indices)
        out = host.numpy()
        for k, region, dst, src in gathers:
            out[dst] = self._fillers[k].views[region][src]
        mask = host
        if logits.is_cuda:
            mask = host.to(logits.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)

    @property
    def filler_pids(self) -> list[int]:
        """The filler processes' ids (none before the first constrained pass)."""
        return [f.proc.pid for f in self._fillers]

    def close(self) -> None:
        """Stops the filler processes (a later constrained pass starts others)."""
        fillers, self._fillers = self._fillers, []
        for f in fillers:
            f.stop()
        self._ahead = {}
        self._ahead_tags = []
        self._mirrored = set()
