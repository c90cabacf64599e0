"""The echo module on hand-built worker entries: legacy logprobs with the prompt's first (null
first, offsets running on), vLLM's ``prompt_logprobs`` (the token first, ranks by position,
null where the token is outside the alternatives sent), and the 503 when a
choice that needs its prompt's scores has none."""

from __future__ import annotations

import pytest

from dhisparse.rpc import worker_pb2
from services.gateway.convert import LOGPROB_FLOOR, generation_delta
from services.gateway.echo import PromptEcho, echoed_logprobs, vllm_prompt_logprobs
from services.gateway.errors import APIError
from services.gateway.generation import TokenLogprob, TopLogprob

PROMPT = (
    TokenLogprob(1, "<s>", 0.0),  # the worker's placeholder
    TokenLogprob(7, "ab", -1.5, (TopLogprob(7, "ab", -1.5), TopLogprob(9, "c", -2.0))),
    TokenLogprob(5, "d", LOGPROB_FLOOR, (TopLogprob(9, "c", -0.1), TopLogprob(8, "e", -3.0))),
)
GENERATED = (TokenLogprob(8, "e", -0.2, (TopLogprob(8, "e", -0.2),)),)


def test_minus_infinity_arrives_floored() -> None:
    """JSON has no infinity: a forbidden token's -inf, generated or in the prompt, alternative
    or sampled, becomes LOGPROB_FLOOR as the worker's answer is read."""
    inf = float("-inf")
    entry = worker_pb2.TokenLogprob(
        token_id=5, token="d", logprob=inf,
        top=[worker_pb2.TopLogprob(token_id=9, token="c", logprob=inf)],
    )  # fmt: skip
    delta = generation_delta(worker_pb2.GenerateResponse(logprobs=[entry], prompt_logprobs=[entry]))
    for lp in (*delta.logprobs, *delta.prompt_logprobs):
        assert lp.logprob == LOGPROB_FLOOR and lp.top[0].logprob == LOGPROB_FLOOR


def test_echoed_logprobs_put_the_prompt_first() -> None:
    lp = echoed_logprobs(PROMPT, GENERATED, top=1)
    assert lp.tokens == ["<s>", "ab", "d", "e"]
    assert lp.token_logprobs == [None, -1.5, LOGPROB_FLOOR, -0.2]
    assert lp.top_logprobs == [None, {"ab": -1.5}, {"c": -0.1, "d": LOGPROB_FLOOR}, {"e": -0.2}]
    assert lp.text_offset == [0, 3, 5, 6]


def test_vllm_prompt_logprobs_shape() -> None:
    out = vllm_prompt_logprobs(PROMPT, top=2)
    assert out[0] is None and len(out) == 3
    first, second = out[1], out[2]
    assert first is not None and second is not None
    assert list(first) == [7, 9]
    assert (first[7].logprob, first[7].rank, first[7].decoded_token) == (-1.5, 1, "ab")
    assert first[9].rank == 2
    assert list(second) == [5, 9, 8]  # the prompt token first, then the alternatives
    assert second[5].rank is None and second[5].logprob == LOGPROB_FLOOR
    assert [second[9].rank, second[8].rank] == [1, 2]
    assert [list(e) for e in vllm_prompt_logprobs(PROMPT, top=0)[1:]] == [[7], [5]]


def test_begin_without_echo_is_the_plain_choice() -> None:
    text, lp, scored = PromptEcho(top=1).begin(0, "xy", (), GENERATED)
    assert text == "xy" and scored is None
    assert lp is not None and lp.tokens == ["e"] and lp.text_offset == [0]
    text, lp, scored = PromptEcho(("hi", "yo")).begin(1, "xy", (), GENERATED)
    assert (text, lp, scored) == ("yoxy", None, None)  # echo without logprobs needs no scores


@pytest.mark.parametrize(
    "echo", [PromptEcho(("p",), top=1), PromptEcho(prompt_top=1), PromptEcho(("p",), 0, 2)]
)
def test_a_choice_that_needs_its_prompts_scores_and_has_none_is_503(echo: PromptEcho) -> None:
    with pytest.raises(APIError) as e:
        echo.begin(0, "x", (), GENERATED)
    assert e.value.status == 503 and "choice 0" in str(e.value.body())
