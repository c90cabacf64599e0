"""A real `dhisparse gateway` (uvicorn) on the real worker: the official openai client (its
answers, and its errors: 400, 404, and admission's 429 and 503), and client disconnects
cancelling the worker's request."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from .conftest import (
    MODEL,
    TIGHT_QUEUE,
    GatewayProcess,
    RedisServer,
    WorkerProcess,
    capacity_held,
)

MSG = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def oai(live_gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_gateway.base_url}/v1", api_key="unused", max_retries=0)


def test_openai_models(oai: openai.OpenAI) -> None:
    [model] = oai.models.list().data
    assert model.id == MODEL
    assert model.owned_by == "dhisparse"


def test_openai_chat(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=MSG,  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 5


def test_openai_chat_stream(oai: openai.OpenAI) -> None:
    greedy = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = oai.chat.completions.create(model=MODEL, messages=MSG, **greedy)  # type: ignore[call-overload]
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MSG,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        **greedy,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_completions_and_stream(oai: openai.OpenAI) -> None:
    greedy = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = oai.completions.create(model=MODEL, prompt="The quick", **greedy)  # type: ignore[call-overload]
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    stream = oai.completions.create(model=MODEL, prompt="The quick", stream=True, **greedy)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in stream) == full.choices[0].text


def test_openai_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=MODEL, messages=MSG, temperature=-1)  # type: ignore[arg-type]
    assert bad.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10**6)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-9", messages=MSG)  # type: ignore[arg-type]


def test_stream_disconnect_aborts_on_worker(
    live_gateway: GatewayProcess, worker: WorkerProcess
) -> None:
    body = {"messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=live_gateway.base_url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert worker.load().num_running == 1
    # Leaving the block closed the connection mid-stream.
    assert worker.wait_idle(timeout=10), "the worker kept generating for a gone client"


def test_non_stream_disconnect_aborts_on_worker(
    live_gateway: GatewayProcess, worker: WorkerProcess
) -> None:
    body = {"messages": MSG, "max_tokens": 3000, "ignore_eos": True}
    with (
        httpx.Client(base_url=live_gateway.base_url, timeout=1.0) as client,
        pytest.raises(httpx.ReadTimeout),
    ):
        client.post("/v1/chat/completions", json=body)
    assert worker.wait_idle(timeout=10), "the worker kept generating for a gone client"


async def test_openai_admission_errors(
    tight_gateway: GatewayProcess, redis_server: RedisServer, small_workers: list[WorkerProcess]
) -> None:
    """The openai client's own exceptions for a full queue (429), a deadline (503) and a request
    larger than any worker's KV memory (400, the context-length shape)."""
    gw = tight_gateway
    oai = openai.AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key="unused", max_retries=0)
    short = {"model": MODEL, "messages": MSG, "max_tokens": 4}
    with pytest.raises(openai.BadRequestError, match="maximum context length") as big:
        await oai.chat.completions.create(**{**short, "max_tokens": 2000})  # type: ignore[call-overload]
    assert big.value.response.headers["x-dhisparse-reason"] == "too-large"
    worker = small_workers[0].address
    async with capacity_held(redis_server.url, gw.ledger_prefix, [worker]):
        waiting = [
            asyncio.create_task(oai.chat.completions.create(**short))  # type: ignore[call-overload]
            for _ in range(TIGHT_QUEUE)
        ]
        await asyncio.sleep(0.5)
        with pytest.raises(openai.RateLimitError) as full:
            await oai.completions.create(model=MODEL, prompt="x", max_tokens=4)
        assert full.value.status_code == 429
        assert full.value.response.headers["retry-after"] == "1"
        assert full.value.response.headers["x-dhisparse-reason"] == "queue-full"
        for outcome in await asyncio.gather(*waiting, return_exceptions=True):
            assert isinstance(outcome, openai.InternalServerError), outcome
            assert outcome.status_code == 503
            assert outcome.response.headers["x-dhisparse-reason"] == "deadline"
            assert outcome.body["type"] == "ServiceUnavailableError"  # type: ignore[index]
        with pytest.raises(
            openai.InternalServerError
        ) as late:  # a stream says 200 only once admitted
            await oai.chat.completions.create(**short, stream=True)  # type: ignore[call-overload]
        assert late.value.status_code == 503
    # Capacity back: the same request goes through.
    resp = await oai.chat.completions.create(**short)  # type: ignore[call-overload]
    assert resp.choices[0].finish_reason in ("length", "stop")
    await oai.close()
