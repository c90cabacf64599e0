"""Gateway settings, read from the environment (prefix ``DHISPARSE_GATEWAY_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from dhisparse.paths import resolve_path


class GatewaySettings(BaseSettings):
    """Everything the gateway needs to start. ``DHISPARSE_GATEWAY_WORKERS`` takes a comma-separated
    list (``10.0.0.1:50051,10.0.0.2:50051``); CLI flags override the environment."""

    model_config = SettingsConfigDict(env_prefix="DHISPARSE_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["127.0.0.1:50051"])
    # A preset name (``tiny-glm``: the byte tokenizer) or the workers' model directory (its
    # tokenizer, chat template and generation defaults; see ``model_dir``).
    model: str = "models/glm-dsa-mini"
    # The name clients send as ``model``; by default the model name the workers report.
    served_model_name: str | None = None
    api_key: str | None = None
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1)
    # Used when a request gives no max_tokens; still capped by the context left after the prompt.
    default_max_tokens: int | None = Field(None, ge=1)
    max_n: int = Field(16, ge=1)
    # Largest top-logprobs count per token, as vLLM's max_logprobs.
    max_logprobs: int = Field(20, ge=0)
    health_interval_s: float = Field(1.0, gt=0)
    # Health polls a worker may miss in a row before it counts as unhealthy.
    health_misses: int = Field(3, ge=1)
    # A worker that fails before the first token is retried on another one, at most this often.
    max_retries: int = Field(2, ge=0)
    # A worker that dies after the first token is waited for this long (it is restarted under
    # the same address and resumes durable sessions), then the client's stream is re-attached;
    # 0: the stream ends with an error at once.
    resume_deadline_s: float = Field(60.0, ge=0)
    # --- admission by memory (DESIGN §1) ---
    # The capacity ledger: a Redis URL (redis://[:password@]host:port/db) shared by every gateway
    # replica; "" keeps it in this process (a single replica only).
    redis_url: str = ""
    # Prefix of the ledger's Redis keys: gateways sharing a prefix share capacity. On a Redis
    # Cluster, give it a hash tag ("{dhisparse}:ledger") so that every key lands in one slot.
    ledger_prefix: str = "dhisparse:ledger"
    # Redis connections per gateway (past that, callers wait for one).
    redis_max_connections: int = Field(16, ge=1)
    # A lease not renewed for this long is reclaimed (its gateway died); renewed every third.
    lease_ttl_s: float = Field(10.0, gt=0)
    # Worker requests that may wait for capacity per model (0: none wait; 429 at once).
    max_queue: int = Field(256, ge=0)
    # How long a request may wait for capacity: one expected to wait longer is refused at once
    # (429 with Retry-After, ``queue_wait``); past it, a waiter gets a 503.
    queue_deadline_s: float = Field(30.0, gt=0)
    # How often the head of a queue retries (other replicas' releases are seen no sooner).
    admission_poll_s: float = Field(0.025, gt=0)
    # A worker that no gateway has seen healthy for this long has its leases released.
    worker_dead_after_s: float = Field(15.0, gt=0)
    # Rows per KV page on the workers (their --page-size), for the capacity model.
    kv_page_size: int = Field(16, ge=1)
    # --- prefix-affinity routing (``affinity``) ---
    # Send a request to a worker whose node likely holds its prompt's leading pages as a cached
    # prefix, weighed against load; off: the least-loaded worker. Each gateway remembers the
    # requests it routed, and with a Redis URL the other replicas' too (``affinity_feed``).
    prefix_affinity: bool = True
    # Share affinity records with the other replicas through the ledger's Redis (with a Redis
    # URL); off: each replica learns only from its own.
    prefix_affinity_shared: bool = True
    # Records the shared stream retains for a replica that starts (the newest).
    prefix_affinity_feed_entries: int = Field(4096, ge=1)
    # A predicted hit of the whole prompt outweighs up to this share of a worker's load (the
    # larger of its admitted KV share and its seats taken); 0: affinity breaks ties only.
    prefix_affinity_weight: float = Field(0.5, ge=0)
    # Leading pages of a prompt keyed for routing (prompts that agree this far route alike).
    prefix_affinity_max_pages: int = Field(2048, ge=1)
    # Pages the index remembers, least recently recorded forgotten first (about 190 B each).
    prefix_affinity_index_pages: int = Field(200_000, ge=1)
    log_level: str = "info"

    @field_validator("workers", mode="before")
    @classmethod
    def _split_workers(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [w.strip() for w in v.split(",")]
        if isinstance(v, list | tuple):
            v = [w for w in v if w]
            if not v:
                raise ValueError("at least one worker address is required")
            for w in v:
                host, _, port = str(w).rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"worker address {w!r} is not host:port")
        return v

    def model_dir(self) -> Path | None:
        """The model directory the gateway reads its tokenizer (tokenizer.json,
        tokenizer_config.json), chat template (its entry, or chat_template.jinja), model type
        (config.json) and generation defaults (generation_config.json) from: the workers' own,
        mounted here too. None (a preset, or a path that is no directory here): the built-in
        byte tokenizer and its template."""
        path = resolve_path(self.model)
        return path if path.is_dir() else None
