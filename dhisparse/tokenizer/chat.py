from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
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


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_ENV.globals["raise_exception"] = _raise_exception


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """A server renders one template for every request; compiling it costs milliseconds."""
    return _ENV.from_string(template)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Renders a chat with a Jinja template the way Hugging Face tokenizers do."""
    if not template:
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **kwargs
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
