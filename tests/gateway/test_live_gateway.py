"""A real `dhisparse gateway` (uvicorn) on the real worker: the official openai client, and
client disconnects cancelling the worker's request."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import MODEL, GatewayProcess, WorkerProcess

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
