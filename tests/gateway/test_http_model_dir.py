"""A gateway given a Hugging Face model directory (``--model DIR``) takes its tokenizer, chat
format and generation defaults from it. The directories hold byte-level tokenizers whose ids
fit the real worker's tiny-glm vocabulary (256 bytes and 8 specials)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from dhisparse.family.generation import GenerationDefaults
from dhisparse.tokenizer import DeepseekV4Formatter, DeepseekV32Formatter, TemplateFormatter
from services.gateway import GatewaySettings, create_app
from tests.tokenizer.helpers import (
    DSV4_SPECIALS,
    DSV32_SPECIALS,
    dsv32_tokenizer_config,
    train_tokenizer,
)

from .conftest import WorkerProcess, gateway_client

SPECIALS = ("<|endoftext|>", "[gMASK]", "<|system|>", "<|user|>", "<|assistant|>", "</think>")
TEMPLATE = (
    "[gMASK]{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' ~ m.role) }}{% endif %}"
    "<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if reasoning_effort is defined and reasoning_effort not in ['high', 'max'] %}"
    "{{ raise_exception('reasoning_effort must be high or max') }}{% endif %}"
    "{% if count is defined %}{{ 1 + count }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}</think>{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Say hello."}]


def _write(path: Path, specials: tuple[str, ...], files: dict[str, Any]) -> Path:
    path.mkdir()
    train_tokenizer(specials, vocab_size=256 + len(specials)).save(str(path / "tokenizer.json"))
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, ensure_ascii=False))
    return path


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(
        tmp_path_factory.mktemp("models") / "glm",
        SPECIALS,
        {
            "tokenizer_config.json": {"eos_token": "<|endoftext|>", "chat_template": TEMPLATE},
            "config.json": {"model_type": "glm_moe_dsa", "eos_token_id": [0, 5]},
            "generation_config.json": {
                "eos_token_id": [0, 5],
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.9,
                "max_new_tokens": 3,
            },
        },
    )


@pytest.fixture(scope="module")
def dsv32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(
        tmp_path_factory.mktemp("models") / "dsv32",
        DSV32_SPECIALS,
        {
            "tokenizer_config.json": dsv32_tokenizer_config(),
            "config.json": {"model_type": "deepseek_v32", "eos_token_id": 1},
        },
    )


@pytest.fixture(scope="module")
def dsv4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(
        tmp_path_factory.mktemp("models") / "dsv4",
        DSV4_SPECIALS,
        {
            "tokenizer_config.json": dsv32_tokenizer_config(),
            "config.json": {"model_type": "deepseek_v4", "eos_token_id": 1},
        },
    )


def _gateway(worker: WorkerProcess, model_dir: Path) -> Any:
    settings = GatewaySettings(workers=[worker.address], model=str(model_dir), health_interval_s=1)
    app = create_app(settings)
    return app, gateway_client(app)


async def _chat(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})


async def test_template_and_generation_defaults_come_from_the_directory(
    worker: WorkerProcess, glm_dir: Path
) -> None:
    app, gateway = _gateway(worker, glm_dir)
    async with gateway as client:
        ctx = app.state.ctx
        assert isinstance(ctx.formatter, TemplateFormatter)
        assert ctx.generation == GenerationDefaults.read(glm_dir)
        assert (ctx.limits().generation.temperature, ctx.limits().default_max_tokens) == (0.7, 3)
        r = await _chat(client, ignore_eos=True)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        expected = ctx.formatter.encode(MESSAGES)
        # [gMASK], <|user|>, a token per byte of the text, <|assistant|>
        assert usage["prompt_tokens"] == len(expected) == 1 + 1 + len("Say hello.") + 1
        assert usage["completion_tokens"] == 3  # generation_config's max_new_tokens
        r = await _chat(client, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
        assert r.json()["usage"]["prompt_tokens"] == len(expected) + 1  # </think>
        roles = (await client.get("/openapi.json")).json()["components"]["schemas"]
        assert roles["ChatMessage"]["properties"]["role"]["enum"] == ["system", "user", "assistant"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{"role": "ipython", "content": "x"}]}, "unsupported role: ipython"),
        ({"chat_template_kwargs": {"reasoning_effort": "low"}}, "reasoning_effort must be high"),
        ({"chat_template_kwargs": {"count": "x"}}, "TypeError"),
        ({"chat_template_kwargs": {"documents": "not a list"}}, "documents must be a list"),
    ],
    ids=["role", "raise_exception", "python-error", "documents"],
)
async def test_what_the_template_refuses_is_a_400(
    worker: WorkerProcess, glm_dir: Path, body: dict[str, Any], message: str
) -> None:
    _, gateway = _gateway(worker, glm_dir)
    async with gateway as client:
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert message in error["message"]
        assert (error["type"], error["param"], error["code"]) == (
            "BadRequestError",
            "messages",
            400,
        )


async def test_deepseek_v32_directory_uses_its_encoder(
    worker: WorkerProcess, dsv32_dir: Path
) -> None:
    app, gateway = _gateway(worker, dsv32_dir)
    async with gateway as client:
        assert isinstance(app.state.ctx.formatter, DeepseekV32Formatter)
        off = await _chat(client, max_tokens=1)
        on = await _chat(client, max_tokens=1, chat_template_kwargs={"thinking": True})
        assert off.status_code == on.status_code == 200, (off.text, on.text)
        # <｜User｜>Say hello.<｜Assistant｜> then </think> or <think>: one token each.
        assert off.json()["usage"]["prompt_tokens"] == on.json()["usage"]["prompt_tokens"] == 14
        schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
        roles = schemas["ChatMessage"]["properties"]["role"]["enum"]
        assert roles == ["system", "developer", "user", "assistant"]
        bad = await _chat(client, chat_template_kwargs={"thinking": "sure"})
        assert bad.status_code == 400 and "thinking must be true or false" in bad.text


async def test_deepseek_v4_directory_uses_its_encoder_and_reply_style(
    worker: WorkerProcess, dsv4_dir: Path
) -> None:
    app, gateway = _gateway(worker, dsv4_dir)
    async with gateway as client:
        assert isinstance(app.state.ctx.formatter, DeepseekV4Formatter)
        assert app.state.ctx.reply_style == "deepseek_v4"
        on = await _chat(client, max_tokens=1)
        off = await _chat(client, max_tokens=1, reasoning_effort="none")
        assert off.status_code == on.status_code == 200, (off.text, on.text)
        # <｜User｜>Say hello.<｜Assistant｜> then <think> (V4 thinks by default) or </think>.
        assert off.json()["usage"]["prompt_tokens"] == on.json()["usage"]["prompt_tokens"] == 14
        schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
        roles = schemas["ChatMessage"]["properties"]["role"]["enum"]
        assert roles == ["system", "developer", "user", "assistant", "tool"]
        bad = await _chat(client, chat_template_kwargs={"reasoning_effort": "extreme"})
        assert bad.status_code == 400 and "reasoning_effort must be one of" in bad.text


async def test_a_raw_prompt_gets_the_special_tokens_of_the_checkpoints_rule(
    worker: WorkerProcess, dsv32_dir: Path
) -> None:
    """DeepSeek-V3.2's tokenizer_config names a BOS and says ``add_bos_token: false``, and this
    tokenizer.json has no post-processor: transformers adds nothing to a raw prompt, nor does
    ``/v1/completions``."""
    from transformers import AutoTokenizer

    prompt = "Say hello."
    want = AutoTokenizer.from_pretrained(dsv32_dir)(prompt)["input_ids"]
    _, gateway = _gateway(worker, dsv32_dir)
    async with gateway as client:
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want) == len(prompt.encode())
