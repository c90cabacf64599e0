"""The chat formatter: messages and template arguments to prompt text and token ids, one
interface over a model's Jinja chat template and DeepSeek-V3.2's, DeepSeek-V4's and
DeepSeek-V4.1's Python formats, chosen from the model directory by ``chat_formatter``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dhisparse.tokenizer import encoding_dsv4, encoding_dsv41
from dhisparse.tokenizer.base import Tokenizer
from dhisparse.tokenizer.chat import ChatTemplateError, render_chat
from dhisparse.tokenizer.encoding_dsv32 import ThinkingMode, encode_messages
from dhisparse.tokenizer.hf_files import DEEPSEEK_V41, MODEL_CONFIG, chat_family, read_json

Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None

# model_type values whose chat format is code rather than a template.
DEEPSEEK_V32 = "deepseek_v32"
DEEPSEEK_V4 = "deepseek_v4"
# OpenAI's reasoning efforts besides those a V4 release names itself: "none" turns thinking
# off, "xhigh" is the release's highest effort, the others its lowest (DeepSeek's API maps the
# first release's so: "low" and "medium" to Think High, "xhigh" to Think Max).
_OPENAI_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# The checkpoint's own encoder, read for its effort table; a larger file is not an encoder.
V4_ENCODER = Path("encoding") / "encoding_dsv4.py"
_MAX_ENCODER_BYTES = 1 << 20


class ChatFormatter(ABC):
    """Renders a chat for the model. ``kwargs`` are the template arguments a request passes
    (vLLM's ``chat_template_kwargs``: ``enable_thinking``, ``reasoning_effort``, ...; any name,
    unknown ones ignored). The prompt carries its own BOS and special tokens: it is tokenized
    without adding any. A chat the model's format cannot render is a ``ChatTemplateError``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def render(
        self,
        messages: Messages,
        /,
        *,
        add_generation_prompt: bool = True,
        tools: Tools = None,
        **kwargs: Any,
    ) -> str: ...

    def encode(
        self,
        messages: Messages,
        /,
        *,
        add_generation_prompt: bool = True,
        tools: Tools = None,
        **kwargs: Any,
    ) -> list[int]:
        """``render``'s prompt as token ids."""
        text = self.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        return self.tokenizer.encode(text)


class TemplateFormatter(ChatFormatter):
    """The tokenizer's Jinja chat templates, rendered as transformers' ``apply_chat_template``
    renders them: the special tokens as variables (a keyword overrides one), the "tool_use"
    template when tools are given and the model names one, else "default"."""

    def render(
        self,
        messages: Messages,
        /,
        *,
        add_generation_prompt: bool = True,
        tools: Tools = None,
        **kwargs: Any,
    ) -> str:
        variables = {**self.tokenizer.special_tokens, **kwargs}
        return render_chat(
            self._template(tools), messages, add_generation_prompt, tools=tools, **variables
        )

    def _template(self, tools: Tools) -> str:
        templates = self.tokenizer.chat_templates
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        if templates:
            raise ChatTemplateError(
                f"the model has chat templates {sorted(templates)} and none is the default"
            )
        return ""  # render_chat refuses: the model has no template


class DeepseekV32Formatter(ChatFormatter):
    """DeepSeek-V3.2's format (``encoding_dsv32``). Thinking mode is on when ``thinking`` or
    ``enable_thinking`` is true (vLLM's names; ``thinking_mode`` "chat" or "thinking" names
    it outright), off by default. ``tools`` join the leading system message (one is added when
    the chat has none). Reasoning of earlier turns is dropped once a new user turn follows, as
    vLLM does; ``drop_thinking`` decides it outright. The format opens the assistant's turn
    after every user turn, so ``add_generation_prompt`` changes nothing."""

    def render(
        self,
        messages: Messages,
        /,
        *,
        add_generation_prompt: bool = True,
        tools: Tools = None,
        **kwargs: Any,
    ) -> str:
        chat = _dsml_chat(messages, tools)
        drop = _flag(kwargs, "drop_thinking")
        return encode_messages(
            chat,
            _thinking_mode(kwargs),
            drop_thinking=chat[-1].get("role") == "user" if drop is None else drop,
        )


class _DeepseekV4Family(ChatFormatter):
    """A format of the DeepSeek-V4 family. Thinking mode is on unless ``thinking`` or
    ``enable_thinking`` is false (DeepSeek's API and vLLM think by default; ``thinking_mode``
    "chat" or "thinking" names it outright), or ``reasoning_effort`` is "none" and neither
    turns it on. ``tools`` join the leading system message (one is added when the chat has
    none), where the release's own examples carry them. ``drop_thinking`` (earlier turns'
    reasoning left out of a chat without tools) is on unless the kwarg says otherwise. The
    format opens the assistant's turn after the last user turn, so ``add_generation_prompt``
    changes nothing."""

    def render(
        self,
        messages: Messages,
        /,
        *,
        add_generation_prompt: bool = True,
        tools: Tools = None,
        **kwargs: Any,
    ) -> str:
        chat = _dsml_chat(messages, tools)
        effort = kwargs.get("reasoning_effort")
        mode = _thinking_mode(kwargs, default=effort != "none")
        drop = _flag(kwargs, "drop_thinking")
        return self._encode(chat, mode, True if drop is None else drop, effort)

    @abstractmethod
    def _encode(self, chat: Messages, mode: ThinkingMode, drop: bool, effort: Any) -> str:
        """The chat in the release's format; ``effort`` as the request gives it."""


class DeepseekV4Formatter(_DeepseekV4Family):
    """DeepSeek-V4's format (``encoding_dsv4``), read as ``_DeepseekV4Family`` says. The effort
    is one the release names (``efforts``: "high" / "max" for the first release, "low" /
    "high" / "max" for 0731) or one of OpenAI's (``_OPENAI_EFFORTS``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        efforts: encoding_dsv4.EffortTable = encoding_dsv4.PREVIEW_EFFORTS,
    ) -> None:
        super().__init__(tokenizer)
        self.efforts = efforts

    def _encode(self, chat: Messages, mode: ThinkingMode, drop: bool, effort: Any) -> str:
        return encoding_dsv4.encode_messages(
            chat,
            mode,
            drop_thinking=drop,
            reasoning_effort=self._effort(effort),
            efforts=self.efforts,
        )

    def _effort(self, effort: Any) -> str | None:
        """``effort`` as one of the release's (None: its default)."""
        names = self.efforts.efforts
        if effort is None or effort == "none":
            return None
        if effort in names:
            return effort
        if effort == "xhigh":
            return names[-1]
        if effort in _OPENAI_EFFORTS:
            return names[0]
        accepted = ", ".join(dict.fromkeys([*_OPENAI_EFFORTS, *names]))
        raise ChatTemplateError(f"reasoning_effort must be one of {accepted}, got {effort!r}")


class DeepseekV41Formatter(_DeepseekV4Family):
    """DeepSeek-V4.1's format (``encoding_dsv41``), read as ``_DeepseekV4Family`` says. The
    effort is V4.1's own (a name of ``NAMED_EFFORTS``: low, high, xhigh, max; or an integer
    budget from 1 to 100, through ``chat_template_kwargs``) or one of OpenAI's: "none" turns
    thinking off, "minimal" and "medium", which V4.1 does not name, are its default ("high"),
    as SGLang's API reads them (``parse_dsv41_reasoning_effort``)."""

    def _encode(self, chat: Messages, mode: ThinkingMode, drop: bool, effort: Any) -> str:
        return encoding_dsv41.encode_messages(
            chat, mode, drop_thinking=drop, reasoning_effort=_v41_effort(effort)
        )


def _v41_effort(effort: Any) -> encoding_dsv41.Effort:
    """``effort`` as V4.1's encoder takes it (None: its default)."""
    names = [name for name, _ in encoding_dsv41.NAMED_EFFORTS]
    if effort is None or effort in ("none", "minimal", "medium"):
        return None
    budget = isinstance(effort, int) and not isinstance(effort, bool)
    if effort in names or (
        budget and encoding_dsv41.MIN_BUDGET <= effort <= encoding_dsv41.MAX_BUDGET
    ):
        return effort
    accepted = ", ".join(dict.fromkeys([*_OPENAI_EFFORTS, *names]))
    raise ChatTemplateError(
        f"reasoning_effort must be one of {accepted} or an integer from "
        f"{encoding_dsv41.MIN_BUDGET} to {encoding_dsv41.MAX_BUDGET}, got {effort!r}"
    )


def _dsml_chat(messages: Messages, tools: Tools) -> list[dict[str, Any]]:
    """A copy of ``messages`` (each an object) with ``tools`` joined to the leading system
    message, as DeepSeek's encoders take a chat."""
    if not messages:
        raise ChatTemplateError("the chat has no messages")
    if any(not isinstance(m, Mapping) for m in messages):
        raise ChatTemplateError("each message must be an object")
    chat = [dict(m) for m in messages]
    _with_tools(chat, tools)
    return chat


def _with_tools(chat: list[dict[str, Any]], tools: Tools) -> None:
    """``tools`` on the chat's leading system message, one added when it has none."""
    if tools:
        if chat[0].get("role") != "system":
            chat.insert(0, {"role": "system", "content": ""})
        chat[0]["tools"] = list(tools)


def _flag(kwargs: Mapping[str, Any], name: str) -> bool | None:
    value = kwargs.get(name)
    if value is not None and not isinstance(value, bool):
        raise ChatTemplateError(f"{name} must be true or false, got {value!r}")
    return value


def _thinking_mode(kwargs: Mapping[str, Any], *, default: bool = False) -> ThinkingMode:
    """``thinking_mode`` when given; else on when ``thinking`` or ``enable_thinking`` is true,
    off when either is false and neither true, ``default`` when neither is given."""
    mode = kwargs.get("thinking_mode")
    if mode is not None:
        if mode not in ("chat", "thinking"):
            raise ChatTemplateError(f"thinking_mode must be chat or thinking, got {mode!r}")
        return mode
    flags = [
        f for f in (_flag(kwargs, "thinking"), _flag(kwargs, "enable_thinking")) if f is not None
    ]
    thinking = any(flags) if flags else default
    return "thinking" if thinking else "chat"


def v4_efforts(model_dir: Path) -> encoding_dsv4.EffortTable:
    """The reasoning efforts of the DeepSeek-V4 checkpoint in ``model_dir``
    (``encoding_dsv4.release_efforts`` over its encoder and ``config.json``)."""
    path = model_dir / V4_ENCODER
    encoder = None
    if path.is_file():
        if path.stat().st_size > _MAX_ENCODER_BYTES:
            raise ValueError(f"{path}: over {_MAX_ENCODER_BYTES} bytes, not an encoder")
        encoder = path.read_text(encoding="utf-8")
    try:
        return encoding_dsv4.release_efforts(encoder, read_json(model_dir / MODEL_CONFIG))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def chat_formatter(tokenizer: Tokenizer, model_dir: str | Path | None = None) -> ChatFormatter:
    """The formatter for the model in ``model_dir`` (None: a preset, the tokenizer's own
    template): its chat template when it ships one; DeepSeek-V3.2's, DeepSeek-V4's or
    DeepSeek-V4.1's format for a ``deepseek_v32``, ``deepseek_v4`` or V4.1 model
    (``hf_files.is_deepseek_v41``) without one; else a template formatter that refuses every
    chat."""
    if tokenizer.chat_templates:
        return TemplateFormatter(tokenizer)
    kind = chat_family(Path(model_dir)) if model_dir is not None else None
    if kind == DEEPSEEK_V41:
        return DeepseekV41Formatter(tokenizer)
    if kind == DEEPSEEK_V32:
        return DeepseekV32Formatter(tokenizer)
    if kind == DEEPSEEK_V4:
        return DeepseekV4Formatter(tokenizer, v4_efforts(Path(model_dir)))
    return TemplateFormatter(tokenizer)
