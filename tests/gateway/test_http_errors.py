"""Client mistakes are OpenAI-shaped 4xx errors, never 422 or 500 (real worker behind)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

MSG = [{"role": "user", "content": "hi"}]


def assert_error(r: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert err["type"] == error_type
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 1e39}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -5}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, None),  # without logprobs=true
        ({"min_tokens": 5, "max_tokens": 2}, None),
        ({"stop": ""}, None),
        ({"stop": [1, 2]}, "stop"),
        ({"stop_token_ids": [100000]}, "stop_token_ids"),
        ({"seed": 2**70}, "seed"),
        ({"stream": "maybe"}, "stream"),
        ({"stream_options": {"include_usage": True}}, None),  # without stream
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"logit_bias": {"100000": 5}}, "logit_bias"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"messages": [*MSG, {"role": "tool", "tool_call_id": "x", "content": "?"}]}, "messages"),
    ],
)
async def test_bad_chat_params_are_400(
    client: httpx.AsyncClient, extra: dict[str, Any], param: str | None
) -> None:
    r = await client.post("/v1/chat/completions", json={"messages": MSG, **extra})
    err = assert_error(r, 400, "BadRequestError")
    assert err["param"] == param


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": []},
        {"messages": "hello"},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {"messages": [{"role": "user", "content": 5}]},
        [1, 2, 3],
    ],
)
async def test_malformed_chat_bodies_are_400(client: httpx.AsyncClient, body: Any) -> None:
    r = await client.post("/v1/chat/completions", json=body)
    assert_error(r, 400, "BadRequestError")


@pytest.mark.parametrize("stream", [False, True])
async def test_top_k_past_the_vocabulary_is_400(client: httpx.AsyncClient, stream: bool) -> None:
    # The worker's rule, checked by the gateway too: past int32 it could not even be sent.
    for top_k in (100000, 2**40):
        body = {"messages": MSG, "top_k": top_k, "stream": stream}
        r = await client.post("/v1/chat/completions", json=body)
        err = assert_error(r, 400, "BadRequestError")
        assert "top_k" in err["message"]
        assert err["param"] == "top_k"


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 1e-40},  # greedy: dividing logits by it would overflow float32
        {"temperature": 3.4e38, "min_tokens": 1},  # the largest float32
        {"top_p": 1e-50},  # below float32's range: still the most likely token only
    ],
)
async def test_extreme_sampling_values_leave_the_worker_alive(
    client: httpx.AsyncClient, extra: dict[str, Any]
) -> None:
    """Values like these once reached the worker as 0 or infinity, and its sampler's NaNs
    ended its engine: every later request got a 503."""
    r = await client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    r = await client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1})
    assert r.status_code == 200, r.text


async def test_lone_surrogate_is_400(client: httpx.AsyncClient) -> None:
    for body in (
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"prompt": "x", "stop": "\\udfff"}',
    ):
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
        err = assert_error(r, 400, "BadRequestError")
        assert "lone surrogate" in err["message"]


async def test_extreme_seeds_are_accepted(client: httpx.AsyncClient) -> None:
    for seed in (-(2**63), -1, 2**63 - 1):
        body = {"messages": MSG, "seed": seed, "n": 2, "max_tokens": 1}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, (seed, r.text)


async def test_invalid_json_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    err = assert_error(r, 400, "BadRequestError")
    assert "JSON" in err["message"]


async def test_bad_completion_params_are_400(client: httpx.AsyncClient) -> None:
    for extra in ({"logprobs": 21}, {"best_of": 3}, {"suffix": "x"}, {"temperature": "hot"}):
        r = await client.post("/v1/completions", json={"prompt": "x", **extra})
        assert_error(r, 400, "BadRequestError")


async def test_stream_errors_before_start_are_plain_http_errors(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post(
        "/v1/chat/completions", json={"messages": MSG, "stream": True, "model": "nope"}
    )
    assert_error(r, 404, "NotFoundError")


async def test_unknown_endpoint_and_method(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing"), 404, "NotFoundError")
    assert_error(await client.get("/v1/chat/completions"), 405, "MethodNotAllowedError")


async def test_api_key(make_gateway: Any) -> None:
    async with make_gateway(api_key="sekrit") as client:
        err = assert_error(await client.get("/v1/models"), 401, "AuthenticationError")
        assert "API key" in err["message"]
        wrong = {"Authorization": "Bearer nope"}
        assert_error(await client.get("/v1/models", headers=wrong), 401, "AuthenticationError")
        r = await client.post(
            "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}, headers=wrong
        )
        assert_error(r, 401, "AuthenticationError")
        ok = {"Authorization": "Bearer sekrit"}
        assert (await client.get("/v1/models", headers=ok)).status_code == 200
        r = await client.post(
            "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}, headers=ok
        )
        assert r.status_code == 200, r.text
        # Probes and scrapers need no key.
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


async def test_body_limit_is_413(make_gateway: Any) -> None:
    async with make_gateway(max_request_bytes=300) as client:
        big = [{"role": "user", "content": "x" * 400}]
        r = await client.post("/v1/chat/completions", json={"messages": big})
        assert_error(r, 413, "RequestTooLargeError")

        async def chunked() -> Any:  # no Content-Length: the limit applies while reading
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"x" * 100
            yield b'"}]}'

        r = await client.post(
            "/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}
        )
        assert_error(r, 413, "RequestTooLargeError")
        small = await client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1})
        assert small.status_code == 200, small.text
