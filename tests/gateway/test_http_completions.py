"""/v1/completions, /v1/models, /health and /metrics through the gateway app, against the real
worker."""

from __future__ import annotations

from typing import Any

import httpx

from dhisparse import metrics as names
from dhisparse.tokenizer import ByteTokenizer

from .conftest import MODEL, sse_events

PROMPT = "Once upon a time"


async def complete(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/completions", json={"prompt": PROMPT, **body})


async def test_completion_shape_and_usage(client: httpx.AsyncClient) -> None:
    r = await complete(client, model=MODEL, max_tokens=6, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] == "length"
    prompt_tokens = len(ByteTokenizer().encode(PROMPT, add_bos=True))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 6,
        "total_tokens": prompt_tokens + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_token_id_prompt_equals_text_prompt(client: httpx.AsyncClient) -> None:
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ids = ByteTokenizer().encode(PROMPT, add_bos=True)
    by_text = (await complete(client, **greedy)).json()
    by_ids = (await client.post("/v1/completions", json={"prompt": ids, **greedy})).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"] == by_text["usage"]


async def test_batch_prompts_times_n(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        json={"prompt": ["a", "bb"], "n": 2, "max_tokens": 2, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 2 + 3  # each prompt once, with its BOS
    assert body["usage"]["completion_tokens"] == 8


async def test_stream_matches_non_stream(client: httpx.AsyncClient) -> None:
    greedy = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = (await complete(client, **greedy)).json()
    r = await complete(client, stream=True, stream_options={"include_usage": True}, **greedy)
    assert r.status_code == 200
    *chunks, usage_chunk = sse_events(r.text)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == full["usage"]


async def test_logprobs_legacy_format(client: httpx.AsyncClient) -> None:
    r = await complete(client, max_tokens=4, ignore_eos=True, logprobs=2)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 4
    assert len(lp["top_logprobs"]) == 4
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert token in top  # the sampled token is always listed
        # Keyed by token text: bytes that are not UTF-8 on their own all show as U+FFFD.
        assert 0 < len(top) <= 3
    assert lp["text_offset"] == sorted(lp["text_offset"])


async def test_bad_prompts_are_400(client: httpx.AsyncClient) -> None:
    for body in (
        {"prompt": [1, 99999]},
        {"prompt": []},
        {"prompt": {"text": "x"}},
    ):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "BadRequestError"


async def test_models(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL
    assert card["object"] == "model"
    assert card["owned_by"] == "dhisparse"
    assert isinstance(card["created"], int)
    assert card["max_model_len"] > 0


async def test_served_model_name_overrides(make_gateway: Any) -> None:
    async with make_gateway(served_model_name="my-model") as client:
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "my-model"
        r = await complete(client, model="my-model", max_tokens=1)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "my-model"
        assert (await complete(client, model=MODEL, max_tokens=1)).status_code == 404


async def test_health(client: httpx.AsyncClient) -> None:
    r = await client.get("/health")
    assert r.status_code == 200
    assert set(r.json()["workers"].values()) == {"healthy"}


async def test_metrics_after_requests(client: httpx.AsyncClient) -> None:
    await complete(client, max_tokens=3, ignore_eos=True)
    await complete(client, max_tokens=3, ignore_eos=True, stream=True)
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        names.NUM_REQUESTS_RUNNING,
        names.NUM_REQUESTS_WAITING,
        names.TIME_TO_FIRST_TOKEN + "_bucket",
        names.TIME_PER_OUTPUT_TOKEN + "_bucket",
        names.E2E_REQUEST_LATENCY + "_bucket",
        names.PROMPT_TOKENS + "_total",
        names.GENERATION_TOKENS + "_total",
        names.REQUEST_SUCCESS + "_total",
    ):
        assert name in text, name
    assert f'{names.GENERATION_TOKENS}_total{{model="{MODEL}"}} 6.0' in text
    assert f'{names.REQUEST_SUCCESS}_total{{finished_reason="length",model="{MODEL}"}} 2.0' in text
    assert f'{names.NUM_REQUESTS_RUNNING}{{model="{MODEL}"}} 0.0' in text
    assert f'{names.NUM_REQUESTS_WAITING}{{model="{MODEL}"}} 0.0' in text
