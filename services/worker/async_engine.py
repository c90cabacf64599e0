"""Runs the engine on its own thread and serves asyncio callers.

The engine is single-threaded: every mutation (add, abort, attach, step) happens on the engine
thread, fed through a command queue. Outputs go back to each caller's asyncio queue with
``call_soon_threadsafe``.

Sessions resumed from a dead worker start *detached*: they run, but nobody listens until the
gateway re-attaches (``resume``); the first output of an attach catches the caller up on every
token it has not received. A detached session nobody attaches within ``attach_timeout_s`` is
aborted, which returns its capacity.

A live worker also takes over a peer's session (``adopt``: ``SessionAdopter``, the durable
package's ``adopt_session`` bound to this worker's store registration); it is attached at once.
In a data-parallel-attention group another rank may adopt it, before the next step: the caller
is caught up after that step, from rank 0's mirror of it.

A step that raises fails the requests it ran (``Engine.fail_running``: their callers get the
error) and the engine serves on. It stops (``EngineDeadError`` for every caller, unhealthy
until restarted) when a rank group's step fails (its ranks cannot drop a step one-sided), when
``MAX_FAILED_STEPS`` steps fail in a row (the engine is broken, not one batch), or when anything
else on the engine thread raises."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from services.worker.durable.adoption import AdoptFrom, NotAdopted
from services.worker.engine.engine import Engine
from services.worker.request.request import Request, RequestError, RequestOutput, SamplingParams

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # steps failing in a row that stop the engine


class EngineDeadError(RuntimeError):
    """The engine thread failed; the worker must be restarted."""


# (engine, request id, whom from, the data-parallel rank named or None) -> the running request,
# or None when another rank of a data-parallel group adopts it (its outcome comes after a step:
# ``RankAdoptions.take``); raises ``NotAdopted``
SessionAdopter = Callable[[Engine, str, AdoptFrom, int | None], Request | None]


class SessionsHandedOver(RuntimeError):
    """The worker drains: the session is in the host store for a peer (or this worker's
    successor) to adopt, and the caller should move its stream there — or, when the caller has
    no token of it yet, start it over elsewhere (``AsyncEngine.drain`` ended it)."""


class SessionNotFound(LookupError):
    """No detached session of that id to attach to (never resumed here, already attached, or
    expired)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Detached:
    req: Request
    deadline: float


def catch_up(engine: Engine, req: Request, tokens_received: int) -> RequestOutput:
    """One output with everything of ``req`` after its first ``tokens_received`` tokens: the
    tokens, and the text the caller would have been sent for them (the text stream replayed
    to that point tells where the caller's text ends)."""
    p = req.params
    sent = p.text_stream(engine.tokenizer, req.prompt_ids)
    for token in req.output_ids[:tokens_received]:
        sent.push(token)
    text = req.text.detok.text[sent.emitted : req.text.emitted]
    # a resumed session (only those are detached): its prompt counts as cached, as always
    return req.output(tuple(req.output_ids[tokens_received:]), text)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        on_step: Callable[[Engine, list[RequestOutput]], None] | None = None,
        *,
        detached: Iterable[str] = (),
        attach_timeout_s: float = 60.0,
        between_steps: Callable[[Engine], None] | None = None,
        on_shutdown: Callable[[], None] | None = None,
        adopter: SessionAdopter | None = None,
    ) -> None:
        """``detached``: ids of sessions resumed into ``engine`` before it starts stepping.
        ``between_steps`` runs on the engine thread between steps (host-store re-attach);
        ``on_shutdown`` once the engine thread has stopped; ``adopter`` takes a peer's session
        over (None: this worker keeps no durable sessions)."""
        self.engine = engine
        self._adopter = adopter
        self._on_shutdown = on_shutdown
        self._on_step = on_step
        self._between = between_steps
        self._cmds: queue.SimpleQueue[tuple[str, tuple]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.attach_timeout_s = attach_timeout_s
        deadline = time.monotonic() + attach_timeout_s
        self._detached = {}
        # sessions another rank of a data-parallel group adopts: request id -> tokens received
        self._adopting: dict[str, int] = {}
        for rid in detached:
            req = engine.request(rid)
            assert req is not None, rid
            self._detached[rid] = _Detached(req, deadline)
        self.error: BaseException | None = None
        self.draining = False  # ``drain``: admits nothing, its sessions move to peers
        self._failed_steps = 0  # in a row
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Client-side checks that need no engine state; raises ValueError."""
        self.engine.validate_request(prompt_ids, params)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; the last one is finished. Leaving early (the caller
        was cancelled) aborts the request. ``rank``: the data-parallel rank to run it on
        (``Engine.add_request``)."""
        self.validate(prompt_ids, params)
        stream = self._open(request_id)
        self._send("add", request_id, prompt_ids, params, rank)
        async for out in self._consume(request_id, stream):
            yield out

    async def resume(self, request_id: str, tokens_received: int) -> AsyncIterator[RequestOutput]:
        """Attaches to a detached (resumed) session: first its tokens after the first
        ``tokens_received``, then its outputs as they come. Raises ``SessionNotFound``."""
        stream = self._open(request_id)
        self._send("attach", request_id, tokens_received)
        async for out in self._consume(request_id, stream):
            yield out

    async def adopt(
        self, request_id: str, source: AdoptFrom, tokens_received: int, rank: int | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Takes over a peer's session from the host store (``SessionAdopter``; ``rank``: the
        data-parallel rank to adopt it on) and streams it as ``resume`` does. Raises
        ``NotAdopted``."""
        if self._adopter is None:
            raise NotAdopted("failed_precondition", "this worker keeps no durable sessions")
        if self.draining:
            raise NotAdopted("unavailable", "this worker drains: it adopts nothing")
        stream = self._open(request_id)
        self._send("adopt", request_id, source, tokens_received, rank)
        async for out in self._consume(request_id, stream):
            yield out

    def _open(self, request_id: str) -> _Stream:
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
        return stream

    async def _consume(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing runs under this id (or the engine is gone)
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

    def shutdown(self, timeout: float | None = 5.0) -> None:
        self._halt(timeout)
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None

    def drain(self) -> int:
        """Hands every live session over (SIGTERM): admits nothing more (``draining``), stops
        the engine thread after its step in flight — the sessions' rows and manifests are in
        the host store as of that step — ends the requests whose client has no token yet
        (their regions go back to the store: the caller starts them over on another worker,
        under the same id, and no manifest of theirs need exist), runs ``on_shutdown`` (a
        durable worker's releases its store generation: every session it still holds becomes
        adoptable; a group's other ranks stop first and release theirs) and ends each open
        stream with ``SessionsHandedOver``; returns how many sessions it handed over (those
        the other ranks of a data-parallel group run included). Only for durable sessions: a
        worker without them would lose what it hands over. Blocks until the step in flight ends: the generation is released
        only once nothing writes its sessions any more (a supervisor that kills the process
        first leaves them to the store's fencing)."""
        self.draining = True
        self._halt(None)
        held = [(rid, self.engine.request(rid)) for rid in self.engine.request_ids()]
        for rid, req in held:
            if req is not None and not req.output_ids:
                self.engine.abort(rid)
        # a group's other ranks stop and release their own registrations (data-parallel
        # attention: the sessions they run become adoptable) before this one's
        self.engine.group.stop()
        self.shutdown(timeout=None)
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self._deliver(rid, SessionsHandedOver(f"worker drains: {rid} is handed over"))
        return sum(1 for _, req in held if req is not None and req.output_ids)

    def _halt(self, timeout: float | None) -> None:
        """Stops the engine thread after its step in flight (waits ``timeout``; None: as long
        as that step takes)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def detached(self) -> list[str]:
        """Resumed sessions waiting for a re-attach (read from any thread: a snapshot)."""
        return list(self._detached)

    # ---- engine thread ----------------------------------------------------------------------
    def _send(self, *cmd: object) -> None:
        self._cmds.put((str(cmd[0]), tuple(cmd[1:])))
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hands a step's outputs to their streams with one wake-up per event loop, not one
        per output: a wake-up writes to the loop's self-pipe, and the engine thread pays for
        each while the next step waits."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _drain_commands(self) -> None:
        while True:
            try:
                op, args = self._cmds.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                request_id, prompt_ids, params, rank = args
                if self._detached.pop(request_id, None) is not None:
                    # The gateway started this request over (it failed before its first token
                    # reached it): the resumed copy has nobody to stream to.
                    self.engine.abort(request_id)
                try:
                    self.engine.add_request(request_id, prompt_ids, params, rank)
                except ValueError as e:
                    self._deliver(request_id, e)
            elif op == "attach":
                self._attach(*args)
            elif op == "adopt":
                self._adopt(*args)
            elif op == "abort":
                self._detached.pop(args[0], None)
                out = self.engine.abort(args[0])
                if out is not None:
                    self._deliver(args[0], out)

    def _attach(self, request_id: str, tokens_received: int) -> None:
        d = self._detached.pop(request_id, None)
        if d is None:
            self._deliver(request_id, SessionNotFound(f"no resumed session {request_id!r}"))
            return
        if not 0 <= tokens_received <= len(d.req.output_ids):
            self._detached[request_id] = d
            self._deliver(
                request_id,
                ValueError(
                    f"tokens_received={tokens_received}, but the session has "
                    f"{len(d.req.output_ids)} tokens"
                ),
            )
            return
        self._deliver(request_id, catch_up(self.engine, d.req, tokens_received))

    def _adopt(
        self, request_id: str, source: AdoptFrom, tokens_received: int, rank: int | None
    ) -> None:
        assert self._adopter is not None
        if self.engine.has_request(request_id) or request_id in self._adopting:
            # adopted already (a repeated call)
            self._deliver(request_id, ValueError(f"request {request_id!r} already runs here"))
            return
        try:
            req = self._adopter(self.engine, request_id, source, rank)
        except NotAdopted as e:
            self._deliver(request_id, e)
            return
        if req is None:  # another rank of the group adopts it before the next step
            self._adopting[request_id] = tokens_received
            return
        self._adopted(request_id, req, tokens_received)

    def _adopted(self, request_id: str, req: Request, tokens_received: int) -> None:
        """A session adopted here (or mirrored from the rank that adopted it): its caller gets
        the tokens after its first ``tokens_received``."""
        if not 0 <= tokens_received <= len(req.output_ids):
            self.engine.abort(request_id)
            self._deliver(
                request_id,
                ValueError(
                    f"tokens_received={tokens_received}, but the session has "
                    f"{len(req.output_ids)} tokens"
                ),
            )
            return
        self._deliver(request_id, catch_up(self.engine, req, tokens_received))

    def _rank_adoptions(self) -> set[str]:
        """Data-parallel attention: delivers what the other ranks did with the sessions they
        were asked to adopt (``RankAdoptions.take``): the catch-up of each adopted one, or
        why it was not; returns the ids of those adopted. A session whose caller has gone
        meanwhile is ended."""
        adopted = set()
        for outcome, req in self.engine.group.adoptions.take():
            rid = outcome.request_id
            tokens_received = self._adopting.pop(rid, None)
            with self._lock:
                waited = rid in self._streams
            if req is None:
                self._deliver(rid, NotAdopted(outcome.code, outcome.message))
            elif tokens_received is None or not waited:
                self.engine.abort(rid)
            else:
                adopted.add(rid)
                self._adopted(rid, req, tokens_received)
        return adopted

    def _expire_detached(self) -> None:
        now = time.monotonic()
        for rid, d in list(self._detached.items()):
            if now >= d.deadline:
                del self._detached[rid]
                if self.engine.abort(rid) is not None:
                    log.warning("resumed session %s was not re-attached in time: aborted", rid)

    def _fail_step(self, error: Exception) -> list[RequestOutput]:
        """The outputs that end the requests of a step that raised ``error``; re-raises it
        when the engine cannot go on (module docstring)."""
        self._failed_steps += 1
        if self.engine.group.lockstep is not None or self._failed_steps >= MAX_FAILED_STEPS:
            raise error
        log.exception("engine step failed: failing the requests it ran, serving on")
        outputs = self.engine.fail_running(
            RequestError("internal", f"engine step failed: {error!r}")
        )
        for out in outputs:
            self._detached.pop(out.request_id, None)
        return outputs

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if self._detached:
                    self._expire_detached()
                if self._between is not None:
                    self._between(self.engine)
                if not self.engine.has_work():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                    self._failed_steps = 0
                except Exception as e:
                    outputs = self._fail_step(e)
                # the sessions another rank adopted in this step: their callers' catch-ups
                # hold this step's outputs
                caught_up = self._rank_adoptions() if self._adopting else set()
                # A detached session's caller gets its outputs with its catch-up on attach.
                self._deliver_all(
                    [(o.request_id, o) for o in outputs
                     if o.request_id not in self._detached and o.request_id not in caught_up]
                )  # fmt: skip
                if self._on_step is not None:
                    self._on_step(self.engine, outputs)
        except BaseException as e:  # the engine is broken: fail every open stream
            log.exception("engine thread failed")
            self.error = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, EngineDeadError(f"engine failed: {e!r}"))
