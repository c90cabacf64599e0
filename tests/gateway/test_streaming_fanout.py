"""SSE framing, the n-way fan-out and its metering, with fake worker streams (no server)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from services.gateway.errors import APIError
from services.gateway.fanout import collect, merge, start_choices
from services.gateway.generation import (
    GenerationDelta,
    GenerationInput,
    SamplingSpec,
    TokenLogprob,
    TopLogprob,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.responses import (
    ChatStreamChoice,
    DeltaMessage,
    Usage,
    chat_logprobs,
    completion_logprobs,
)
from services.gateway.streaming import DONE_FRAME, data_frame, sse_frames


def delta(text: str, n: int, finish: str | None = None) -> GenerationDelta:
    return GenerationDelta(
        token_ids=(1,),
        text=text,
        finish_reason=finish,  # type: ignore[arg-type]
        stop_reason=None,
        prompt_tokens=4,
        completion_tokens=n,
    )


class FakeWorker:
    """Each request yields ``len(script)`` deltas spelling its choice; ``fail`` raises before
    the first one. Records which streams were closed (their gRPC call would be cancelled)."""

    def __init__(self, fail: set[str] = frozenset(), block: set[str] = frozenset()) -> None:
        self.fail, self.block = fail, block
        self.closed: list[str] = []

    async def generate(self, inp: GenerationInput) -> AsyncIterator[GenerationDelta]:
        try:
            if inp.request_id in self.fail:
                raise APIError(503, f"{inp.request_id} failed")
            if inp.request_id in self.block:
                await asyncio.Event().wait()
            tag = inp.request_id[-1]
            for k in range(3):
                await asyncio.sleep(0)
                yield delta(tag, k + 1, "length" if k == 2 else None)
        finally:
            self.closed.append(inp.request_id)


def inputs(n: int) -> list[GenerationInput]:
    return [GenerationInput(f"r-{i}", (1, 2), SamplingSpec(max_tokens=3)) for i in range(n)]


def gauges(m: GatewayMetrics) -> tuple[float, float]:
    running = m.registry.get_sample_value("dhisparse:num_requests_running", {"model": "m"})
    waiting = m.registry.get_sample_value("dhisparse:num_requests_waiting", {"model": "m"})
    return running or 0.0, waiting or 0.0


async def test_collect_multiplexes_choices_and_meters() -> None:
    worker, metrics = FakeWorker(), GatewayMetrics()
    ins = inputs(3)
    streams = await start_choices(worker.generate, ins, [metrics.track("m") for _ in ins])
    assert gauges(metrics) == (3.0, 0.0)  # every choice has its first token
    results = await collect(streams)
    assert [r.text for r in results] == ["000", "111", "222"]
    assert all(r.finish_reason == "length" and r.completion_tokens == 3 for r in results)
    assert sorted(worker.closed) == ["r-0", "r-1", "r-2"]
    assert gauges(metrics) == (0.0, 0.0)
    success = metrics.registry.get_sample_value(
        "dhisparse:request_success_total", {"model": "m", "finished_reason": "length"}
    )
    assert success == 3.0
    assert (
        metrics.registry.get_sample_value("dhisparse:generation_tokens_total", {"model": "m"}) == 9
    )
    assert metrics.registry.get_sample_value("dhisparse:prompt_tokens_total", {"model": "m"}) == 12


async def test_a_failing_choice_cancels_the_others() -> None:
    worker, metrics = FakeWorker(fail={"r-1"}, block={"r-0", "r-2"}), GatewayMetrics()
    ins = inputs(3)
    with pytest.raises(APIError, match="r-1 failed"):
        await start_choices(worker.generate, ins, [metrics.track("m") for _ in ins])
    assert sorted(worker.closed) == ["r-0", "r-1", "r-2"]
    assert gauges(metrics) == (0.0, 0.0)


async def test_leaving_merge_early_closes_every_choice() -> None:
    worker, metrics = FakeWorker(), GatewayMetrics()
    ins = inputs(2)
    streams = await start_choices(worker.generate, ins, [metrics.track("m") for _ in ins])
    merged = merge(streams)
    await anext(merged)
    await merged.aclose()  # what a client disconnect does to the response generator
    assert sorted(worker.closed) == ["r-0", "r-1"]
    assert gauges(metrics) == (0.0, 0.0)
    aborted = metrics.registry.get_sample_value(
        "dhisparse:request_success_total", {"model": "m", "finished_reason": "abort"}
    )
    assert aborted == 2.0


async def test_sse_frames_and_error_after_start() -> None:
    async def events() -> AsyncIterator[str]:
        yield '{"a":1}'
        raise APIError(503, "worker died")

    frames = [f async for f in sse_frames(events())]
    assert frames[0] == b'data: {"a":1}\n\n'
    assert json.loads(frames[1][len(b"data: ") :]) == {
        "error": {
            "message": "worker died",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
    assert frames[2] == DONE_FRAME == b"data: [DONE]\n\n"


def test_data_frame_forms() -> None:
    assert data_frame({"x": 1}) == b'data: {"x":1}\n\n'
    assert data_frame(Usage.of(2, 3)) == (
        b'data: {"prompt_tokens":2,"completion_tokens":3,"total_tokens":5,'
        b'"prompt_tokens_details":{"cached_tokens":0}}\n\n'
    )


def test_delta_serializes_only_what_changed() -> None:
    role = ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
    assert role.model_dump()["delta"] == {"role": "assistant", "content": ""}
    assert role.model_dump()["finish_reason"] is None
    content = ChatStreamChoice(index=0, delta=DeltaMessage(content="hi"))
    assert content.model_dump()["delta"] == {"content": "hi"}


def test_logprob_formats() -> None:
    lps = [
        TokenLogprob(1, "a", -0.5, (TopLogprob(1, "a", -0.5), TopLogprob(2, "é", -1.0))),
        TokenLogprob(3, "bc", -2.0, (TopLogprob(4, "x", -0.1), TopLogprob(3, "y", -0.2))),
    ]
    chat = chat_logprobs(lps, top=1).model_dump()["content"]
    assert chat[0] == {
        "token": "a",
        "logprob": -0.5,
        "bytes": [97],
        "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}],
    }
    legacy = completion_logprobs(lps, top=2, text_offset=10)
    assert legacy.tokens == ["a", "bc"]
    assert legacy.token_logprobs == [-0.5, -2.0]
    assert legacy.text_offset == [10, 11]
    assert legacy.top_logprobs == [{"a": -0.5, "é": -1.0}, {"x": -0.1, "y": -0.2, "bc": -2.0}]
    assert completion_logprobs(lps, top=0).top_logprobs == [None, None]
