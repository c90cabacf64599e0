"""/v1/chat/completions through the gateway app, against the real worker (tiny-glm on CPU;
random weights, so tests compare the gateway against itself: greedy output is deterministic)."""

from __future__ import annotations

from typing import Any

import httpx

from dhisparse.tokenizer import ByteTokenizer, render_chat

from .conftest import MODEL, WorkerProcess, sse_events

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
]


def prompt_len(messages: list[dict[str, str]]) -> int:
    tok = ByteTokenizer()
    return len(tok.encode(render_chat(tok.chat_template, messages)))


async def chat(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})


async def test_chat_completion_shape_and_usage(client: httpx.AsyncClient) -> None:
    r = await chat(client, model=MODEL, max_tokens=8, temperature=0, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    assert body["usage"] == {
        "prompt_tokens": prompt_len(MESSAGES),
        "completion_tokens": 8,
        "total_tokens": prompt_len(MESSAGES) + 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_model_may_be_omitted(client: httpx.AsyncClient) -> None:
    r = await chat(client, max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


async def test_max_completion_tokens_wins_over_max_tokens(client: httpx.AsyncClient) -> None:
    r = await chat(client, max_tokens=9, max_completion_tokens=3, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_content_parts_render_like_joined_text(client: httpx.AsyncClient) -> None:
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": parts}], "max_tokens": 1},
    )
    assert r.status_code == 200, r.text
    expected = prompt_len([{"role": "user", "content": "Say\nhello."}])
    assert r.json()["usage"]["prompt_tokens"] == expected


async def test_stream_matches_non_stream_and_frames(client: httpx.AsyncClient) -> None:
    common = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = (await chat(client, **common)).json()
    r = await chat(client, stream=True, stream_options={"include_usage": True}, **common)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    first, *middle, usage_chunk = events
    assert first["object"] == "chat.completion.chunk"
    assert first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert {e["id"] for e in events} == {first["id"]}
    choices = [e["choices"][0] for e in middle]
    assert all(c["finish_reason"] is None for c in choices[:-1])
    assert choices[-1]["finish_reason"] == "length"
    assert all(e["usage"] is None for e in [first, *middle])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == full["usage"]
    text = "".join(c["delta"].get("content", "") for c in choices)
    assert text == full["choices"][0]["message"]["content"]


async def test_stream_without_include_usage_has_no_usage(client: httpx.AsyncClient) -> None:
    r = await chat(client, max_tokens=3, stream=True)
    events = sse_events(r.text)
    assert all("usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_n2_fans_out_and_multiplexes(client: httpx.AsyncClient) -> None:
    r = await chat(client, n=2, max_tokens=5, seed=7, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 10
    assert body["usage"]["prompt_tokens"] == prompt_len(MESSAGES)
    # Seeded: the same request gives the same choices.
    again = (await chat(client, n=2, max_tokens=5, seed=7, ignore_eos=True)).json()
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in body["choices"]]

    r = await chat(client, n=2, max_tokens=4, seed=7, ignore_eos=True, stream=True)
    events = sse_events(r.text)
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for e in events:
        [c] = e["choices"]
        by_index[c["index"]].append(c)
    for cs in by_index.values():
        assert cs[0]["delta"]["role"] == "assistant"
        assert [c["finish_reason"] for c in cs][-1] == "length"
        assert all(c["finish_reason"] is None for c in cs[:-1])
    streamed = ["".join(c["delta"].get("content", "") for c in by_index[i]) for i in (0, 1)]
    seeded = (await chat(client, n=2, max_tokens=4, seed=7, ignore_eos=True)).json()
    assert streamed == [c["message"]["content"] for c in seeded["choices"]]


async def test_logprobs(client: httpx.AsyncClient) -> None:
    r = await chat(client, max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for lp in content:
        assert isinstance(lp["token"], str)
        assert lp["logprob"] <= 0
        assert lp["bytes"] == list(lp["token"].encode())
        assert len(lp["top_logprobs"]) == 3
        assert all(t["logprob"] <= 0 for t in lp["top_logprobs"])

    r = await chat(client, max_tokens=3, ignore_eos=True, logprobs=True, stream=True)
    contents = [
        lp
        for e in sse_events(r.text)
        if e["choices"] and e["choices"][0].get("logprobs")
        for lp in e["choices"][0]["logprobs"]["content"]
    ]
    assert len(contents) == 3
    assert all(lp["top_logprobs"] == [] for lp in contents)


async def test_stop_string_ends_with_stop(client: httpx.AsyncClient) -> None:
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = (await chat(client, **greedy)).json()["choices"][0]["message"]["content"]
    stop = next(ch for ch in text[1:] if ch != "\ufffd" and ch.strip())
    r = await chat(client, stop=[stop], **greedy)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    assert choice["message"]["content"] == text[: text.index(stop)]


async def test_max_tokens_gives_length(client: httpx.AsyncClient) -> None:
    r = await chat(client, max_tokens=1, ignore_eos=True)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 1


async def test_context_overflow_is_400_with_vllm_message(client: httpx.AsyncClient) -> None:
    max_len = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
    p = prompt_len(MESSAGES)
    r = await chat(client, max_tokens=max_len)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError"
    assert err["code"] == 400
    assert err["message"] == (
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{p + max_len} tokens ({p} in the messages, {max_len} in the completion). Please "
        "reduce the length of the messages or completion."
    )
    long_messages = [{"role": "user", "content": "x" * max_len}]
    r = await client.post("/v1/chat/completions", json={"messages": long_messages})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt_len(long_messages)} tokens in the messages"
    )


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    r = await chat(client, model="gpt-9")
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "The model `gpt-9` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_bad_role_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]}
    )
    assert r.status_code == 400
    assert "unsupported role: wizard" in r.json()["error"]["message"]


async def test_image_part_is_400(client: httpx.AsyncClient) -> None:
    parts = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    r = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]}
    )
    assert r.status_code == 400
    assert "image_url" in r.json()["error"]["message"]


async def test_unknown_fields_are_ignored_and_named(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "hi", "colour": "blue"}]
    r = await chat(
        client, max_tokens=1, frobnicate=True, user="u-1", presence_penalty=0, messages=messages
    )
    assert r.status_code == 200, r.text
    assert r.headers["Warning"] == '299 dhisparse "ignored fields: frobnicate, messages[0].colour"'
    plain = await chat(client, max_tokens=1, user="u-1")
    assert "Warning" not in plain.headers


async def test_worker_is_idle_after_requests(
    client: httpx.AsyncClient, worker: WorkerProcess
) -> None:
    r = await chat(client, max_tokens=2)
    assert r.status_code == 200
    assert worker.wait_idle()
