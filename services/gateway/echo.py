"""``echo`` and prompt logprobs on ``/v1/completions``, as OpenAI and vLLM answer them.

With ``echo`` a choice's text begins with its prompt (a text prompt as sent; a token-id prompt
detokenized, special tokens kept, as vLLM does), and with ``logprobs`` its legacy logprobs
begin with one entry per prompt token: the first ``null`` (nothing precedes it: no logprob, no
alternatives), the others the token's logprob and its alternatives (the token itself among
them), text offsets running on into the generated tokens'. vLLM's ``prompt_logprobs`` extra
returns the same scores as ``choices[i].prompt_logprobs``: ``null`` first, then per token a
dict token id -> ``{logprob, rank, decoded_token}`` of the token and its top alternatives.

The worker computes the prompt's scores once per request (``SamplingParams.prompt_logprobs``)
and sends them on its first delta. A session resumed on another worker part-way through its
prefill lost the scores of the prefix it had computed; a request that needs them then fails
with a 503 rather than answering without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dhisparse.tokenizer import Tokenizer
from services.gateway.errors import APIError
from services.gateway.generation import TokenLogprob
from services.gateway.responses import CompletionLogprobs, PromptLogprob, completion_logprobs

PromptLogprobs = list[dict[int, PromptLogprob] | None]


def echo_text(tokenizer: Tokenizer, prompt: str | list[int], ids: Sequence[int]) -> str:
    """The text a choice echoes for ``prompt`` (tokenized as ``ids``)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def require(prompt_logprobs: Sequence[TokenLogprob], choice: int) -> None:
    """Raises ``APIError`` 503 when a choice that needs its prompt's logprobs has none."""
    if not prompt_logprobs:
        raise APIError(
            503,
            f"the prompt logprobs of choice {choice} were lost with the worker that computed "
            "them (it failed part-way through the prompt); retry the request",
        )


def echoed_logprobs(
    prompt: Sequence[TokenLogprob], generated: Sequence[TokenLogprob], top: int
) -> CompletionLogprobs:
    """Legacy logprobs of the prompt's tokens (``prompt``: the worker's entries, the first a
    placeholder) followed by the generated ones, ``top`` alternatives each, offsets from 0."""
    first, *rest = prompt
    head = CompletionLogprobs(
        text_offset=[0], token_logprobs=[None], tokens=[first.token], top_logprobs=[None]
    )
    tail = completion_logprobs([*rest, *generated], top, len(first.token))
    return CompletionLogprobs(
        text_offset=head.text_offset + tail.text_offset,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        tokens=head.tokens + tail.tokens,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
    )


def vllm_prompt_logprobs(prompt: Sequence[TokenLogprob], top: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` from the worker's entries (the first a placeholder): per
    token the token's own entry first, then its ``top`` alternatives by rank."""
    out: PromptLogprobs = [None]
    for lp in prompt[1:]:
        alternatives = lp.top[:top]
        ranks = {t.token_id: k + 1 for k, t in enumerate(lp.top)}
        entry = {
            lp.token_id: PromptLogprob(
                logprob=lp.logprob,
                rank=ranks.get(lp.token_id),
                decoded_token=lp.token,
            )
        }
        for k, t in enumerate(alternatives):
            entry.setdefault(
                t.token_id,
                PromptLogprob(logprob=t.logprob, rank=k + 1, decoded_token=t.token),
            )
        out.append(entry)
    return out


@dataclass(frozen=True)
class PromptEcho:
    """What a completion request asks of its choices' prompts: ``texts`` the prompt each choice
    echoes (by choice index; None: no echo), ``top`` the legacy logprobs' alternatives (None:
    no logprobs), ``prompt_top`` vLLM's ``prompt_logprobs`` alternatives (None: not asked)."""

    texts: tuple[str, ...] | None = None
    top: int | None = None
    prompt_top: int | None = None

    @property
    def opens(self) -> bool:
        """Whether each choice's first chunk carries its prompt (sent even with no new text)."""
        return self.texts is not None or self.prompt_top is not None

    def begin(
        self,
        choice: int,
        text: str,
        prompt: Sequence[TokenLogprob],
        generated: Sequence[TokenLogprob],
    ) -> tuple[str, CompletionLogprobs | None, PromptLogprobs | None]:
        """(text, legacy logprobs, vLLM prompt logprobs) of choice ``choice``'s first chunk, or
        of its whole result: its ``text`` and ``generated`` logprobs after its prompt's, and
        ``prompt`` (the worker's prompt entries) as vLLM's extra."""
        echo = self.texts is not None
        if (echo and self.top is not None) or self.prompt_top is not None:
            require(prompt, choice)
        logprobs = None
        if self.top is not None:
            if echo:
                logprobs = echoed_logprobs(prompt, generated, self.top)
            else:
                logprobs = completion_logprobs(generated, self.top)
        scored = None if self.prompt_top is None else vllm_prompt_logprobs(prompt, self.prompt_top)
        return (self.texts[choice] if self.texts is not None else "") + text, logprobs, scored
