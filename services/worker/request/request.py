"""Requests as the engine sees them: sampling parameters, state and outputs."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dhisparse.tokenizer import Tokenizer
from services.worker.request.penalties import Penalties
from services.worker.request.stop import TextStream

if TYPE_CHECKING:
    from services.worker.request.grammar_state import GrammarState


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


# Temperatures below this sample as greedy (vLLM's convention): dividing logits by them
# overflows float32.
GREEDY_BELOW = 1e-5
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Grammar:
    """A grammar the output must follow (``Grammar`` in worker.proto)."""

    kind: str  # "json_object" | "json_schema" | "tool_calls" | "structural_tag"
    spec: str = ""  # JSON text: the schema, the tools' call or the structural tag ("": none)
    reasoning_open: bool = False  # the reply first ends the reasoning block the prompt opened


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (so is anything below GREEDY_BELOW)
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    seed: int | None = None
    max_tokens: int = 16  # 0 (with prompt_logprobs): the prompt is scored and nothing generated
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; n: and the top n
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0  # over the generated tokens; 0 = off
    frequency_penalty: float = 0.0  # over the generated tokens; 0 = off
    repetition_penalty: float = 1.0  # over the prompt's and generated tokens; 1 = off
    min_p: float = 0.0  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    grammar: Grammar | None = None  # None: unconstrained
    prompt_logprobs: int | None = None  # None: none; n: each prompt token's and the top n
    skip_special_tokens: bool = True  # special tokens left out of the text

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def text_stream(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> TextStream:
        """The incremental text of an output under these parameters (stop strings, special
        tokens)."""
        return TextStream(
            tokenizer, prompt_ids, self.stop, self.include_stop_str_in_output,
            self.skip_special_tokens,
        )  # fmt: skip

    @property
    def penalized(self) -> bool:
        """Whether it sets a logit bias or a penalty (``Penalties``)."""
        return bool(self.logit_bias) or (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError with a message fit for a client."""
        if not 0.0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError(
                f"temperature must be in [0, {FLOAT32_MAX:.4g}], got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be <= vocab size {vocab_size}, got {self.top_k}")
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(
                f"max_tokens must be >= 1 (0 only with prompt_logprobs), got {self.max_tokens}"
            )
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError("seed must be in [0, 2^64)")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids out of vocabulary: {bad}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self._validate_logit_bias(vocab_size)

    def _validate_logit_bias(self, vocab_size: int) -> None:
        ids = [t for t, _ in self.logit_bias]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids out of vocabulary [0, {vocab_size}): {bad}")
        twice = sorted({t for t in ids if ids.count(t) > 1})
        if twice:
            raise ValueError(f"logit_bias lists token ids more than once: {twice}")
        wild = [(t, b) for t, b in self.logit_bias if not -100.0 <= b <= 100.0]
        if wild:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {wild}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestError:
    """Why the engine gave up on a request it could not serve (not the client's fault)."""

    # "unavailable" (the host store is down) | "resource_exhausted" (it is full) | "internal"
    # (a step that ran it failed: ``Engine.fail_running``)
    code: str
    message: str


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text: str  # text delta
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    error: RequestError | None = None  # set on the last output of a request that failed
    cached_prompt_tokens: int = 0  # prompt tokens not computed for it (resumed, cached prefix)
    shared_prompt_tokens: int = 0  # of those, the ones whose device pages others share
    # on the first output of a request that asked for them (``prompt_logprobs.take``)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: TextStream
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    num_computed: int = 0  # tokens whose KV rows are in the cache
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    admitted_time: float | None = None  # first admission (allocation wait = this - arrival)
    first_token_time: float | None = None
    error: RequestError | None = None
    # tokens not computed here: adopted from a dead worker (a resumed session), or imported from
    # a cached prefix (``serving.prefix_reuse``)
    resumed_tokens: int = 0
    # of those, the leading tokens whose pages on the device it shares with other requests
    # (seated from a record: ``serving.device_prefix``, ``serving.key_records``)
    shared_tokens: int = 0
    # its logit bias and penalties on the device, built at its first shaping (if it sets any)
    penalties: Penalties | None = field(default=None, repr=False)
    # scores of prompt tokens 1, 2, ... recorded so far, until sent (``prompt_logprobs``)
    prompt_scored: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # its grammar's matcher, past every emitted token (None: unconstrained)
    grammar: GrammarState | None = None

    def ids_from(self, start: int, end: int | None = None) -> list[int]:
        """``(prompt_ids + output_ids)[start:end]`` without copying the whole history (a decode
        step reads one token, a prefill chunk a slice of the prompt)."""
        n = len(self.prompt_ids)
        if end is not None and end <= n:
            return self.prompt_ids[start:end]
        out = self.output_ids[max(0, start - n) : None if end is None else end - n]
        return self.prompt_ids[start:] + out if start < n else out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        """Its next pass computes a prefill chunk, not a decode step: more than its newest token
        is uncomputed (a prompt, or a preempted request's recompute), or it has sampled nothing
        yet. A request's last chunk samples its first token; earlier chunks sample nothing."""
        return self.num_tokens - self.num_computed > 1 or not self.output_ids

    def shape_logits(
        self, logits: torch.Tensor, drafts: Sequence[int], eos_token_ids: Collection[int]
    ) -> None:
        """logits: [n, V] fp32, in place, before any sampling or verification reads them. Row i
        scores the request's next token after its output so far and ``drafts[:i]`` (a decode
        step: n = 1, no drafts; a verify block of K rows: its K - 1 proposals), as if those
        drafts had been emitted. In vLLM's order: the ``min_tokens`` bans (row i is output
        position len(output_ids) + i), ``logit_bias``, the repetition penalty, the frequency
        and presence penalties. The grammar's mask comes last, applied by the pass to every
        constrained request's rows at once (``grammar_masks.GrammarMasks``). A request that
        sets none of them pays nothing beyond a few Python comparisons."""
        if len(drafts) != logits.shape[0] - 1:
            raise ValueError(f"{len(drafts)} drafts for {logits.shape[0]} rows")
        self._ban_early_stops(logits, eos_token_ids)
        p = self.params
        if p.penalized:
            if self.penalties is None:
                self.penalties = Penalties(
                    p.logit_bias, p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                    self.prompt_ids, logits.shape[-1], logits.device,
                )  # fmt: skip
            self.penalties.apply(logits, drafts, self.output_ids)

    def _ban_early_stops(self, logits: torch.Tensor, eos_token_ids: Collection[int]) -> None:
        """logits: [n, V] for the request's next n tokens: before ``min_tokens`` are out, the
        EOS ids and stop tokens cannot be sampled (in place)."""
        p = self.params
        left = p.min_tokens - len(self.output_ids)
        if left <= 0:
            return
        banned = [*p.stop_token_ids] + ([] if p.ignore_eos else sorted(eos_token_ids))
        logits[:left, banned] = float("-inf")

    def check_stop(
        self, token: int, eos_token_ids: Collection[int], max_model_len: int
    ) -> tuple[FinishReason | None, str | int | None, str]:
        """After ``token`` was appended: (finish reason or None, stop reason, text delta).
        Any of ``eos_token_ids`` ends the request (unless it ignores EOS)."""
        p = self.params
        if token in eos_token_ids and not p.ignore_eos:
            return FinishReason.STOP, None, self.text.finish()
        if token in p.stop_token_ids:
            return FinishReason.STOP, token, self.text.finish()
        delta, stop = self.text.push(token)
        if stop is not None:
            return FinishReason.STOP, stop, delta
        if len(self.output_ids) >= p.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH, None, delta + self.text.finish()
        return None, None, delta

    def output(
        self,
        tokens: tuple[int, ...] = (),
        text: str = "",
        logprobs: tuple[TokenLogprob, ...] = (),
        prompt_logprobs: tuple[TokenLogprob, ...] = (),
    ) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=tokens,
            text=text,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            logprobs=logprobs,
            error=self.error,
            cached_prompt_tokens=min(self.resumed_tokens, len(self.prompt_ids)),
            shared_prompt_tokens=min(self.shared_tokens, len(self.prompt_ids)),
            prompt_logprobs=prompt_logprobs,
        )
