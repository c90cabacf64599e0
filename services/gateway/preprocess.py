"""From a validated HTTP request to what the workers run: prompt token ids (the model's chat
format rendered here, not on the worker), the completion budget checked against the context
length, and the sampling parameters (the checkpoint's generation defaults where a request
leaves one out). Every failure is a client error (``APIError`` 400)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dhisparse.family.generation import GenerationDefaults
from dhisparse.tokenizer import ChatFormatter, ChatTemplateError, Tokenizer
from services.gateway.errors import bad_request, context_overflow
from services.gateway.generation import SEED_MODULUS, GrammarSpec, SamplingSpec
from services.gateway.protocol import (
    GREEDY_BELOW,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ToolCall,
)

# Template variables the gateway sets itself (tools from the request's own field);
# chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "tools"})
_OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Limits:
    """The server's side of validation."""

    max_model_len: int
    vocab_size: int
    max_n: int = 16
    max_logprobs: int = 20
    default_max_tokens: int | None = None
    # The checkpoint's generation_config.json: temperature, top_p and top_k of requests that
    # leave them out.
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)


@dataclass(frozen=True)
class ChatPrompt:
    """A chat rendered in the model's format: the text, and its token ids."""

    text: str
    token_ids: list[int]


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": call.type,
        "function": {"name": call.function.name, "arguments": call.function.parsed_arguments()},
    }


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (vLLM's conversion): ``content`` a string (text
    parts joined with newlines, vLLM's "string" content format); ``name`` when given; on
    assistant turns ``tool_calls`` with ``function.arguments`` parsed into a mapping (an empty
    list left out) and the reasoning as both ``reasoning_content`` and ``reasoning``; on tool
    messages ``tool_call_id``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.role == "assistant":
            if m.tool_calls:
                message["tool_calls"] = [_tool_call(c) for c in m.tool_calls]
            reasoning = m.reasoning_text()
            if reasoning is not None:
                message["reasoning_content"] = message["reasoning"] = reasoning
        if m.role == "tool" and m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def template_roles(formatter: ChatFormatter) -> tuple[str, ...]:
    """Those of OpenAI's roles that the model's chat format renders: alone, before a user
    message or after one (a format may still refuse some orders of them)."""
    roles: list[str] = []
    for role in _OPENAI_ROLES:
        for chat in ((role,), (role, "user"), ("user", role)):
            try:
                formatter.render([{"role": r, "content": "x"} for r in chat])
            except Exception:  # any failure: the format does not take this chat
                continue
            roles.append(role)
            break
    return tuple(roles)


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's variables besides messages and tools: ``reasoning_effort`` when
    the request gives it, then ``chat_template_kwargs`` (which win, as in vLLM; the names the
    gateway sets itself are left out)."""
    kwargs: dict[str, Any] = {}
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    for k, v in (req.chat_template_kwargs or {}).items():
        if k not in _RESERVED_TEMPLATE_VARS:
            kwargs[k] = v
    return kwargs


def chat_prompt(formatter: ChatFormatter, req: ChatCompletionRequest) -> ChatPrompt:
    """Renders the chat in the model's format and tokenizes it. The prompt carries any BOS
    itself, so none is added here (vLLM's ``add_special_tokens=False`` for chat). The request's
    ``tools`` reach the format whatever ``tool_choice`` is (vLLM's default: "none" constrains
    the reply, not the prompt); ``template_kwargs`` are its variables (``enable_thinking``,
    ``reasoning_effort``; DeepSeek-V3.2 reads ``thinking``)."""
    try:
        text = formatter.render(
            chat_messages(req.messages),
            add_generation_prompt=req.add_generation_prompt,
            tools=req.template_tools(),
            **template_kwargs(req),
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from e
    return ChatPrompt(text, formatter.tokenizer.encode(text))


def chat_prompt_ids(formatter: ChatFormatter, req: ChatCompletionRequest) -> list[int]:
    """``chat_prompt``'s token ids."""
    return chat_prompt(formatter, req).token_ids


def completion_prompt_ids(
    tokenizer: Tokenizer, prompt: str | list[int], vocab_size: int
) -> list[int]:
    """A text prompt is tokenized with the special tokens the checkpoint's rule adds (as
    transformers and vLLM do for completions: ``Tokenizer.encode_prompt``); token ids are
    passed through after a range check."""
    if isinstance(prompt, str):
        ids = tokenizer.encode_prompt(prompt)
    else:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(
                f"prompt token id {bad[0]} is out of range [0, {vocab_size})", "prompt"
            )
        ids = list(prompt)
    if not ids:
        raise bad_request("prompt must not be empty", "prompt")
    return ids


def resolve_max_tokens(prompt_tokens: int, requested: int | None, limits: Limits) -> int:
    """The completion budget. An explicit ``max_tokens`` must fit beside the prompt (vLLM's
    400); without one the request gets what the context leaves, capped by the default."""
    if requested is not None:
        if prompt_tokens + requested > limits.max_model_len:
            raise context_overflow(limits.max_model_len, prompt_tokens, requested)
        return requested
    room = limits.max_model_len - prompt_tokens
    if room <= 0:
        raise context_overflow(limits.max_model_len, prompt_tokens, None)
    if limits.default_max_tokens is not None:
        return min(room, limits.default_max_tokens)
    return room


def _check_server_limits(req: ChatCompletionRequest | CompletionRequest, limits: Limits) -> None:
    if req.n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n}, got {req.n}", "n")
    if req.top_k is not None and req.top_k > limits.vocab_size:
        # The worker's own rule, checked here too: a top_k past int32 would not even reach it.
        raise bad_request(
            f"top_k must be <= vocab size {limits.vocab_size}, got {req.top_k}", "top_k"
        )
    for t in req.stop_token_ids or ():
        if t >= limits.vocab_size:
            raise bad_request(
                f"stop token id {t} is out of range [0, {limits.vocab_size})", "stop_token_ids"
            )
    for key in req.logit_bias or ():
        if int(key) >= limits.vocab_size:
            raise bad_request(
                f"logit_bias token id {key} is out of range [0, {limits.vocab_size})",
                "logit_bias",
            )


def _temperature(requested: float | None, defaults: GenerationDefaults) -> float:
    if requested is None:
        requested = defaults.default_temperature
    if requested is None:
        return 1.0
    return 0.0 if requested < GREEDY_BELOW else requested


def _default(requested: Any, stated: Any, fallback: Any) -> Any:
    """The request's value, else the checkpoint's, else the server's."""
    if requested is not None:
        return requested
    return fallback if stated is None else stated


def _sampling(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    want_logprobs: bool,
    top_logprobs: int,
    limits: Limits,
    logprobs_param: str,
    grammar: GrammarSpec | None = None,
) -> SamplingSpec:
    _check_server_limits(req, limits)
    if top_logprobs > limits.max_logprobs:
        raise bad_request(
            f"at most {limits.max_logprobs} logprobs per token may be requested, "
            f"got {top_logprobs}",
            logprobs_param,
        )
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=_temperature(req.temperature, limits.generation),
        top_p=_default(req.top_p, limits.generation.top_p, 1.0),
        top_k=_default(req.top_k, limits.generation.top_k, 0),
        seed=None if req.seed is None else req.seed % SEED_MODULUS,
        stop=tuple(req.stop_strings()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=min(req.min_tokens, max_tokens),
        want_logprobs=want_logprobs,
        top_logprobs=top_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        logit_bias=tuple(sorted({int(k): v for k, v in (req.logit_bias or {}).items()}.items())),
        grammar=grammar,
    )


def chat_sampling(
    req: ChatCompletionRequest,
    max_tokens: int,
    limits: Limits,
    grammar: GrammarSpec | None = None,
) -> SamplingSpec:
    """The chat request's sampling; ``grammar`` is what ``constraints.grammar_for`` built of
    its tools and response format (None: unconstrained)."""
    top = (req.top_logprobs or 0) if req.logprobs else 0
    return _sampling(req, max_tokens, req.logprobs, top, limits, "top_logprobs", grammar)


def completion_sampling(req: CompletionRequest, max_tokens: int, limits: Limits) -> SamplingSpec:
    want = req.logprobs is not None
    spec = _sampling(req, max_tokens, want, req.logprobs or 0, limits, "logprobs")
    return replace(spec, prompt_logprobs=_prompt_logprobs(req, max_tokens, limits))


def _prompt_logprobs(req: CompletionRequest, max_tokens: int, limits: Limits) -> int | None:
    """Alternatives per prompt token the worker scores: as many as ``prompt_logprobs`` (vLLM's
    extra) or, with ``echo``, ``logprobs`` asks, the larger; 0 for an echo of no tokens that
    asks neither (the worker scores the prompt of a request of ``max_tokens`` 0); else none."""
    asked = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    if not asked:
        return 0 if max_tokens == 0 else None
    if req.prompt_logprobs is not None and req.prompt_logprobs > limits.max_logprobs:
        raise bad_request(
            f"at most {limits.max_logprobs} logprobs per token may be requested, "
            f"got {req.prompt_logprobs}",
            "prompt_logprobs",
        )
    return max(asked)
