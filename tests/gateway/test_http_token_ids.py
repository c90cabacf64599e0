"""vLLM's ``return_token_ids`` on /v1/completions through the gateway app, against the real
worker: each choice's prompt and output ids, equal streamed and not, every token's id streamed
(readable text or not), and nothing added to a response that did not ask."""

from __future__ import annotations

from operator import itemgetter

from dhisparse.tokenizer import ByteTokenizer

from .conftest import sse_events

TOK = ByteTokenizer()
PROMPT = "Rows the indexer selects"


async def test_token_ids_as_vllm_returns_them(client) -> None:
    ids = TOK.encode_prompt(PROMPT)
    body = {"prompt": [PROMPT, PROMPT], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=itemgetter("index"))
    for c in choices:
        assert c["prompt_token_ids"] == ids  # a text prompt as the server tokenized it
        assert len(c["token_ids"]) == 12
        assert TOK.decode(c["token_ids"]) == c["text"]
    assert choices[0]["token_ids"] == choices[1]["token_ids"]  # greedy, the same prompt

    r = await client.post("/v1/completions", json={**body, "prompt": ids, "stream": True})
    assert r.status_code == 200, r.text
    chunks = [e["choices"][0] for e in sse_events(r.text) if e["choices"]]
    assert chunks[0]["prompt_token_ids"] == ids
    assert all(c.get("prompt_token_ids") is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choices[0]["token_ids"]
    assert "".join(c["text"] for c in chunks) == choices[0]["text"]


async def test_specials_stream_as_ids(client) -> None:
    """A token with no text of its own (a special id of the byte vocabulary, ``ignore_eos``
    past the end) still comes as a chunk with its id."""
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(TOK.eos_token_id): 100}, "stream": True,
            "return_token_ids": True}  # fmt: skip
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = [e["choices"][0] for e in sse_events(r.text) if e["choices"]]
    got = [t for c in chunks for t in c["token_ids"]]
    assert got == [TOK.eos_token_id] * 24
    assert "".join(c["text"] for c in chunks) == ""


async def test_not_asked_adds_nothing(client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert not {"token_ids", "prompt_token_ids"} & r.json()["choices"][0].keys()
    r = await client.post("/v1/completions", json={**body, "stream": True})
    for event in sse_events(r.text):
        for c in event["choices"]:
            assert not {"token_ids", "prompt_token_ids"} & c.keys()
