"""End to end with a Hugging Face model directory: ``dhisparse up --model DIR`` over a tiny
random GLM-5 (``glm_moe_dsa``, IndexShare) checkpoint saved by transformers, with a
tokenizer.json, GLM's chat template and generation_config.json (three EOS ids). The gateway
renders the chat with the directory's template; the text equals offline generation on the
engine over the same prompt, and transformers' greedy continuation."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dhisparse.tokenizer import chat_formatter, load_tokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from tests import hf_tiny
from tests.conftest import free_port
from tests.e2e.test_stack import stop_stack, wait_serving
from tests.tokenizer.helpers import (
    GLM46_TEMPLATE,
    GLM_SPECIALS,
    glm_tokenizer_config,
    write_model_dir,
)

MESSAGES = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> tuple[object, Path]:
    path = tmp_path_factory.mktemp("glm-tiny")
    ref = hf_tiny.build(hf_tiny.glm_config(vocab_size=448, eos_token_id=[0, 1, 2]), seed=4)
    hf_tiny.save_hub_style(ref, path)
    write_model_dir(
        path, GLM_SPECIALS, glm_tokenizer_config(chat_template=GLM46_TEMPLATE),
        generation_config={"eos_token_id": [0, 1, 2], "temperature": 1.0, "top_p": 0.95},
    )  # fmt: skip
    return ref, path


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory) -> Iterator[str]:
    _, path = model_dir
    http, worker, store = free_port(), free_port(), free_port()
    arena = f"/dev/shm/dhisparse-e2e-hf-{os.getpid()}-{http}"
    log = tmp_path_factory.mktemp("stack") / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dhisparse.cli", "up", "--model", str(path), "--port", str(http),
             "--worker-port", str(worker), "--kv-store-port", str(store), "--arena-path", arena,
             "--kv-pool-mib", "128", "--drafter", "none", "--no-restart"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_serving(proc, log)
        yield f"http://127.0.0.1:{http}"
    finally:
        stop_stack(proc, log, arena)


def test_chat_over_http_equals_the_engine_and_transformers(model_dir, stack: str) -> None:
    ref, path = model_dir
    name = httpx.get(f"{stack}/v1/models").json()["data"][0]["id"]
    body = {"model": name, "messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    r = httpx.post(f"{stack}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    tokenizer = load_tokenizer(path)
    prompt = chat_formatter(tokenizer, path).encode(MESSAGES, enable_thinking=False)
    assert "<|assistant|>" in tokenizer.decode(prompt, skip_special_tokens=False)
    engine = Engine(EngineConfig(model=str(path), kv_pool_mib=64))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (req,) = engine.generate([prompt], params)
    engine.close()
    assert req.output_ids == hf_tiny.greedy_under_reference(ref, prompt, req.output_ids)
    assert text == req.text.detok.text[: req.text.emitted]
