"""What the gateway asks of a worker and what comes back, free of HTTP and protobuf types.

The HTTP layer builds these from pydantic requests; ``convert`` maps them to and from the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]

# Workers seed their generators with non-negative int64 values; OpenAI seeds are signed int64
# and are mapped into [0, 2^63) modulo this.
SEED_MODULUS = 2**63


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar the output must follow (``Grammar`` in worker.proto)."""

    kind: Literal["json_object", "json_schema", "tool_calls", "structural_tag"]
    spec: str = ""  # JSON text: the schema, the tools' call or the structural tag ("": none)
    reasoning_open: bool = False  # the reply first ends the reasoning block the prompt opened


@dataclass(frozen=True)
class SamplingSpec:
    """Validated sampling parameters of one worker request."""

    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None  # in [0, SEED_MODULUS)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    want_logprobs: bool = False  # the sampled token's logprob
    top_logprobs: int = 0  # alternatives per token
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids in the vocabulary
    grammar: GrammarSpec | None = None  # None: unconstrained
    prompt_logprobs: int | None = None  # None: none; n: each prompt token's and the top n
    skip_special_tokens: bool = True  # special tokens left out of the text

    def for_choice(self, index: int) -> SamplingSpec:
        """Choice ``index`` of an n-way request: distinct but reproducible when seeded."""
        if self.seed is None:
            return self
        return replace(self, seed=(self.seed + index) % SEED_MODULUS)


@dataclass(frozen=True)
class GenerationInput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    model: str = ""  # the served model name (admission queues and metrics are per model)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class GenerationDelta:
    """One step's output for one request; the last one has ``finish_reason``."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | None
    prompt_tokens: int
    completion_tokens: int  # total so far
    logprobs: tuple[TokenLogprob, ...] = ()
    cached_prompt_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # on a request's first delta, when asked
    shared_prompt_tokens: int = 0  # of the cached ones, those whose pages its worker shares


@dataclass
class ChoiceResult:
    """A finished choice, accumulated from its deltas (non-streaming responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # from the first delta, when asked
    cached_prompt_tokens: int = 0

    def add(self, delta: GenerationDelta) -> None:
        self.prompt_logprobs = delta.prompt_logprobs or self.prompt_logprobs
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.prompt_tokens = delta.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, delta.completion_tokens)
        self.cached_prompt_tokens = max(self.cached_prompt_tokens, delta.cached_prompt_tokens)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
