"""GLM-4.7's released chat template (GLM-5's family: the format xgrammar's "glm_4_7" style and
vLLM's glm47 parser read) rendered and tokenized by our formatter exactly as transformers'
``apply_chat_template`` does, over agent histories: tools, assistant tool calls with their
arguments as mappings, tool results, reasoning kept or dropped; on a tiny checkpoint with GLM's
special tokens and on the shipped model, whose chat template it is.

glm47_chat_template.jinja: GLM-4.7-Flash's chat template as llama.cpp keeps it
(ggml-org/llama.cpp, models/templates/GLM-4.7-Flash.jinja; the bytes whose sha256 the copy in
Raudbjorn/ggml-llama.cpp at commit 96fcab17564eac2bd9f4976c660616c7a0757e13 records as a Git LFS
pointer, d63ad536...; the text read from Anemll/anemll-flash-llama.cpp at commit
5564cb6654ceaf8df4f474211328eca132b05c1e with that copy's one edit, a guard on the arguments'
type, undone). Its lines are those of zai-org/GLM-4.7's chat_template.jinja on Hugging Face.
GLM-5's own template was not found in the public index; it differs in its reasoning guard."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from dhisparse.paths import ROOT
from dhisparse.tokenizer import TemplateFormatter, chat_formatter, load_tokenizer

from .helpers import GLM_SPECIALS, HERE, glm_tokenizer_config, write_model_dir

TEMPLATE_FILE = HERE / "glm47_chat_template.jinja"
TEMPLATE = TEMPLATE_FILE.read_text(encoding="utf-8")
SHA256 = "d63ad536c3c81880043e22ec7fd08db42b4d8fb7c89c7138bc562bfa25281375"
SHIPPED = ROOT / "models" / "glm-dsa-mini"

TOOLS = [
    {
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
    },
    {"type": "function", "function": {"name": "noop"}},
]


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# As the gateway hands them over (preprocess.chat_messages): arguments parsed into mappings.
AGENT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and 北京?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two calls, then answer.",
        "tool_calls": [
            _call("c1", "get_weather", {"city": "Paris", "days": 2}),
            _call("c2", "get_weather", {"city": "北京", "nested": {"a": [1, None]}}),
            _call("c3", "noop", {}),
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "sunny"}'},
    {"role": "tool", "tool_call_id": "c2", "content": "晴"},
    {"role": "tool", "tool_call_id": "c3", "name": "noop", "content": ""},
    {"role": "assistant", "content": "Sunny and 晴.", "reasoning_content": "Both answered."},
]
CHATS: dict[str, list[dict[str, Any]]] = {
    "pending_results": AGENT[:6],  # the model's turn after the tool results
    "answered": AGENT,
    "next_question": [*AGENT, {"role": "user", "content": "And tomorrow?"}],  # reasoning drops
    "reasoning_in_content": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nA greeting.\n</think>\nHello."},
        {"role": "user", "content": "bye"},
    ],
}
KWARGS: list[dict[str, Any]] = [
    {},
    {"enable_thinking": False},
    {"clear_thinking": False},
    {"reasoning_effort": "high"},
]


def _check_equal(path: Path) -> int:
    ours = chat_formatter(load_tokenizer(path), path)
    assert isinstance(ours, TemplateFormatter)
    ref = PreTrainedTokenizerFast.from_pretrained(str(path))
    n = 0
    for messages in CHATS.values():
        for kwargs in KWARGS:
            for gen in (True, False):
                for tools in (None, TOOLS):
                    kw = {"add_generation_prompt": gen, "tools": tools, **kwargs}
                    text = ref.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kw)
                    assert ours.render(messages, **kw) == text, (messages, kw)
                    out = ref.apply_chat_template(copy.deepcopy(messages), tokenize=True, **kw)
                    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
                    assert ours.encode(messages, **kw) == ids, (messages, kw)
                    n += 1
    return n


# The shipped model was trained on code, never on reasoning: its copy of the template thinks
# only when asked (enable_thinking true), where the released one thinks unless told not to.
RELEASED_PROMPT = (
    "'</think>' if (enable_thinking is defined and not enable_thinking) else '<think>'"
)
SHIPPED_PROMPT = "'<think>' if (enable_thinking is defined and enable_thinking) else '</think>'"


def test_the_fixture_is_the_released_template_and_the_shipped_model_uses_it() -> None:
    assert hashlib.sha256(TEMPLATE_FILE.read_bytes()).hexdigest() == SHA256
    assert TEMPLATE.count(RELEASED_PROMPT) == 1
    shipped = TEMPLATE.replace(RELEASED_PROMPT, SHIPPED_PROMPT)
    assert (SHIPPED / "chat_template.jinja").read_text(encoding="utf-8") == shipped
    training_copy = ROOT / "training" / "corpus" / "chat_template.jinja"
    assert training_copy.read_text(encoding="utf-8") == shipped


def test_agent_histories_render_as_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = write_model_dir(
        tmp_path_factory.mktemp("glm47"),
        GLM_SPECIALS,
        glm_tokenizer_config(),
        chat_template_file=TEMPLATE,
    )
    assert _check_equal(path) == len(CHATS) * len(KWARGS) * 4
    tok = load_tokenizer(path)
    prompt = TemplateFormatter(tok).render(CHATS["pending_results"], tools=TOOLS)
    # The format's own places: the tools in the system turn, each call's arguments as
    # <arg_key>/<arg_value> pairs (strings bare, other values JSON), results as observations,
    # the current turn's reasoning kept, the generation prompt opening a reasoning block.
    assert prompt.startswith("[gMASK]<sop><|system|>\n# Tools\n")
    assert '{"type": "function", "function": {"name": "get_weather"' in prompt
    assert (
        "<|assistant|><think>Two calls, then answer.</think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
    ) in prompt
    assert '<arg_key>nested</arg_key><arg_value>{"a": [1, null]}</arg_value>' in prompt
    assert "<tool_call>noop</tool_call>" in prompt
    assert (
        '<|observation|><tool_response>{"sky": "sunny"}</tool_response>'
        "<tool_response>晴</tool_response><tool_response></tool_response><|assistant|><think>"
    ) in prompt
    assert prompt.endswith("<|assistant|><think>")
    off = TemplateFormatter(tok).render(CHATS["next_question"], enable_thinking=False)
    assert "Two calls" not in off and off.endswith("<|user|>And tomorrow?<|assistant|></think>")


def test_the_shipped_model_renders_agent_histories_as_transformers() -> None:
    """Its byte-level BPE has GLM's role tokens only: <think>, <tool_call> and the like are
    plain text there, tokenized alike by both."""
    assert _check_equal(SHIPPED) == len(CHATS) * len(KWARGS) * 4
