"""``echo`` and prompt logprobs on /v1/completions through the gateway app, against the real
worker: the shape OpenAI and vLLM answer (the prompt's text first, its tokens' logprobs first
with a null for the first token), values equal to one whole forward of the same model over the
prompt, the payload lm-evaluation-harness's ``local-completions`` sends for log-likelihoods,
``max_tokens`` 0, streaming, and vLLM's ``prompt_logprobs`` extra."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import httpx
import pytest
import torch

from dhisparse.tokenizer import ByteTokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.kv.config import KVCacheConfig
from services.worker.serving.cache import KVCache
from tests.worker.helpers import run_chunks

from .conftest import sse_events

PROMPT = "The sparse indexer picks rows"
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def reference() -> Any:
    """``log_softmax`` of the worker's model's logits over a prompt, one whole forward (the
    worker serves tiny-glm with the default seed)."""
    engine = Engine(EngineConfig(model="tiny-glm", kv_pool_mib=8))
    model = engine.model

    @torch.no_grad()
    def logprobs(ids: list[int]) -> torch.Tensor:
        kv = KVCache(model.cfg, KVCacheConfig(max_slots=1, max_model_len=512))
        hidden = run_chunks(model, kv, torch.tensor(ids), [len(ids)])
        kv.close()
        return torch.log_softmax(model.logits(hidden), dim=-1)

    return logprobs


async def complete(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def check_prompt_entries(lp: dict[str, Any], ids: list[int], want: torch.Tensor, top: int) -> None:
    """The first ``len(ids)`` entries of legacy logprobs against the reference."""
    n = len(ids)
    assert lp["tokens"][:n] == [TOK.token_text(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expect = want[torch.arange(n - 1), ids[1:]]
    got = torch.tensor(lp["token_logprobs"][1:n])
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=0)
    for j in range(1, n):
        # keyed by token text (in this byte-level vocabulary bytes that are not UTF-8 on their
        # own share one), the token itself among them
        values, top_ids = torch.topk(want[j - 1], top)
        expect_top = {
            TOK.token_text(int(t)): float(v) for t, v in zip(top_ids, values, strict=True)
        }
        expect_top.setdefault(TOK.token_text(ids[j]), float(want[j - 1, ids[j]]))
        got_top = lp["top_logprobs"][j]
        assert got_top.keys() == expect_top.keys()
        assert list(got_top.values()) == pytest.approx(list(expect_top.values()), abs=1e-4)
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets


async def test_echo_with_logprobs_prepends_the_prompt(client, reference) -> None:
    ids = TOK.encode_prompt(PROMPT)
    body = await complete(
        client, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0, ignore_eos=True
    )
    plain = await complete(client, prompt=PROMPT, logprobs=2, max_tokens=3, temperature=0,
                           ignore_eos=True)  # fmt: skip
    [choice], [alone] = body["choices"], plain["choices"]
    assert choice["text"] == PROMPT + alone["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    check_prompt_entries(lp, ids, reference(ids), 2)
    # the generated tokens' entries follow, as without echo (which shares the pages the echo
    # left on the device: a prefix split into other passes rounds otherwise)
    assert lp["tokens"][len(ids) :] == alone["logprobs"]["tokens"]
    got = lp["token_logprobs"][len(ids) :]
    assert got == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-5)
    cached = plain["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(ids) - 1 - (len(ids) - 1) % 16  # the echo's pages (computed whole)
    assert body["usage"] | {"prompt_tokens_details": {"cached_tokens": cached}} == plain["usage"]
    assert choice["prompt_logprobs"] is None  # vLLM's extra: not asked


async def test_lm_eval_loglikelihood_payload(client, reference) -> None:
    """What lm-evaluation-harness's ``local-completions`` posts for log-likelihoods (token ids,
    a batch, echo, logprobs 1, max_tokens 1) and how it reads the answer: the continuation's
    summed logprobs (``token_logprobs[ctxlen:-1]``) and whether it is greedy."""
    context, continuations = TOK.encode_prompt("Once upon"), [list(b" a time"), list(b"zzzz")]
    batch = [context + c for c in continuations]
    body = await complete(client, model="tiny-glm", prompt=batch, temperature=0, max_tokens=1,
                          logprobs=1, seed=1234, echo=True)  # fmt: skip
    choices = sorted(body["choices"], key=itemgetter("index"))
    assert len(choices) == 2
    for choice, ids in zip(choices, batch, strict=True):
        lp = choice["logprobs"]
        ctxlen = len(context)
        assert len(lp["token_logprobs"]) == len(ids) + 1
        want = reference(ids)
        summed = sum(lp["token_logprobs"][ctxlen:-1])
        expect = sum(float(want[p - 1, ids[p]]) for p in range(ctxlen, len(ids)))
        assert summed == pytest.approx(expect, abs=1e-3)
        greedy = all(
            tok == max(top.values())
            for tok, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1],
                                strict=True)
        )  # fmt: skip
        expect_greedy = all(int(want[p - 1].argmax()) == ids[p] for p in range(ctxlen, len(ids)))
        assert greedy == expect_greedy
        assert choice["text"].startswith(TOK.decode(ids, skip_special_tokens=False))


async def test_max_tokens_zero_echoes_the_prompt_alone(client, reference) -> None:
    ids = TOK.encode_prompt(PROMPT)
    body = await complete(client, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    [choice] = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    check_prompt_entries(choice["logprobs"], ids, reference(ids), 3)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids)
    bare = await complete(client, prompt=PROMPT, echo=True, max_tokens=0)  # no logprobs asked
    assert bare["choices"][0]["text"] == PROMPT and bare["choices"][0]["logprobs"] is None


async def test_stream_with_echo_begins_with_the_prompt(client) -> None:
    greedy = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 6, "temperature": 0,
              "ignore_eos": True}  # fmt: skip
    full = (await complete(client, **greedy))["choices"][0]
    r = await client.post("/v1/completions", json={**greedy, "stream": True})
    assert r.status_code == 200, r.text
    chunks = [c["choices"][0] for c in sse_events(r.text)]
    assert chunks[0]["text"].startswith(PROMPT)
    n = len(TOK.encode_prompt(PROMPT))
    assert len(chunks[0]["logprobs"]["tokens"]) >= n
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == full["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert [x for c in chunks for x in c["logprobs"][key]] == full["logprobs"][key]
    assert chunks[-1]["finish_reason"] == "length"


async def test_stream_of_max_tokens_zero_is_one_chunk(client) -> None:
    r = await client.post(
        "/v1/completions",
        json={"prompt": [PROMPT, "ab"], "echo": True, "max_tokens": 0, "stream": True},
    )
    assert r.status_code == 200, r.text
    chunks = sorted((c["choices"][0] for c in sse_events(r.text)), key=itemgetter("index"))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in chunks] == [
        (0, PROMPT, "length"),
        (1, "ab", "length"),
    ]


async def test_prompt_logprobs_extra_as_vllm_returns_it(client, reference) -> None:
    ids = TOK.encode_prompt(PROMPT)
    body = await complete(client, prompt=ids, prompt_logprobs=3, max_tokens=2, n=2, seed=7)
    want = reference(ids)
    for choice in body["choices"]:
        assert not choice["text"].startswith(PROMPT)  # no echo
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None
        for p in range(1, len(ids)):
            entry = scored[p]
            own = entry[str(ids[p])]
            assert own["logprob"] == pytest.approx(float(want[p - 1, ids[p]]), abs=1e-4)
            assert own["decoded_token"] == TOK.token_text(ids[p])
            top_ids = torch.topk(want[p - 1], 3).indices.tolist()
            ranked = {int(t): e["rank"] for t, e in entry.items() if e["rank"] is not None}
            assert ranked.get(top_ids[0]) == 1
            assert next(iter(entry)) == str(ids[p])  # the prompt token first, as vLLM orders it
            assert 3 <= len(entry) <= 4
            rank = top_ids.index(ids[p]) + 1 if ids[p] in top_ids else None
            assert own["rank"] == rank
    stream = await client.post(
        "/v1/completions",
        json={"prompt": ids, "prompt_logprobs": 1, "max_tokens": 2, "stream": True},
    )
    first = sse_events(stream.text)[0]["choices"][0]
    assert len(first["prompt_logprobs"]) == len(ids) and first["prompt_logprobs"][0] is None


async def test_echo_token_id_prompt_is_detokenized(client) -> None:
    ids = TOK.encode_prompt(PROMPT)
    body = await complete(client, prompt=ids, echo=True, max_tokens=1, ignore_eos=True)
    assert body["choices"][0]["text"].startswith(TOK.decode(ids, skip_special_tokens=False))
    assert body["choices"][0]["text"].startswith("<|bos|>" + PROMPT)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": PROMPT, "max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
async def test_bad_echo_requests_are_400(client, body: dict[str, Any], param: str) -> None:
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert param in r.text
