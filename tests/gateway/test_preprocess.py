"""Pure pieces before any worker is asked: chat rendering, prompt ids, the completion budget and
sampling parameters."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dhisparse.family.generation import GenerationDefaults
from dhisparse.tokenizer import ByteTokenizer, DeepseekV32Formatter, TemplateFormatter
from services.gateway.errors import APIError
from services.gateway.generation import SamplingSpec
from services.gateway.preprocess import (
    Limits,
    chat_messages,
    chat_prompt_ids,
    chat_sampling,
    completion_prompt_ids,
    completion_sampling,
    resolve_max_tokens,
    template_roles,
)
from services.gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

TOK = ByteTokenizer()
CHAT = TemplateFormatter(TOK)
LIMITS = Limits(max_model_len=100, vocab_size=TOK.vocab_size, max_n=4, max_logprobs=5)


def chat_req(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **kw}
    )


def test_content_parts_join_with_newlines() -> None:
    msgs = [
        ChatMessage(role="system", content=None),
        ChatMessage.model_validate(
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "bob",
            }
        ),
    ]
    assert chat_messages(msgs) == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "a\nb", "name": "bob"},
    ]


def _with_template(template: str) -> TemplateFormatter:
    tok = ByteTokenizer()
    tok.chat_templates = {"default": template} if template else {}
    return TemplateFormatter(tok)


def test_roles_of_a_template() -> None:
    assert template_roles(CHAT) == ("system", "user", "assistant")
    only_user = "{% for m in messages %}{% if m['role'] != 'user' %}{{ raise_exception('no') }}"
    only_user += "{% endif %}{{ m['content'] }}{% endfor %}"
    assert template_roles(_with_template(only_user)) == ("user",)
    # no template: /v1/chat/completions refuses every chat
    assert template_roles(_with_template("")) == ()


def test_tiny_temperatures_are_greedy() -> None:
    # Dividing logits by a temperature this small overflows float32 in the worker's sampler.
    assert chat_sampling(chat_req(temperature=1e-40), 1, LIMITS).temperature == 0.0
    assert chat_sampling(chat_req(temperature=1e-5), 1, LIMITS).temperature == 1e-5


def test_chat_prompt_ids_render_template_with_generation_prompt() -> None:
    ids = chat_prompt_ids(CHAT, chat_req())
    assert TOK.decode(ids, skip_special_tokens=False) == "<|bos|><|user|>hi<|end|><|assistant|>"
    no_gen = chat_prompt_ids(CHAT, chat_req(add_generation_prompt=False))
    assert TOK.decode(no_gen, skip_special_tokens=False) == "<|bos|><|user|>hi<|end|>"


def test_template_kwargs_cannot_override_messages() -> None:
    ids = chat_prompt_ids(CHAT, chat_req(chat_template_kwargs={"messages": [], "x": 1}))
    assert TOK.decode(ids, skip_special_tokens=False) == "<|bos|><|user|>hi<|end|><|assistant|>"


def test_template_kwargs_may_have_any_name() -> None:
    names = {"self": 1, "template": 2, "tokenizer": 3, "variables": 4, "kwargs": 5, "a b": 6}
    for fmt in (CHAT, DeepseekV32Formatter(TOK)):
        assert chat_prompt_ids(fmt, chat_req(chat_template_kwargs=names))


def test_bad_role_is_a_400() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "ipython", "content": "x"}]})
    with pytest.raises(APIError) as e:
        chat_prompt_ids(CHAT, req)
    assert e.value.status == 400
    assert e.value.param == "messages"
    assert "unsupported role: ipython" in e.value.message


def test_completion_prompt_ids() -> None:
    assert completion_prompt_ids(TOK, "ab", LIMITS.vocab_size) == [TOK.bos_token_id, 97, 98]
    assert completion_prompt_ids(TOK, [1, 2], LIMITS.vocab_size) == [1, 2]
    with pytest.raises(APIError, match="out of range"):
        completion_prompt_ids(TOK, [1, LIMITS.vocab_size], LIMITS.vocab_size)
    with pytest.raises(APIError, match="empty"):
        completion_prompt_ids(TOK, [], LIMITS.vocab_size)


def test_resolve_max_tokens() -> None:
    assert resolve_max_tokens(10, 90, LIMITS) == 90
    assert resolve_max_tokens(10, None, LIMITS) == 90  # what the context leaves
    capped = Limits(max_model_len=100, vocab_size=10, default_max_tokens=16)
    assert resolve_max_tokens(10, None, capped) == 16
    assert resolve_max_tokens(95, None, capped) == 5


def test_context_overflow_messages() -> None:
    with pytest.raises(APIError) as e:
        resolve_max_tokens(10, 91, LIMITS)
    assert e.value.status == 400
    assert e.value.error_type == "BadRequestError"
    assert e.value.message == (
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens "
        "(10 in the messages, 91 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    with pytest.raises(APIError) as e:
        resolve_max_tokens(100, None, LIMITS)
    assert e.value.message.startswith(
        "This model's maximum context length is 100 tokens. However, you requested 100 tokens "
        "in the messages"
    )


def test_chat_sampling_defaults_and_mapping() -> None:
    s = chat_sampling(chat_req(), 7, LIMITS)
    assert s == SamplingSpec(max_tokens=7)
    s = chat_sampling(
        chat_req(
            temperature=0,
            top_p=0.5,
            top_k=3,
            seed=-1,
            stop="x",
            stop_token_ids=[5],
            logprobs=True,
            top_logprobs=2,
            min_tokens=9,
            ignore_eos=True,
        ),
        4,
        LIMITS,
    )
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 0.5, 3)
    assert s.seed == 2**63 - 1  # signed OpenAI seed -> the worker's [0, 2^63)
    assert s.stop == ("x",) and s.stop_token_ids == (5,)
    assert s.want_logprobs and s.top_logprobs == 2
    assert s.min_tokens == 4  # never more than the budget
    assert s.ignore_eos


def test_generation_config_supplies_what_a_request_leaves_out() -> None:
    stated = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20)
    limits = replace(LIMITS, generation=stated)
    s = chat_sampling(chat_req(), 1, limits)
    assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.95, 20)
    s = chat_sampling(chat_req(temperature=1.0, top_p=0.5, top_k=-1), 1, limits)
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 0.5, -1)
    s = completion_sampling(CompletionRequest(prompt="x", top_k=0), 1, limits)
    assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.95, 0)
    greedy = replace(LIMITS, generation=GenerationDefaults(do_sample=False, temperature=0.6))
    assert chat_sampling(chat_req(), 1, greedy).temperature == 0.0
    assert chat_sampling(chat_req(temperature=0.7), 1, greedy).temperature == 0.7
    # Nothing stated: the server's own defaults.
    s = chat_sampling(chat_req(), 1, LIMITS)
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, 0)


def test_deepseek_v32_thinking_comes_from_chat_template_kwargs() -> None:
    fmt = DeepseekV32Formatter(TOK)
    off = TOK.decode(chat_prompt_ids(fmt, chat_req()), skip_special_tokens=False)
    assert off.endswith("<｜User｜>hi<｜Assistant｜></think>")
    for kwargs in ({"thinking": True}, {"enable_thinking": True}):
        ids = chat_prompt_ids(fmt, chat_req(chat_template_kwargs=kwargs))
        on = TOK.decode(ids, skip_special_tokens=False)
        assert on.endswith("<｜User｜>hi<｜Assistant｜><think>")
    with pytest.raises(APIError) as e:
        chat_prompt_ids(fmt, chat_req(chat_template_kwargs={"thinking": "maybe"}))
    assert e.value.status == 400 and e.value.param == "messages"


def test_template_kwargs_cannot_bring_tools() -> None:
    fmt = _with_template("{{ tools | tojson }}")
    assert TOK.decode(chat_prompt_ids(fmt, chat_req(chat_template_kwargs={"tools": [{}]}))) == (
        "null"
    )


def test_seeded_choices_differ_but_reproduce() -> None:
    s = SamplingSpec(max_tokens=1, seed=2**63 - 1)
    assert [s.for_choice(i).seed for i in range(3)] == [2**63 - 1, 0, 1]
    assert SamplingSpec(max_tokens=1).for_choice(3).seed is None


def test_server_limits_are_400() -> None:
    with pytest.raises(APIError, match="n must be at most 4") as e:
        chat_sampling(chat_req(n=5), 1, LIMITS)
    assert e.value.param == "n"
    with pytest.raises(APIError, match="at most 5 logprobs"):
        chat_sampling(chat_req(logprobs=True, top_logprobs=6), 1, LIMITS)
    with pytest.raises(APIError, match="stop token id"):
        chat_sampling(chat_req(stop_token_ids=[LIMITS.vocab_size]), 1, LIMITS)
    with pytest.raises(APIError, match="top_k must be <= vocab size") as e:
        chat_sampling(chat_req(top_k=2**40), 1, LIMITS)  # past int32: not even sendable
    assert e.value.param == "top_k"


def test_completion_logprobs_mapping() -> None:
    req = CompletionRequest(prompt="x")
    assert not completion_sampling(req, 1, LIMITS).want_logprobs
    s = completion_sampling(CompletionRequest(prompt="x", logprobs=0), 1, LIMITS)
    assert s.want_logprobs and s.top_logprobs == 0
    s = completion_sampling(CompletionRequest(prompt="x", logprobs=3), 1, LIMITS)
    assert s.want_logprobs and s.top_logprobs == 3
