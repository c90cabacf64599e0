"""The gateway's start-up check of its tokenizer against the workers' model: the shipped model's
embedding has spare rows past the tokenizer's ids by design (padding), which is no mismatch; a
tokenizer with ids the model cannot embed, or a model far larger than padding explains (another
model's tokenizer), is warned about. A gateway app over an in-process worker that reports the
vocabulary."""

from __future__ import annotations

import json
import logging

import pytest

from dhisparse.paths import resolve_path
from dhisparse.tokenizer import load_tokenizer
from services.gateway import GatewaySettings, create_app
from tests.gateway.conftest import gateway_client
from tests.gateway.test_worker_health import FlakyWorker, serving

SHIPPED = resolve_path("models/glm-dsa-mini")


async def _startup_warnings(
    caplog: pytest.LogCaptureFixture, model: str, model_vocab: int
) -> list[str]:
    """The gateway's warnings at start-up with tokenizer ``model`` before a worker whose model
    has ``model_vocab`` rows."""
    async with serving(FlakyWorker(vocab_size=model_vocab)) as address:
        settings = GatewaySettings(workers=[address], model=model, health_interval_s=60)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="services.gateway.app"):
            async with gateway_client(create_app(settings)):
                pass
    return [r.getMessage() for r in caplog.records if "vocab" in r.getMessage()]


async def test_the_shipped_models_padded_embedding_is_no_mismatch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rows = json.loads((SHIPPED / "config.json").read_text())["vocab_size"]
    assert load_tokenizer(SHIPPED).vocab_size < rows  # spare rows, by design
    assert await _startup_warnings(caplog, str(SHIPPED), rows) == []


async def test_ids_the_model_cannot_embed_are_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ids = load_tokenizer(SHIPPED).vocab_size
    (warning,) = await _startup_warnings(caplog, str(SHIPPED), ids - 1)
    assert f"tokenizer vocab {ids}" in warning and "no embedding" in warning


async def test_another_models_tokenizer_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """The byte tokenizer (a preset's) before the shipped model: far more rows than padding."""
    rows = json.loads((SHIPPED / "config.json").read_text())["vocab_size"]
    (warning,) = await _startup_warnings(caplog, "tiny-glm", rows)
    assert "is --model the same as the workers'" in warning
