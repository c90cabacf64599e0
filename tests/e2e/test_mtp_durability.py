"""End to end, real processes: ``dhisparse up --model DIR --drafter mtp`` over a tiny random
GLM-5 checkpoint with an appended MTP layer (``index_share_for_mtp_iteration`` on), a
tokenizer.json and GLM's chat template. The worker, speculating with the MTP layer, is
SIGKILLed mid-stream; ``up`` restarts it, the new process resumes the session (its MTP rows
and the carry included) from the host store without recomputing the prompt, and the stream
completes with exactly plain greedy decoding's text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dhisparse import metrics as names
from dhisparse.tokenizer import chat_formatter, load_tokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from tests import hf_tiny
from tests.e2e.test_durability import Stack, killer, stream_chat, up_stack
from tests.tokenizer.helpers import (
    GLM46_TEMPLATE,
    GLM_SPECIALS,
    glm_tokenizer_config,
    write_model_dir,
)

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about the weather in Paris tomorrow."}]
LONG = 160  # tokens: the kill lands well inside the stream


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("glm-mtp")
    target = hf_tiny.build(hf_tiny.glm_config(vocab_size=448, eos_token_id=[0, 1, 2]), seed=5)
    hf_tiny.save_hub_style(target, path)
    mtp = hf_tiny.mtp_layer(target, seed=6, tmp=tmp_path_factory.mktemp("glm-mtp-layer"))
    hf_tiny.append_mtp(path, mtp, index_share_for_mtp_iteration=True)
    write_model_dir(path, GLM_SPECIALS, glm_tokenizer_config(chat_template=GLM46_TEMPLATE))
    return path


@pytest.fixture
def stack(model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    env = {
        "DHISPARSE_WORKER_LEASE_TTL_S": "1.5",
        "DHISPARSE_GATEWAY_RESUME_DEADLINE_S": "60",
        "DHISPARSE_GATEWAY_HEALTH_INTERVAL_S": "0.25",
    }
    flags = ("--model", str(model_dir), "--kv-pool-mib", "128", "--max-model-len", "1024",
             "--mode", "hisparse", "--drafter", "mtp")  # fmt: skip
    with up_stack(tmp_path / "up.log", *flags, env=env) as st:
        yield st


def plain_greedy(path: Path, max_tokens: int) -> str:
    """The text plain greedy decoding gives for the chat, offline, without speculation."""
    tokenizer = load_tokenizer(path)
    prompt = chat_formatter(tokenizer, path).encode(MESSAGES, enable_thinking=False)
    engine = Engine(EngineConfig(model=str(path), kv_pool_mib=64))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (req,) = engine.generate([prompt], params)
    engine.close()
    return req.text.detok.text[: req.text.emitted]


def test_a_speculating_worker_killed_mid_stream_resumes_without_prompt_recompute(
    model_dir: Path, stack: Stack
) -> None:
    want = plain_greedy(model_dir, LONG)
    name = httpx.get(f"{stack.base}/v1/models").json()["data"][0]["id"]
    (first,) = stack.pids("worker-0")
    kill_once, killed = killer(first)
    extra = {"model": name, "messages": MESSAGES,
             "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    text, chunks = stream_chat(stack.base, LONG, kill_once, **extra)
    assert killed, "the stream ended before the kill"
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    assert text == want  # token for token plain greedy decoding's text
    assert len(stack.pids("worker-0")) == 2  # `up` restarted it
    assert stack.metric(stack.worker_metrics, "dhisparse:sessions_resumed_total") == 1
    # the new process computed no prompt: it resumed from host backups
    assert stack.metric(stack.worker_metrics, "dhisparse:prefill_tokens_computed_total") == 0
    # and it went on speculating with the MTP layer
    drafts = stack.metric(stack.worker_metrics, names.SPEC_DRAFTS + "_total")
    assert drafts is not None and drafts > 0, drafts
