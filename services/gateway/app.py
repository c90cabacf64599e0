"""The FastAPI app: routes, middleware, error handlers and the worker pool's lifetime."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from dhisparse.family.generation import GenerationDefaults
from dhisparse.family.presets import PRESETS
from dhisparse.tokenizer import chat_formatter, load_tokenizer
from dhisparse.tokenizer.hf_files import chat_family
from dhisparse.tokenizer.reply import reply_style
from services.gateway.admission import AdmissionConfig, MemoryAdmission
from services.gateway.affinity import AffinityConfig, PrefixAffinity, PrefixAffinityRouter
from services.gateway.affinity_feed import AffinityFeed
from services.gateway.chat import create_chat_completion
from services.gateway.completions import create_completion
from services.gateway.context import GatewayContext
from services.gateway.errors import install_error_handlers
from services.gateway.ledger import Ledger, LocalLedger
from services.gateway.metrics import GatewayMetrics
from services.gateway.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from services.gateway.openapi import (
    CHAT_RULES,
    COMPLETION_RULES,
    error_responses,
    generation_responses,
    install_openapi,
)
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    HealthResponse,
    ModelCard,
    ModelList,
)
from services.gateway.routing import Admission
from services.gateway.settings import GatewaySettings
from services.gateway.shared_pages import SharedPages
from services.gateway.sizing import SessionSizer
from services.gateway.streaming import ClientDisconnected
from services.gateway.worker_client import WorkerPool

log = logging.getLogger(__name__)

# nginx's "client closed request"; nobody reads it, but access logs show what happened.
_CLIENT_CLOSED = 499
# Embeddings are padded past the tokenizer's ids (for kernel and tensor-parallel alignment) by
# fewer rows than this; more spare rows mean a tokenizer of another model.
PADDING_ROWS = 1024


def vocab_mismatch(tokenizer_vocab: int, model_vocab: int) -> str | None:
    """Why the gateway's tokenizer does not fit the workers' model: ids past the model's
    embedding, or more spare rows than padding explains; None when it fits."""
    if tokenizer_vocab > model_vocab:
        return (
            f"tokenizer vocab {tokenizer_vocab} exceeds the model's {model_vocab}: ids past "
            f"{model_vocab - 1} have no embedding; is --model the same as the workers'?"
        )
    if model_vocab - tokenizer_vocab >= PADDING_ROWS:
        return (
            f"tokenizer vocab {tokenizer_vocab} is {model_vocab - tokenizer_vocab} short of the "
            f"model's {model_vocab}, more than padding explains: is --model the same as the "
            "workers'?"
        )
    return None


def ignored_fields(body: BaseModel) -> list[str]:
    """The fields of a request body the server does not read: unknown top-level fields and
    unknown fields of its messages (``messages[i].name``)."""
    out = sorted(body.model_extra or ())
    for i, m in enumerate(getattr(body, "messages", None) or ()):
        out += [f"messages[{i}].{k}" for k in sorted(m.model_extra or ())]
    return out


def _warn_ignored(body: BaseModel, endpoint: str, response: Response) -> Response:
    """Logs the fields the server ignores and names them in the response's ``Warning`` header
    (RFC 7234's code 299, "miscellaneous persistent warning")."""
    ignored = ignored_fields(body)
    if ignored:
        log.warning(
            "%s: the following fields were present in the request but ignored: %s",
            endpoint,
            ignored,
        )
        names = ", ".join(ignored).encode("ascii", "backslashreplace").decode()
        response.headers["Warning"] = f'299 dhisparse "ignored fields: {names}"'
    return response


def prefix_affinity(settings: GatewaySettings) -> PrefixAffinity | None:
    """The prefix-affinity index and policy of ``settings`` (None: ``prefix_affinity`` off)."""
    if not settings.prefix_affinity:
        return None
    return PrefixAffinity(
        AffinityConfig(
            weight=settings.prefix_affinity_weight,
            max_pages=settings.prefix_affinity_max_pages,
            index_pages=settings.prefix_affinity_index_pages,
            default_page_size=settings.kv_page_size,
        )
    )


def affinity_feed(
    settings: GatewaySettings, affinity: PrefixAffinity | None, count: Callable[[str], None]
) -> AffinityFeed | None:
    """The stream through which ``affinity``'s records reach the other replicas (None: no
    affinity, no Redis, or ``prefix_affinity_shared`` off); ``count``: told each record's
    outcome."""
    if affinity is None or not settings.redis_url or not settings.prefix_affinity_shared:
        return None
    feed = AffinityFeed(
        settings.redis_url, affinity.index, prefix=settings.ledger_prefix,
        max_entries=settings.prefix_affinity_feed_entries, count=count,
    )  # fmt: skip
    affinity.share = feed.publish
    return feed


def memory_admission(
    settings: GatewaySettings, metrics: GatewayMetrics, affinity: PrefixAffinity | None = None
) -> MemoryAdmission:
    """Admission by memory over the Redis ledger (``redis_url`` set) or an in-process one,
    ranking workers by ``affinity`` weighed against load (None: the least loaded)."""
    ledger: Ledger
    if settings.redis_url:
        from services.gateway.redis_ledger import RedisLedger

        ledger = RedisLedger(
            settings.redis_url,
            prefix=settings.ledger_prefix,
            max_connections=settings.redis_max_connections,
        )
    else:
        ledger = LocalLedger()
    config = AdmissionConfig(
        max_queue=settings.max_queue,
        queue_deadline_s=settings.queue_deadline_s,
        lease_ttl_s=settings.lease_ttl_s,
        poll_s=settings.admission_poll_s,
        worker_dead_after_s=settings.worker_dead_after_s,
    )
    sizer = SessionSizer(page_size=settings.kv_page_size)
    return MemoryAdmission(
        ledger,
        config,
        sizer=sizer,
        router=PrefixAffinityRouter(affinity) if affinity is not None else None,
        metrics=metrics,
        served_model_name=settings.served_model_name,
        shared_pages=SharedPages(affinity, sizer) if affinity is not None else None,
    )


def create_app(
    settings: GatewaySettings | None = None,
    *,
    admission: Admission | None = None,
) -> FastAPI:
    """The gateway app. The worker pool starts (first poll included) and stops with the app's
    lifespan; ``admission`` replaces admission by memory (``memory_admission``)."""
    settings = settings or GatewaySettings()
    model_dir = settings.model_dir()
    if model_dir is None and settings.model not in PRESETS:
        log.warning(
            "model %r is no directory here: using the byte tokenizer and its chat template, "
            "which fit only the byte-level models; give the gateway the workers' model "
            "directory (mount it into the gateway too)",
            settings.model,
        )
    tokenizer = load_tokenizer(model_dir)
    metrics = GatewayMetrics()
    affinity = prefix_affinity(settings)
    pool = WorkerPool(
        settings.workers,
        admission=admission or memory_admission(settings, metrics, affinity),
        poll_interval_s=settings.health_interval_s,
        health_misses=settings.health_misses,
        max_retries=settings.max_retries,
        resume_deadline_s=settings.resume_deadline_s,
        metrics=metrics,
        affinity=affinity,
    )
    ctx = GatewayContext.of(
        settings,
        tokenizer,
        pool,
        metrics,
        formatter=chat_formatter(tokenizer, model_dir),
        generation=GenerationDefaults.read(model_dir),
        reply_style=reply_style(chat_family(model_dir)),
    )
    created = int(time.time())

    feed_records = metrics.affinity_feed  # (``metrics`` names the scrape's route below)

    def count_record(outcome: str) -> None:
        feed_records.labels(ctx.served_model_name(), outcome).inc()

    feed = affinity_feed(settings, affinity, count_record)
    metrics.feed_shared = feed is not None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if feed is not None:
            await feed.start()
        await pool.start()
        info = pool.model_info()
        if info is None:
            log.warning("no worker answered yet (%s); polling", ", ".join(settings.workers))
        else:
            log.info("serving %s (max_model_len %d)", ctx.served_model_name(), info.max_model_len)
            mismatch = info.vocab_size and vocab_mismatch(tokenizer.vocab_size, info.vocab_size)
            if mismatch:
                log.warning("%s", mismatch)
        try:
            yield
        finally:
            await pool.close()
            if feed is not None:
                await feed.close()

    app = FastAPI(title="dhisparse gateway", lifespan=lifespan)
    app.state.ctx = ctx
    app.state.affinity_feed = feed
    install_error_handlers(app)
    install_openapi(app, ctx.schema_limits)
    # The last added runs first: auth, then the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)

    @app.post(
        "/v1/chat/completions",
        description=CHAT_RULES,
        responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk),
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        try:
            response = await create_chat_completion(body, request, ctx)
            return _warn_ignored(body, "chat/completions", response)
        except ClientDisconnected:
            return Response(status_code=_CLIENT_CLOSED)

    @app.post(
        "/v1/completions",
        description=COMPLETION_RULES,
        responses=generation_responses(CompletionResponse, CompletionResponse),
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        try:
            response = await create_completion(body, request, ctx)
            return _warn_ignored(body, "completions", response)
        except ClientDisconnected:
            return Response(status_code=_CLIENT_CLOSED)

    @app.get("/v1/models", responses=error_responses(401))
    async def models() -> ModelList:
        info = pool.model_info()
        card = ModelCard(
            id=ctx.served_model_name(),
            created=created,
            root=info.model_name if info else settings.model,
            max_model_len=pool.max_model_len(),
        )
        return ModelList(data=[card])

    @app.get(
        "/health",
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "No worker is healthy"}},
    )
    async def health() -> JSONResponse:
        """200 while at least one worker is healthy, else 503."""
        workers = {s.address: "healthy" if s.healthy else "unhealthy" for s in pool.statuses()}
        ok = pool.any_healthy
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "workers": workers},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)

    return app
