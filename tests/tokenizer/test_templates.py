"""Chat templates rendered and tokenized exactly as transformers' ``apply_chat_template`` does
(transformers is the oracle), over GLM-4.6's released template and one that uses every
feature transformers adds to Jinja.

glm46_chat_template.jinja: zai-org/GLM-4.6's chat template as llama.cpp keeps it
(ggml-org/llama.cpp, models/templates/GLM-4.6.jinja, commit
afefa651447358ae477f31a0ea1b97adff04c64f)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from dhisparse.tokenizer import (
    ChatTemplateError,
    DeepseekV32Formatter,
    HFTokenizer,
    TemplateFormatter,
    chat_formatter,
    load_tokenizer,
)
from dhisparse.tokenizer.encoding_dsv32 import encode_messages

from .helpers import (
    DSV32_SPECIALS,
    FEATURES_TEMPLATE,
    GLM46_TEMPLATE,
    GLM_SPECIALS,
    TOOL_USE_TEMPLATE,
    added_token,
    dsv32_tokenizer_config,
    glm_tokenizer_config,
    write_model_dir,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city on a day",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CHATS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2? /nothink"},
    ],
    "multi_turn_reasoning": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am GLM.", "reasoning_content": "A name question."},
        {"role": "user", "content": "And in Chinese? 中文"},
        {"role": "assistant", "content": "<think>\nTranslate it.\n</think>\n我是 GLM。"},
    ],
    "tool_calls": [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two calls.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                },
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                },
                {"type": "function", "function": {"name": "noop", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": '{"sky": "sunny"}'},
        {"role": "tool", "content": '{"sky": "snow"}'},
        {"role": "tool", "content": "{}"},
    ],
}
# GLM's template iterates the arguments' items: text arguments are not for it.
TEXT_ARGUMENTS = {
    "role": "assistant",
    "tool_calls": [{"function": {"name": "f", "arguments": "not an object"}}],
}
KWARGS: list[dict[str, Any]] = [
    {},
    {"enable_thinking": False},
    {"enable_thinking": True},
    {"reasoning_effort": "high", "enable_thinking": False},
]


def _reference(path: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _reference_ids(ref: PreTrainedTokenizerFast, messages: list[dict], **kw: Any) -> list[int]:
    out = ref.apply_chat_template(copy.deepcopy(messages), tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _check_equal(path: Path, chats: dict[str, list[dict]], kwargs_list: list[dict]) -> int:
    """Renders every chat with every kwargs, with and without a generation prompt and tools,
    ours against transformers'; returns how many renderings were compared."""
    ours = chat_formatter(load_tokenizer(path), path)
    ref = _reference(path)
    n = 0
    for messages in chats.values():
        for kwargs in kwargs_list:
            for gen in (True, False):
                for tools in (None, [WEATHER_TOOL]):
                    kw = {"add_generation_prompt": gen, "tools": tools, **kwargs}
                    text = ref.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kw)
                    assert ours.render(messages, **kw) == text, (messages, kw)
                    assert ours.encode(messages, **kw) == _reference_ids(ref, messages, **kw)
                    n += 1
    return n


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = glm_tokenizer_config(chat_template=GLM46_TEMPLATE)
    return write_model_dir(tmp_path_factory.mktemp("glm"), GLM_SPECIALS, cfg)


def test_glm_template_in_tokenizer_config_renders_as_transformers(glm_dir: Path) -> None:
    assert isinstance(chat_formatter(load_tokenizer(glm_dir), glm_dir), TemplateFormatter)
    assert _check_equal(glm_dir, CHATS, KWARGS) == len(CHATS) * len(KWARGS) * 4


def test_glm_template_in_chat_template_jinja_renders_as_transformers(tmp_path: Path) -> None:
    # transformers 5 saves the template beside the config; the file wins over a config entry.
    cfg = glm_tokenizer_config(chat_template="{{ raise_exception('the file wins') }}")
    path = write_model_dir(tmp_path, GLM_SPECIALS, cfg, chat_template_file=GLM46_TEMPLATE)
    assert load_tokenizer(path).chat_template == GLM46_TEMPLATE
    _check_equal(path, CHATS, KWARGS[:2])


def test_transformers_features_render_as_transformers(tmp_path: Path) -> None:
    """Generation blocks, loop controls, strftime_now, tojson's options, special tokens as
    variables (AddedToken objects among them), documents, named templates ("tool_use" when
    tools are given), added tokens that tokenizer.json lacks."""
    cfg = glm_tokenizer_config(
        bos_token={"__type": "AddedToken", "content": "[gMASK]", "special": True},
        chat_template=[
            {"name": "default", "template": FEATURES_TEMPLATE},
            {"name": "tool_use", "template": TOOL_USE_TEMPLATE},
        ],
        added_tokens_decoder={"420": added_token("<|image|>"), "421": added_token("<mark>", False)},
    )
    path = write_model_dir(tmp_path, GLM_SPECIALS, cfg)
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and set(tok.chat_templates) == {"default", "tool_use"}
    assert tok.encode("a<|image|>b<mark>") == _reference(path).encode(
        "a<|image|>b<mark>", add_special_tokens=False
    )
    assert tok.is_special(420) and not tok.is_special(421)
    chats = {**CHATS, "image": [{"role": "user", "content": "see <|image|> here <mark>"}]}
    docs = [{"title": "Paris", "text": "Capital of France."}, {"title": "Oslo", "text": "Snow"}]
    kwargs = [{}, {"reasoning_effort": "low", "documents": docs}, {"enable_thinking": False}]
    _check_equal(path, chats, kwargs)


def test_special_tokens_are_variables_a_keyword_overrides(glm_dir: Path) -> None:
    tok = load_tokenizer(glm_dir)
    assert tok.special_tokens == {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    assert tok.bos_token_id is None and tok.eos_token_id == tok.encode("<|endoftext|>")[0]
    fmt = TemplateFormatter(tok)
    tok.chat_templates = {"default": "{{ eos_token }}|{{ pad_token }}"}
    assert fmt.render([{"role": "user", "content": "x"}]) == "<|endoftext|>|<|endoftext|>"
    assert fmt.render([{"role": "user", "content": "x"}], eos_token="E") == "E|<|endoftext|>"


def test_deepseek_v32_without_template_uses_its_encoder(tmp_path: Path) -> None:
    path = write_model_dir(
        tmp_path,
        DSV32_SPECIALS,
        dsv32_tokenizer_config(),
        config={"model_type": "deepseek_v32", "eos_token_id": 1},
    )
    tok = load_tokenizer(path)
    fmt = chat_formatter(tok, path)
    assert isinstance(fmt, DeepseekV32Formatter)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    messages = CHATS["multi_turn_reasoning"][:4]
    assert fmt.render(messages) == encode_messages(messages, "chat")
    for kw in ({"thinking": True}, {"enable_thinking": True}, {"thinking_mode": "thinking"}):
        assert fmt.render(messages, **kw) == encode_messages(messages, "thinking")
    prompt = fmt.render(messages, thinking=True)
    assert prompt.startswith("<｜begin▁of▁sentence｜>") and prompt.endswith(
        "<｜Assistant｜><think>"
    )
    assert fmt.encode(messages, thinking=True) == _reference(path).encode(
        prompt, add_special_tokens=False
    )
    assert fmt.encode(messages)[0] == tok.bos_token_id
    # Tools join the leading system message, or come in one of their own.
    assert fmt.render(messages, tools=[WEATHER_TOOL]) == encode_messages(
        [{**messages[0], "tools": [WEATHER_TOOL]}, *messages[1:]], "chat"
    )
    alone = fmt.render(messages[1:2], tools=[WEATHER_TOOL])
    assert alone.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n")
    with pytest.raises(ChatTemplateError, match="thinking must be true or false"):
        fmt.render(messages, thinking="yes")


def test_a_template_wins_over_the_deepseek_encoder(tmp_path: Path) -> None:
    path = write_model_dir(
        tmp_path,
        DSV32_SPECIALS,
        {**dsv32_tokenizer_config(), "chat_template": "{{ messages[0].content }}"},
        config={"model_type": "deepseek_v32"},
    )
    fmt = chat_formatter(load_tokenizer(path), path)
    assert isinstance(fmt, TemplateFormatter)
    assert fmt.render([{"role": "user", "content": "hi"}]) == "hi"


@pytest.mark.parametrize(
    ("template", "messages", "match"),
    [
        ("{% for m in messages %}{{ m.content", [{"role": "user"}], "chat template failed"),
        ("{{ raise_exception('no ' ~ messages[0].role) }}", [{"role": "x"}], "^no x$"),
        ("{{ 1 + messages[0].content }}", [{"role": "user", "content": "a"}], "TypeError"),
        (GLM46_TEMPLATE, [*CHATS["user"], TEXT_ARGUMENTS], "chat template failed"),
        ("{{ messages.pop() }}", [{"role": "user", "content": "a"}], "chat template failed"),
        ("", [{"role": "user", "content": "a"}], "no chat template"),
    ],
    ids=["syntax", "raise_exception", "python-error", "bad-arguments", "sandbox", "none"],
)
def test_bad_template_input_is_a_chat_template_error(
    glm_dir: Path, template: str, messages: list[dict], match: str
) -> None:
    tok = load_tokenizer(glm_dir)
    tok.chat_templates = {"default": template} if template else {}
    with pytest.raises(ChatTemplateError, match=match):
        TemplateFormatter(tok).render(messages)
