"""The process that fills grammar masks (``grammar_masks.GrammarMasks`` starts it): a mirror of
every constrained request's matcher, advanced by the tokens the engine accepted, filling masks
into shared memory on command, so that the engine's thread never fills one.

The process runs this file by its path (no package of the worker is imported there) with one end
of a socket pair. Its first message is the tokenizer's info and the shared-memory regions; then
commands arrive in order, each ``fill`` answered with its tag once its rows are written:

- ``("open", id, key, compiled_json | None, tokens)``: a matcher for request ``id`` of the
  grammar ``key`` (its compiled form sent the first time the key is used), past ``tokens``;
- ``("advance", id, tokens)``: the request accepted ``tokens``;
- ``("close", id)``: the request is gone;
- ``("fill", tag, region, entries)``: for each ``(id, row, rows, drafts)``, rows ``row ..
  row + rows - 1`` of shared-memory region ``region``: row i is the mask after the request's
  tokens and ``drafts[:i]`` (rows after a rejected or terminating draft allow everything), the
  matcher unchanged after;
- ``("stop",)``;
- ``("batch", commands)``: the commands in order (the engine sends each fill with the
  commands before it in one message)."""

from __future__ import annotations

import sys
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection

import numpy as np
import xgrammar as xgr


def fill_rows(
    matcher: xgr.GrammarMatcher, out: np.ndarray, row: int, rows: int, drafts: list[int]
) -> None:
    """Rows ``row .. row + rows - 1`` of ``out`` ([R, words] int32): row i the mask after the
    matcher's tokens and ``drafts[:i]``; the drafts are accepted while filling and rolled
    back after. Rows after a draft the grammar rejects, or after one that terminates it,
    allow everything."""
    out[row : row + rows] = -1
    accepted = 0
    for i in range(rows):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(out, row + i)
        if i == rows - 1 or not matcher.accept_token(drafts[i]):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)


def serve(conn: Connection) -> None:
    """The process's loop. Its first message is ``(tokenizer info JSON, regions)``, a region
    being (shared-memory name, rows, words)."""
    try:
        tokenizer_json, regions = conn.recv()
    except EOFError:
        return
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_json)
    shms = [shared_memory.SharedMemory(name=name) for name, _, _ in regions]
    for shm in shms:  # the engine owns them: this process's exit must not unlink them
        resource_tracker.unregister("/" + shm.name, "shared_memory")  # as POSIX names them
    views = [
        np.ndarray((rows, words), dtype=np.int32, buffer=shm.buf)
        for shm, (_, rows, words) in zip(shms, regions, strict=True)
    ]
    compiled: dict[str, xgr.CompiledGrammar] = {}
    matchers: dict[int, xgr.GrammarMatcher] = {}
    try:
        while True:
            msg = conn.recv()
            for cmd in msg[1] if msg[0] == "batch" else [msg]:
                if not _run(cmd, conn, info, views, compiled, matchers):
                    return
    except EOFError:
        return  # the engine is gone
    finally:
        views.clear()
        for shm in shms:
            shm.close()


def _run(
    cmd: tuple,
    conn: Connection,
    info: xgr.TokenizerInfo,
    views: list[np.ndarray],
    compiled: dict[str, xgr.CompiledGrammar],
    matchers: dict[int, xgr.GrammarMatcher],
) -> bool:
    """Carries out one command; False once told to stop."""
    kind = cmd[0]
    if kind == "fill":
        _, tag, region, entries = cmd
        for rid, row, rows, drafts in entries:
            fill_rows(matchers[rid], views[region], row, rows, drafts)
        conn.send(tag)
    elif kind == "advance":
        _, rid, tokens = cmd
        m = matchers[rid]
        for t in tokens:
            if not m.accept_token(t):
                raise RuntimeError(f"request {rid}: the engine accepted {t}, its mirror not")
    elif kind == "open":
        _, rid, key, blob, tokens = cmd
        if blob is not None:
            compiled[key] = xgr.CompiledGrammar.deserialize_json(blob, info)
        matchers[rid] = m = xgr.GrammarMatcher(compiled[key])
        for t in tokens:
            if not m.accept_token(t):
                raise RuntimeError(f"request {rid}: its grammar rejects token {t}")
    elif kind == "close":
        matchers.pop(cmd[1], None)
    elif kind == "stop":
        return False
    else:
        raise ValueError(f"unknown command {kind!r}")
    return True


if __name__ == "__main__":  # run by path, so that no package of the worker is imported
    serve(Connection(int(sys.argv[1])))
