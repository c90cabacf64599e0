"""Running the worker requests of one HTTP request (``n`` choices, times the prompts of a batch)
and bringing their deltas back together.

``start_choices`` returns only once every choice has its first token, so anything that fails
before that (no worker, a bad parameter the worker refuses) is still an ordinary HTTP error and
not an error inside a stream that already said 200. ``merge`` interleaves the choices in arrival
order. Closing either one closes every choice, which cancels their gRPC calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from services.gateway.generation import ChoiceResult, GenerationDelta, GenerationInput
from services.gateway.metrics import RequestTracker

Generate = Callable[[GenerationInput], AsyncIterator[GenerationDelta]]


class ChoiceStream:
    """One choice's deltas, metered by a tracker, with the first delta fetched ahead."""

    def __init__(self, deltas: AsyncIterator[GenerationDelta], tracker: RequestTracker) -> None:
        self._deltas = deltas
        self._tracker = tracker
        self._ahead: GenerationDelta | None = None
        self._finish: str | None = None
        self._closed = False

    async def prefetch(self) -> None:
        self._ahead = await self._pull()

    async def next(self) -> GenerationDelta | None:
        """The next delta, or None when the choice is done."""
        if self._ahead is not None:
            delta, self._ahead = self._ahead, None
            return delta
        return await self._pull()

    async def _pull(self) -> GenerationDelta | None:
        if self._closed:
            return None
        try:
            delta = await anext(self._deltas)
        except StopAsyncIteration:
            await self.aclose()
            return None
        except asyncio.CancelledError:
            await self.aclose()
            raise
        except BaseException:
            self._tracker.finish(None)
            await self.aclose()
            raise
        self._tracker.on_delta(delta)
        if delta.finish_reason is not None:
            self._finish = delta.finish_reason
        return delta

    async def aclose(self) -> None:
        """Idempotent. A choice closed before its finish counts as aborted."""
        if self._closed:
            return
        self._closed = True
        self._tracker.finish(self._finish or "abort")
        with contextlib.suppress(Exception):
            await self._deltas.aclose()  # type: ignore[attr-defined]


async def close_all(streams: Sequence[ChoiceStream]) -> None:
    for s in streams:
        await s.aclose()


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """TaskGroup wraps the failure; the client should see the first real one."""
    err: BaseException = group
    while isinstance(err, BaseExceptionGroup):
        err = err.exceptions[0]
    return err


async def start_choices(
    generate: Generate,
    inputs: Sequence[GenerationInput],
    trackers: Sequence[RequestTracker],
) -> list[ChoiceStream]:
    """Starts every input and waits for each one's first delta. If any fails, all are closed
    (their calls cancelled) and its error is raised."""
    streams = [ChoiceStream(generate(inp), t) for inp, t in zip(inputs, trackers, strict=True)]
    try:
        if len(streams) == 1:  # the common case, without a task of its own
            await streams[0].prefetch()
        else:
            async with asyncio.TaskGroup() as tg:
                for s in streams:
                    tg.create_task(s.prefetch())
    except BaseExceptionGroup as group:
        await close_all(streams)
        raise _first_error(group) from None
    except BaseException:
        await close_all(streams)
        raise
    return streams


async def merge(streams: Sequence[ChoiceStream]) -> AsyncIterator[tuple[int, GenerationDelta]]:
    """(choice index, delta) as they arrive; ends when every choice is done. An error in one
    choice ends the merge with that error."""
    if len(streams) == 1:  # nothing to interleave: no task per delta
        try:
            while (delta := await streams[0].next()) is not None:
                yield 0, delta
        finally:
            await close_all(streams)
        return
    pending: dict[asyncio.Task[GenerationDelta | None], int] = {
        asyncio.ensure_future(s.next()): i for i, s in enumerate(streams)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                delta = task.result()
                if delta is None:
                    continue
                yield i, delta
                pending[asyncio.ensure_future(streams[i].next())] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await close_all(streams)


async def collect(streams: Sequence[ChoiceStream]) -> list[ChoiceResult]:
    """Every choice to its end (non-streaming responses)."""
    results = [ChoiceResult(index=i) for i in range(len(streams))]
    async for i, delta in merge(streams):
        results[i].add(delta)
    return results
