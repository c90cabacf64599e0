"""A grammar through the worker's gRPC front: a bad spec is INVALID_ARGUMENT before anything
runs, a JSON schema gives a stream whose text parses and follows it."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from dhisparse.rpc import worker_pb2 as pb
from dhisparse.rpc import worker_pb2_grpc as pb_grpc
from services.worker.server import start_server
from services.worker.settings import WorkerSettings
from tests.worker.request.grammar_cases import SCHEMA

PROMPT = list(b"The sparse indexer picks rows; ")


@pytest.fixture
async def stub(port: int):
    settings = WorkerSettings(
        model="tiny-glm", port=port, metrics_port=0, worker_id="w0", kv_pool_mib=8, mode="resident"
    )
    server, engine = await start_server(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.WorkerStub(channel)
    finally:
        await channel.close()
        await server.stop(grace=None)
        engine.shutdown()


def sampling(kind: str, spec: str) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=1.0, seed=5, max_tokens=192, grammar=pb.Grammar(kind=kind, spec=spec)
    )


async def test_a_bad_grammar_is_an_invalid_argument(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        req = pb.GenerateRequest(
            request_id="bad", prompt_token_ids=PROMPT, sampling=sampling("json_schema", "{")
        )
        async for _ in stub.Generate(req):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "json_schema spec is not valid JSON" in err.value.details()


async def test_a_json_schema_stream_parses_and_follows_it(stub) -> None:
    req = pb.GenerateRequest(
        request_id="ok", prompt_token_ids=PROMPT,
        sampling=sampling("json_schema", json.dumps(SCHEMA)),
    )  # fmt: skip
    text, last = "", None
    async for resp in stub.Generate(req):
        text += resp.text
        last = resp
    assert last is not None and last.finish_reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(text), SCHEMA)
