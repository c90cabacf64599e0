"""Grammars, tokenizers and reference matchers shared by the constrained-decoding tests."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import xgrammar as xgr

from dhisparse.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from services.worker.request.grammar import GrammarCompiler
from services.worker.request.grammar_masks import Block, GrammarMasks
from services.worker.request.grammar_state import GrammarState
from services.worker.request.request import Grammar

MINI = Path(__file__).resolve().parents[3] / "models" / "glm-dsa-mini"
MINI_VOCAB = 8192  # the shipped model's logits width (its tokenizer has 8128 tokens)
MINI_EOS = (8121, 8125, 8127)  # the engine's ends for it (config, tokenizer, generation)
BYTE_VOCAB = 264
BYTE_EOS = (257,)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
JSON_OBJECT = Grammar("json_object")
JSON_SCHEMA = Grammar("json_schema", json.dumps(SCHEMA))
# any text: every token but the special ones (a stop token whenever)
ANY_TEXT = Grammar("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "any_text"}}))  # fmt: skip

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"}},
        "required": ["city", "metric"],
    }}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                       "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"],
    }}},
]  # fmt: skip


def tool_call_tag(model: str) -> Grammar:
    """One required call of a listed tool in ``model``'s format (xgrammar's builtin tag), no
    reasoning, whitespace runs of at most one character inside the arguments."""
    tag = xgr.get_model_structural_tag(
        model, tools=TOOLS, tool_choice="required", reasoning=False,
        parallel_tool_calls=False, max_whitespace_cnt=1,
    )  # fmt: skip
    return Grammar("structural_tag", tag.model_dump_json())


@functools.cache
def mini_tokenizer() -> HFTokenizer:
    return HFTokenizer(MINI)


@functools.cache
def compiler(name: str) -> GrammarCompiler:
    """``"mini"``: the shipped tokenizer under the model's 8192-wide logits; ``"byte"``: the
    presets' byte tokenizer."""
    if name == "mini":
        return GrammarCompiler(mini_tokenizer(), MINI_VOCAB, MINI_EOS)
    return GrammarCompiler(ByteTokenizer(), BYTE_VOCAB, BYTE_EOS)


def tokenizer(name: str) -> Tokenizer:
    return compiler(name).tokenizer


def reference_mask(compiled: xgr.CompiledGrammar, prefix: list[int], vocab: int) -> torch.Tensor:
    """[ceil(V / 32)] int32: xgrammar's own matcher, stepped token by token over ``prefix``."""
    m = xgr.GrammarMatcher(compiled)
    for t in prefix:
        assert m.accept_token(t), t
    mask = xgr.allocate_token_bitmask(1, vocab)
    m.fill_next_token_bitmask(mask)
    return mask[0]


def allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., ceil(V / 32)] int32 bitmask -> [..., V] bool: the tokens it allows."""
    ids = torch.arange(vocab)
    return ((mask[..., ids // 32] >> (ids % 32)) & 1).bool()


def accepts(compiled: xgr.CompiledGrammar, tokens: list[int]) -> xgr.GrammarMatcher | None:
    """A fresh matcher past ``tokens``, or None when the grammar rejects one of them."""
    m = xgr.GrammarMatcher(compiled)
    return m if all(m.accept_token(t) for t in tokens) else None


def random_walk(
    compiled: xgr.CompiledGrammar, n: int, vocab: int, stops: tuple[int, ...], seed: int
) -> list[int]:
    """Up to ``n`` tokens the grammar allows one after another, drawn uniformly, no stop token
    (shorter when only a stop token is allowed)."""
    g = torch.Generator().manual_seed(seed)
    m = xgr.GrammarMatcher(compiled)
    out: list[int] = []
    mask = xgr.allocate_token_bitmask(1, vocab)
    while len(out) < n:
        m.fill_next_token_bitmask(mask)
        ok = allowed(mask[0], vocab)
        ok[list(stops)] = False
        choices = ok.nonzero()[:, 0]
        if not len(choices):
            break
        t = int(choices[torch.randint(len(choices), (1,), generator=g)])
        assert m.accept_token(t)
        out.append(t)
    return out


@functools.cache
def shared_masks(vocab: int) -> GrammarMasks:
    """One ``GrammarMasks`` (and its filler process) per vocabulary for the test session."""
    return GrammarMasks(vocab, torch.device("cpu"), max_rows=64)


def block_allowed(
    states: list[tuple[GrammarState, int, list[int]]], vocab: int, width: int | None = None
) -> torch.Tensor:
    """[rows, V] bool: the tokens each row may take after one pass's masks of
    ``states`` ((grammar, rows, drafts) per request, their blocks one after another, then
    ``width`` rows in all when given), as ``GrammarMasks`` fills and applies them to logits."""
    masks = shared_masks(vocab)
    blocks, first = [], 0
    for st, rows, drafts in states:
        blocks.append(Block(st, first, rows, drafts))
        first += rows
    logits = torch.zeros(width or first, vocab)
    masks.fill(blocks)
    masks.apply(logits)
    return logits != float("-inf")
