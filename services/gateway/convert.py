"""Protobuf <-> gateway dataclasses. The only module besides ``worker_client`` that sees
``worker_pb2``."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from dhisparse.rpc import worker_pb2
from services.gateway.generation import (
    FinishReason,
    GenerationDelta,
    GenerationInput,
    TokenLogprob,
    TopLogprob,
)

# The smallest normal float32: a smaller top_p would reach the worker as 0, which proto3 cannot
# tell from "unset" (1.0); this one still keeps only the most likely token.
_TOP_P_FLOOR = 1.1754943508222875e-38

_FINISH: dict[int, FinishReason | None] = {
    worker_pb2.FINISH_REASON_UNSPECIFIED: None,
    worker_pb2.FINISH_REASON_STOP: "stop",
    worker_pb2.FINISH_REASON_LENGTH: "length",
    worker_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    mode: str
    worker_id: str
    config_json: str = ""
    kv_layout_json: str = ""
    durable_sessions: bool = False  # a stream cut by a crash can be re-attached
    startup_s: float = 0.0  # process start to serving (0: not reported)
    prefix_cache: bool = False  # admissions import cached prefixes of the node's host store
    page_size: int = 0  # tokens per KV page, from ``kv_layout_json`` (0: not reported)


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    num_running: int
    num_waiting: int
    max_num_seqs: int
    kv_capacity_bytes: int
    kv_free_bytes: int
    mode: str
    serving_ranks: int = 1
    kv_store_id: str = ""  # the host store whose cached prefixes it imports ("": none)


def generate_request(inp: GenerationInput, rank: int | None = None) -> worker_pb2.GenerateRequest:
    """The worker's request for ``inp``; ``rank``: the data-parallel rank to run it on (None:
    the worker places it)."""
    s = inp.sampling
    sampling = worker_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=max(s.top_p, _TOP_P_FLOOR),
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.top_logprobs,
        want_logprobs=s.want_logprobs,
        include_stop_str_in_output=s.include_stop_str_in_output,
        min_tokens=s.min_tokens,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        min_p=s.min_p,
        logit_bias=dict(s.logit_bias),
    )
    if s.seed is not None:
        sampling.seed = s.seed
    if s.grammar is not None:
        sampling.grammar.kind = s.grammar.kind
        sampling.grammar.spec = s.grammar.spec
        sampling.grammar.reasoning_open = s.grammar.reasoning_open
    if s.prompt_logprobs is not None:
        sampling.prompt_logprobs = s.prompt_logprobs
    if not s.skip_special_tokens:
        sampling.skip_special_tokens = False
    request = worker_pb2.GenerateRequest(
        request_id=inp.request_id, prompt_token_ids=list(inp.prompt_token_ids), sampling=sampling
    )
    if rank is not None:
        request.dp_rank = rank
    return request


# JSON has no infinity: a logprob of -inf (a token the request's grammar, bias or bans forbid)
# is sent as this, as vLLM and OpenAI do.
LOGPROB_FLOOR = -9999.0


def _logprobs(entries: Iterable[worker_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            token_id=lp.token_id,
            token=lp.token,
            logprob=max(lp.logprob, LOGPROB_FLOOR),
            top=tuple(
                TopLogprob(t.token_id, t.token, max(t.logprob, LOGPROB_FLOOR)) for t in lp.top
            ),
        )
        for lp in entries
    )


def generation_delta(resp: worker_pb2.GenerateResponse) -> GenerationDelta:
    return GenerationDelta(
        token_ids=tuple(resp.token_ids),
        text=resp.text,
        finish_reason=_FINISH.get(resp.finish_reason, "abort"),
        stop_reason=resp.stop_reason or None,
        prompt_tokens=resp.prompt_tokens,
        completion_tokens=resp.completion_tokens,
        logprobs=_logprobs(resp.logprobs),
        cached_prompt_tokens=resp.cached_prompt_tokens,
        prompt_logprobs=_logprobs(resp.prompt_logprobs),
        shared_prompt_tokens=resp.shared_prompt_tokens,
    )


def model_info(info: worker_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_name=info.model_name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        mode=info.mode,
        worker_id=info.worker_id,
        config_json=info.config_json,
        kv_layout_json=info.kv_layout_json,
        durable_sessions=info.durable_sessions,
        startup_s=info.startup_s,
        prefix_cache=info.prefix_cache,
        page_size=_page_size(info.kv_layout_json),
    )


def _page_size(layout_json: str) -> int:
    """The page size a worker's KV layout states (0 when it states none or is not JSON)."""
    try:
        layout = json.loads(layout_json) if layout_json else {}
    except ValueError:
        return 0
    page = layout.get("page_size") if isinstance(layout, dict) else None
    return page if isinstance(page, int) and page > 0 else 0


def worker_load(load: worker_pb2.LoadResponse) -> WorkerLoad:
    return WorkerLoad(
        worker_id=load.worker_id,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        max_num_seqs=load.max_num_seqs,
        kv_capacity_bytes=load.kv_capacity_bytes,
        kv_free_bytes=load.kv_free_bytes,
        mode=load.mode,
        serving_ranks=max(1, load.serving_ranks),  # 0: a worker from before the field
        kv_store_id=load.kv_store_id,
    )
