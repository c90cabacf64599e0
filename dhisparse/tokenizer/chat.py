"""Chat templates rendered as transformers' ``apply_chat_template`` renders them.

The environment is the one transformers builds (``utils/chat_template_utils.py``): a sandbox
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension (``break``,
``continue``), a ``generation`` block tag that renders its body, a ``tojson`` filter that is
plain ``json.dumps`` (no HTML escaping; ``indent``, ``separators``, ``sort_keys`` and
``ensure_ascii`` as arguments) and the globals ``raise_exception`` and ``strftime_now``. The
variables are ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and every other
keyword (the tokenizer's special tokens first, a caller's keyword overriding them).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The template of the built-in byte tokenizer; like Hugging Face templates it places the BOS
# itself (chat prompts are encoded without adding special tokens). A model that ships a
# tokenizer_config.json with a "chat_template" uses its own.
DEFAULT_CHAT_TEMPLATE = (
    "<|bos|>"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' ~ m['role']) }}"
    "{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's template (a client error)."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's tokens for training
    masks in transformers; rendering a prompt keeps its body as it is."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True,
    lstrip_blocks=True,
    extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """A server renders one template for every request; compiling it costs milliseconds."""
    return _ENV.from_string(template)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    /,
    add_generation_prompt: bool = True,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """``template`` rendered over ``messages``; ``tools`` are JSON schemas and ``documents``
    mappings (as transformers requires); ``variables`` may have any name. Every failure, the
    template's own ``raise_exception`` included, is a ``ChatTemplateError``."""
    if not template:
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    if tools is not None and any(not isinstance(t, Mapping) for t in tools):
        raise ChatTemplateError("tools must be JSON schemas (objects)")
    if documents is not None:
        if isinstance(documents, str | Mapping) or not isinstance(documents, Sequence):
            raise ChatTemplateError("documents must be a list of objects")
        if any(not isinstance(d, Mapping) for d in documents):
            raise ChatTemplateError("documents must be a list of objects")
    context = {
        **variables,
        "messages": list(messages),
        "tools": None if tools is None else list(tools),
        "documents": documents,
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        return _compile(template).render(context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
    except Exception as e:  # a template can fail in Python itself (1 + 'a', a missing key)
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
