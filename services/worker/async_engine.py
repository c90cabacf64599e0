"""Runs the engine on its own thread and serves asyncio callers.

The engine is single-threaded: every mutation (add, abort, step) happens on the engine thread,
fed through a command queue. Outputs go back to each caller's asyncio queue with
``call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from services.worker.engine.engine import Engine
from services.worker.engine.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed; the worker must be restarted."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(
        self, engine: Engine, on_step: Callable[[Engine, list[RequestOutput]], None] | None = None
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._cmds: queue.SimpleQueue[tuple[str, tuple]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Client-side checks that need no engine state; raises ValueError."""
        self.engine.validate_request(prompt_ids, params)

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; the last one is finished. Leaving early (the caller
        was cancelled) aborts the request."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        self.validate(prompt_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
        self._send("add", request_id, prompt_ids, params)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self._streams
        self._send("abort", request_id)
        return known

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine thread ----------------------------------------------------------------------
    def _send(self, *cmd: object) -> None:
        self._cmds.put((str(cmd[0]), tuple(cmd[1:])))
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                op, args = self._cmds.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                request_id, prompt_ids, params = args
                try:
                    self.engine.add_request(request_id, prompt_ids, params)
                except ValueError as e:
                    self._deliver(request_id, e)
            elif op == "abort":
                out = self.engine.abort(args[0])
                if out is not None:
                    self._deliver(args[0], out)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_work():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                for out in outputs:
                    self._deliver(out.request_id, out)
                if self._on_step is not None:
                    self._on_step(self.engine, outputs)
        except BaseException as e:  # the engine is broken: fail every open stream
            log.exception("engine thread failed")
            self.error = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, EngineDeadError(f"engine failed: {e!r}"))
