"""The reply parser reads what constrained decoding produces: replies written in each format,
with the whitespace xgrammar's built-in structural tags allow, are accepted by those grammars
(``get_model_structural_tag``) and parse to what was written; and replies sampled from the
grammars token by token parse, streamed or whole, to calls of the tools with arguments of their
schemas' types."""

from __future__ import annotations

import json
import random
import string
from typing import Any

import pytest
import xgrammar as xgr

from dhisparse.tokenizer.dsml import V4_BLOCK, V32_BLOCK, V41_BLOCK, CallBlock

from .reply_helpers import TOOLS, TYPES, check_stream_is_whole, random_text, random_value

STOP = "<stop>"
BLOCKS = {"deepseek_v3_2": V32_BLOCK, "deepseek_v4": V4_BLOCK, "deepseek_v4_1": V41_BLOCK}


def _dsml_markers(block: CallBlock) -> list[str]:
    return [block.open, block.close, block.invoke_open + ' name="', block.invoke_close + ">",
            block.param_open + ' name="', block.param_close, '" string="true">',
            '" string="false">']  # fmt: skip


MARKERS = {
    "glm_4_7": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
                "</arg_key>", "<arg_value>", "</arg_value>"],
    **{style: ["<think>", "</think>", *_dsml_markers(block)] for style, block in BLOCKS.items()},
}  # fmt: skip
WORDS = [*TYPES, *{k for keys in TYPES.values() for k in keys}]
CHARS = list(string.ascii_letters + string.digits + ' \n"<>/[]{},:.-_=｜\\')
PYTHON_TYPES = {"string": str, "integer": int, "boolean": bool, "number": (int, float),
                "array": list, "object": dict}  # fmt: skip


def _vocab(style: str) -> list[str]:
    return [STOP, *MARKERS[style], *WORDS, *CHARS]


def _compiled(style: str, reasoning: str) -> tuple[xgr.CompiledGrammar, list[str]]:
    vocab = _vocab(style)
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    tag = xgr.get_model_structural_tag(style, tools=TOOLS, tool_choice="auto", reasoning=reasoning)
    return xgr.GrammarCompiler(info).compile_structural_tag(tag), vocab


def _accepts(grammar: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.accept_token(0) and matcher.is_terminated()


def _space(rng: random.Random) -> str:
    return rng.choice(["", "", "\n", " ", "\n  \n", "\t"])


def _full_calls(rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    """Calls with every parameter (the schemas require them all), in the schemas' order."""
    names = [rng.choice(list(TYPES)) for _ in range(rng.randint(1, 3))]
    return [(n, {k: random_value(rng, t) for k, t in TYPES[n].items()}) for n in names]


def _glm(rng: random.Random, name: str, args: dict[str, Any]) -> str:
    body = ""
    for key, value in args.items():
        body += f"{_space(rng)}<arg_key>{key}</arg_key>{_space(rng)}<arg_value>"
        if TYPES[name][key] == "string":
            body += value
        else:
            body += _space(rng) + json.dumps(value, ensure_ascii=False) + _space(rng)
        body += "</arg_value>"
    return f"<tool_call>{name}{body}{_space(rng)}</tool_call>"


def _dsml_invoke(rng: random.Random, tags: CallBlock, name: str, args: dict[str, Any]) -> str:
    body = ""
    for key, value in args.items():
        if TYPES[name][key] == "string":
            body += f'{_space(rng)}{tags.param_open} name="{key}" string="true">{value}'
        else:
            written = json.dumps(value, ensure_ascii=False)
            body += f'{_space(rng)}{tags.param_open} name="{key}" string="false">'
            body += f"{_space(rng)}{written}{_space(rng)}"
        body += tags.param_close
    return f'{tags.invoke_open} name="{name}">\n{body}{_space(rng)}{tags.invoke_close}>\n'


def _written(style: str, rng: random.Random) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    """A reply in ``style`` after an open reasoning block: (text, its content, its calls)."""
    calls = _full_calls(rng)
    texts = [random_text(rng, 20).replace("\\", "") for _ in range(len(calls) + 1)]
    if style == "glm_4_7":
        written = (t + _glm(rng, n, a) for t, (n, a) in zip(texts, calls, strict=False))
        text = "".join(written) + texts[-1]
        # whitespace around a string value is formatting in GLM's format: it reads back stripped
        read = [
            (n, {k: v.strip() if TYPES[n][k] == "string" else v for k, v in a.items()})
            for n, a in calls
        ]
        # content as written but for the whitespace beside each call
        content = "".join(
            (t.lstrip() if i > 0 else t).rstrip() if i < len(calls) else (t.lstrip() if i else t)
            for i, t in enumerate(texts)
        )
        return text, content, read
    # V3.2: two blocks, the first holding all calls but the last; V4's turn ends after one.
    split = len(calls) > 1 and style == "deepseek_v3_2"
    blocks = [calls[:-1], calls[-1:]] if split else [calls]
    tags = BLOCKS[style]
    text, content = "", ""
    for part, block in zip(texts, blocks, strict=False):
        lead = rng.choice(["", "\n\n"])
        invokes = "".join(_dsml_invoke(rng, tags, n, a) for n, a in block)
        text += part + lead + tags.open + "\n" + invokes + tags.close
        content += part
    tail = texts[len(blocks)] if style == "deepseek_v3_2" else ""  # V4 ends at its block
    return text + tail, content + tail, calls


@pytest.mark.parametrize("style", ["glm_4_7", *BLOCKS])
def test_written_replies_are_accepted_by_the_grammar_and_parse_back(style: str) -> None:
    grammar, _ = _compiled(style, "enabled")
    rng = random.Random(style)
    for _ in range(40):
        reasoning = random_text(rng, 20)
        text, content, calls = _written(style, rng)
        assert _accepts(grammar, reasoning + "</think>" + text), text
        reply = check_stream_is_whole(
            style, reasoning + "</think>" + text, rng, reasoning_open=True, tools=TOOLS
        )
        assert (reply.reasoning, reply.content) == (reasoning, content)
        assert [(c.name, c.arguments) for c in reply.tool_calls] == [
            (n, json.dumps(a, ensure_ascii=False)) for n, a in calls
        ]


def _sample(grammar: xgr.CompiledGrammar, vocab: list[str], rng: random.Random) -> tuple[str, bool]:
    """A reply the grammar allows, token by token (markers and words favoured, so that calls
    happen and end); whether it ended (else it is cut, as by max_tokens)."""
    import torch  # the bitmask is a torch tensor

    matcher = xgr.GrammarMatcher(grammar)
    mask = xgr.allocate_token_bitmask(1, len(vocab))

    def weight(i: int) -> float:
        return 30.0 if i == 0 else 8.0 if len(vocab[i]) > 1 else 1.0

    out: list[str] = []
    for _ in range(400):
        matcher.fill_next_token_bitmask(mask)
        bits = mask[0].to(torch.int64)
        allowed = [i for i in range(len(vocab)) if (bits[i // 32] >> (i % 32)) & 1]
        token = rng.choices(allowed, [weight(i) for i in allowed])[0]
        assert matcher.accept_token(token)
        if token == 0:
            return "".join(out), True
        out.append(vocab[token])
    return "".join(out), False


@pytest.mark.parametrize("reasoning", ["enabled", "disabled"])
@pytest.mark.parametrize("style", ["glm_4_7", *BLOCKS])
def test_sampled_replies_parse_to_calls_of_the_tools(style: str, reasoning: str) -> None:
    grammar, vocab = _compiled(style, reasoning)
    rng = random.Random(f"{style}-{reasoning}")
    called = 0
    for _ in range(24):
        text, ended = _sample(grammar, vocab, rng)
        opened = reasoning == "enabled"
        reply = check_stream_is_whole(style, text, rng, reasoning_open=opened, tools=TOOLS)
        if opened and "</think>" in text:
            assert reply.reasoning == text.split("</think>")[0]
        for call in reply.tool_calls:
            args = json.loads(call.arguments)
            types = TYPES[call.name]
            if ended:
                assert list(args) == list(types)
            for key, value in args.items():
                assert isinstance(value, PYTHON_TYPES[types[key]]), (call, text)
        called += len(reply.tool_calls)
    assert called > 0
