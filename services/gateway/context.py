"""What every endpoint shares: settings, tokenizer and chat format, the checkpoint's generation
defaults, worker pool, metrics; and the questions they ask of them (which model is served,
what the limits are)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from dhisparse.family.generation import GenerationDefaults
from dhisparse.tokenizer import ChatFormatter, Tokenizer, chat_formatter
from services.gateway.errors import model_not_found, service_unavailable
from services.gateway.fanout import ChoiceStream, collect, start_choices
from services.gateway.generation import ChoiceResult, GenerationInput
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import SchemaLimits
from services.gateway.preprocess import Limits, template_roles
from services.gateway.settings import GatewaySettings
from services.gateway.worker_client import WorkerPool

log = logging.getLogger(__name__)


@dataclass
class GatewayContext:
    settings: GatewaySettings
    tokenizer: Tokenizer
    pool: WorkerPool
    metrics: GatewayMetrics
    formatter: ChatFormatter
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    chat_roles: tuple[str, ...] = ()  # what the chat format renders (``template_roles``)
    # the family's reply format (``dhisparse.tokenizer.reply``): reasoning and tool calls are
    # parsed in it; None: replies are plain text and tools are refused
    reply_style: str | None = None

    @classmethod
    def of(
        cls,
        settings: GatewaySettings,
        tokenizer: Tokenizer,
        pool: WorkerPool,
        metrics: GatewayMetrics,
        *,
        formatter: ChatFormatter | None = None,
        generation: GenerationDefaults | None = None,
        reply_style: str | None = None,
    ) -> GatewayContext:
        """``formatter``: by default the tokenizer's own template."""
        formatter = formatter or chat_formatter(tokenizer)
        return cls(
            settings,
            tokenizer,
            pool,
            metrics,
            formatter,
            generation or GenerationDefaults(),
            template_roles(formatter),
            reply_style,
        )

    def served_model_name(self) -> str:
        """The configured name, else the workers' model name, else the ``model`` setting (until
        a worker has answered)."""
        if self.settings.served_model_name:
            return self.settings.served_model_name
        info = self.pool.model_info()
        return info.model_name if info and info.model_name else self.settings.model

    def resolve_model(self, requested: str | None) -> str:
        """The served name for a request's ``model``: omitted means the served model; anything
        else must match it (404 otherwise)."""
        served = self.served_model_name()
        if requested and requested != served:
            raise model_not_found(requested)
        return served

    def limits(self) -> Limits:
        """The limits requests are validated against; 503 while no worker has told us its
        context length."""
        max_model_len = self.pool.max_model_len()
        info = self.pool.model_info()
        if max_model_len is None or info is None:
            raise service_unavailable("No worker is available yet", retry_after_s=1)
        return Limits(
            max_model_len=max_model_len,
            vocab_size=info.vocab_size or self.tokenizer.vocab_size,
            max_n=self.settings.max_n,
            max_logprobs=self.settings.max_logprobs,
            default_max_tokens=self.settings.default_max_tokens or self.generation.max_new_tokens,
            generation=self.generation,
        )

    def schema_limits(self) -> SchemaLimits:
        """What ``/openapi.json`` states of this server; the model's name and context length
        once a worker has told them."""
        info = self.pool.model_info()
        named = info is not None or bool(self.settings.served_model_name)
        return SchemaLimits(
            max_n=self.settings.max_n,
            max_logprobs=self.settings.max_logprobs,
            vocab_size=(info.vocab_size if info else 0) or self.tokenizer.vocab_size,
            roles=self.chat_roles,
            empty_text_prompt_ok=bool(self.tokenizer.encode_prompt("")),
            max_request_bytes=self.settings.max_request_bytes,
            api_key=bool(self.settings.api_key),
            served_model=self.served_model_name() if named else None,
            max_model_len=self.pool.max_model_len(),
            tool_calls=self.reply_style is not None,
        )

    async def start(
        self, inputs: Sequence[GenerationInput], model: str, arrival: float
    ) -> list[ChoiceStream]:
        """Starts the worker requests of one HTTP request; see ``fanout.start_choices``."""
        trackers = [self.metrics.track(model, arrival) for _ in inputs]
        return await start_choices(self.pool.generate, inputs, trackers)

    async def complete(
        self, inputs: Sequence[GenerationInput], model: str, arrival: float
    ) -> list[ChoiceResult]:
        """``start``, then every choice to its end (non-streaming responses)."""
        return await collect(await self.start(inputs, model, arrival))
