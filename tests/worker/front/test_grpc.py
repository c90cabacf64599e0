"""The worker's gRPC front on loopback: a real grpc.aio server around a real engine."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dhisparse.rpc import worker_pb2 as pb
from dhisparse.rpc import worker_pb2_grpc as pb_grpc
from services.worker.async_engine import MAX_FAILED_STEPS
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from services.worker.server import start_server
from services.worker.settings import WorkerSettings

PROMPT = list(b"The sparse indexer picks rows; ")


@pytest.fixture
async def worker(port: int):
    settings = WorkerSettings(  # the gRPC front over a small resident pool
        model="tiny-glm", port=port, metrics_port=0, worker_id="w0", kv_pool_mib=8, mode="resident"
    )
    server, engine = await start_server(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.WorkerStub(channel), engine
    finally:
        await channel.close()
        await server.stop(grace=None)
        engine.shutdown()


def greedy(n: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


async def test_generate_streams_the_engines_tokens(worker) -> None:
    stub, _ = worker
    ids: list[int] = []
    text = ""
    last = None
    async for resp in stub.Generate(
        pb.GenerateRequest(request_id="r1", prompt_token_ids=PROMPT, sampling=greedy(20))
    ):
        ids.extend(resp.token_ids)
        text += resp.text
        last = resp
    assert last is not None and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.completion_tokens == 20 and last.prompt_tokens == len(PROMPT)
    offline = Engine(EngineConfig(kv_pool_mib=8)).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    )[0]
    assert ids == offline.output_ids
    assert text == offline.text.detok.text


async def test_concurrent_streams_and_logprobs(worker) -> None:
    stub, _ = worker

    async def one(i: int) -> list[pb.GenerateResponse]:
        req = pb.GenerateRequest(
            request_id=f"c{i}",
            prompt_token_ids=PROMPT[i:],
            sampling=greedy(8, want_logprobs=True, logprobs=3),
        )
        return [r async for r in stub.Generate(req)]

    results = await asyncio.gather(*(one(i) for i in range(4)))
    for resps in results:
        lps = [lp for r in resps for lp in r.logprobs]
        assert len(lps) == 8
        for lp in lps:
            assert len(lp.top) == 3 and lp.logprob <= 0
            # Greedy: the sampled token is the most likely one.
            assert lp.top[0].token_id == lp.token_id


async def test_prompt_logprobs_come_once_with_each_tokens_text(worker) -> None:
    """Every prompt token's entry on the first response (the first a placeholder), with the
    tokens' text; with max_tokens 0 that response is the only one and holds no token."""
    stub, engine = worker
    tok = engine.engine.tokenizer
    for n in (3, 0):
        req = pb.GenerateRequest(
            request_id=f"p{n}", prompt_token_ids=PROMPT, sampling=greedy(n, prompt_logprobs=2)
        )
        resps = [r async for r in stub.Generate(req)]
        first = resps[0].prompt_logprobs
        assert [lp.token_id for lp in first] == PROMPT
        assert [lp.token for lp in first] == [tok.token_text(t) for t in PROMPT]
        assert first[0].logprob == 0 and not first[0].top
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in first[1:])
        assert all(not r.prompt_logprobs for r in resps[1:])
        assert sum(len(r.token_ids) for r in resps) == n
        assert resps[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_invalid_arguments_get_a_status_with_a_message(worker) -> None:
    stub, _ = worker
    cases = [
        (
            pb.GenerateRequest(request_id="", prompt_token_ids=PROMPT, sampling=greedy(4)),
            "request_id",
        ),
        (pb.GenerateRequest(request_id="e1", prompt_token_ids=[], sampling=greedy(4)), "empty"),
        (
            pb.GenerateRequest(request_id="e2", prompt_token_ids=[10_000], sampling=greedy(4)),
            "token ids",
        ),
        (
            pb.GenerateRequest(request_id="e3", prompt_token_ids=PROMPT, sampling=greedy(0)),
            "max_tokens",
        ),
        (
            pb.GenerateRequest(
                request_id="e4",
                prompt_token_ids=PROMPT,
                sampling=pb.SamplingParams(temperature=-1, max_tokens=3),
            ),
            "temperature",
        ),
    ]
    for req, needle in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(req):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details()


async def test_cancel_aborts_and_frees_capacity(worker) -> None:
    stub, engine = worker
    required_before = (await stub.GetLoad(pb.LoadRequest())).kv_required_bytes
    call = stub.Generate(
        pb.GenerateRequest(request_id="long", prompt_token_ids=PROMPT, sampling=greedy(10_00))
    )
    got = 0
    async for resp in call:
        got += len(resp.token_ids)
        if got >= 3:
            call.cancel()
            break
    for _ in range(100):
        load = await stub.GetLoad(pb.LoadRequest())
        if load.num_running == 0 and load.kv_required_bytes == required_before:
            break
        await asyncio.sleep(0.05)
    assert load.num_running == 0 and load.num_waiting == 0
    # its pages are free, or cached (optional: reclaimed before a request waits)
    assert load.kv_required_bytes == required_before
    assert load.kv_required_bytes + load.kv_optional_bytes + load.kv_free_bytes == (
        load.kv_capacity_bytes
    )
    assert "long" not in engine.engine.requests


async def test_model_info_load_and_health(worker) -> None:
    stub, _ = worker
    info = await stub.GetModelInfo(pb.ModelInfoRequest())
    assert info.model_name == "tiny-glm" and info.max_model_len == 4096 and info.mode == "resident"
    assert '"index_topk"' in info.config_json and info.worker_id == "w0"
    assert info.startup_s > 0  # from this process's start to serving
    assert info.prefix_cache  # resident mode shares device pages
    load = await stub.GetLoad(pb.LoadRequest())
    assert load.kv_store_id == ""  # no host store
    assert load.max_num_seqs == 32 and load.kv_capacity_bytes == 8 << 20
    assert (
        load.kv_required_bytes + load.kv_optional_bytes + load.kv_free_bytes
        == load.kv_capacity_bytes
    )
    health = await stub.Health(pb.HealthRequest())
    assert health.ok and health.status == "serving"
    assert (await stub.Abort(pb.AbortRequest(request_id="nope"))).found is False


async def test_resume_of_a_session_it_does_not_hold_is_not_found(worker) -> None:
    """A resident worker keeps nothing a successor could resume: it says so, and Resume of a
    session it does not hold is NOT_FOUND (the gateway then fails the client's stream)."""
    stub, _ = worker
    info = await stub.GetModelInfo(pb.ModelInfoRequest())
    assert info.mode == "resident" and not info.durable_sessions
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub.Resume(pb.ResumeRequest(request_id="gone", tokens_received=3)):
            pass
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_failing_step_fails_its_requests_and_later_ones_are_served(
    worker, caplog: pytest.LogCaptureFixture
) -> None:
    """The model's forward raises once, in a decode pass of a running request: that request's
    stream ends with INTERNAL and the error's message, the failure is logged with its
    traceback, and the engine goes on: a later request gets the offline engine's tokens."""
    stub, engine = worker
    model = engine.engine.model
    forward = model.forward
    passes = 0

    def fails_once(*args, **kwargs):
        nonlocal passes
        passes += 1
        if passes == 3:  # the prefill, two decode passes
            raise RuntimeError("injected fault in the forward")
        return forward(*args, **kwargs)

    model.forward = fails_once
    got: list[int] = []
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for resp in stub.Generate(
                pb.GenerateRequest(request_id="f1", prompt_token_ids=PROMPT, sampling=greedy(20))
            ):
                got.extend(resp.token_ids)
    finally:
        del model.forward
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "injected fault in the forward" in (failed.value.details() or "")
    assert len(got) == 2  # what the passes before the fault sampled
    assert any(r.exc_info and "injected fault" in r.getMessage() + str(r.exc_info[1])
               for r in caplog.records)  # fmt: skip
    later = [
        t
        async for resp in stub.Generate(
            pb.GenerateRequest(request_id="f2", prompt_token_ids=PROMPT, sampling=greedy(12))
        )
        for t in resp.token_ids
    ]
    offline = Engine(EngineConfig(kv_pool_mib=8)).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )[0]
    assert later == offline.output_ids
    assert (await stub.Health(pb.HealthRequest())).ok
    assert engine.engine.num_running == 0


async def test_steps_failing_in_a_row_stop_the_engine(worker) -> None:
    """A forward that always raises is a broken engine, not a bad batch: the first failed
    steps fail their requests (INTERNAL), then the engine stops and reports unhealthy."""
    stub, engine = worker

    def broken(*args, **kwargs):
        raise RuntimeError("broken forward")

    engine.engine.model.forward = broken
    codes = []
    for i in range(MAX_FAILED_STEPS):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in stub.Generate(
                pb.GenerateRequest(request_id=f"b{i}", prompt_token_ids=PROMPT, sampling=greedy(4))
            ):
                pass
        codes.append(failed.value.code())
    want = [grpc.StatusCode.INTERNAL] * (MAX_FAILED_STEPS - 1) + [grpc.StatusCode.UNAVAILABLE]
    assert codes == want
    health = await stub.Health(pb.HealthRequest())
    assert not health.ok and "broken forward" in health.status
