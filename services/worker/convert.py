"""Protobuf <-> engine dataclasses. Protobuf types stop here and in server.py."""

from __future__ import annotations

from dhisparse.rpc import worker_pb2 as pb
from dhisparse.tokenizer import Tokenizer
from services.worker.request.request import (
    FinishReason,
    Grammar,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def sampling_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Proto3 scalars have no presence: ``top_p == 0`` means unset (1.0) and ``top_k <= 0``
    means off; the gateway always sets temperature and max_tokens explicitly."""
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k if p.top_k > 0 else -1,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.want_logprobs else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        min_tokens=p.min_tokens,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty > 0 else 1.0,
        min_p=p.min_p,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        grammar=(
            Grammar(p.grammar.kind, p.grammar.spec, p.grammar.reasoning_open)
            if p.grammar.kind
            else None
        ),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
    )


def output_to_proto(out: RequestOutput, tokenizer: Tokenizer) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=list(out.new_token_ids),
        text=out.text,
        finish_reason=_FINISH[out.finish_reason],
        stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_prompt_tokens=out.cached_prompt_tokens,
        shared_prompt_tokens=out.shared_prompt_tokens,
    )
    resp.logprobs.extend(_token_logprob(lp, tokenizer) for lp in out.logprobs)
    resp.prompt_logprobs.extend(_token_logprob(lp, tokenizer) for lp in out.prompt_logprobs)
    return resp


def _token_logprob(lp: TokenLogprob, tokenizer: Tokenizer) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        token=tokenizer.token_text(lp.token_id),
        logprob=lp.logprob,
        top=[
            pb.TopLogprob(token_id=t, token=tokenizer.token_text(t), logprob=v) for t, v in lp.top
        ],
    )
