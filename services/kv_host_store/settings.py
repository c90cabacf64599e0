"""The store's settings, from the environment (``DHISPARSE_KV_STORE_*``) or CLI flags.

Sizes accept plain byte counts or human sizes: ``1073741824``, ``"1GiB"``, ``"512MiB"``
(binary units; ``"1GB"`` is decimal, 10**9).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, ByteSize, Field, TypeAdapter, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.kv_host_store.placement import PLACEMENTS, Placement

_BYTE_SIZE = TypeAdapter(ByteSize)


def parse_size(value: object) -> int:
    """Bytes in ``value``: an int, a digit string, or a human size such as ``"512MiB"``."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes, not a bool")
    return int(_BYTE_SIZE.validate_python(value))


Bytes = Annotated[int, BeforeValidator(parse_size)]


class KVHostStoreSettings(BaseSettings):
    """Where the store listens and how its arena is laid out."""

    model_config = SettingsConfigDict(env_prefix="DHISPARSE_KV_STORE_", frozen=True)

    host: str = Field("127.0.0.1", min_length=1, description="gRPC and metrics bind address")
    port: int = Field(50061, ge=0, le=65535, description="gRPC port (0: any free port)")
    metrics_port: int = Field(9102, ge=0, le=65535, description="Prometheus port (0: any)")
    arena_path: Path = Field(Path("/dev/shm/dhisparse-arena"), description="the arena file")
    capacity: Bytes = Field(1 << 30, gt=0, description="arena size in bytes")
    alignment: Bytes = Field(4096, gt=0, description="every region starts on this boundary")
    remove_arena_on_exit: bool = Field(True, description="unlink the arena file on shutdown")
    preallocate: bool = Field(False, description="reserve the arena's tmpfs pages at start")
    shutdown_grace_s: float = Field(5.0, ge=0, description="time in-flight RPCs get to finish")
    orphan_ttl_s: float = Field(
        300.0, ge=0, description="a dead owner's unadopted requests are freed after this long"
    )
    sweep_interval_s: float = Field(1.0, gt=0, description="how often orphans are looked for")
    placement_policy: str = Field(
        "packed", description=f"where new regions go: {', '.join(PLACEMENTS)} (placement.py)"
    )
    placement_extent: Bytes = Field(
        256 << 20, gt=0, description="grouped placement: the bytes of one group's extent"
    )

    def placement(self) -> Placement:
        """The arena's placement policy (``placement.py``)."""
        return Placement(self.placement_policy, self.placement_extent)

    @model_validator(mode="after")
    def _check_layout(self) -> KVHostStoreSettings:
        a = self.alignment
        if a & (a - 1):
            raise ValueError(f"alignment must be a power of two, got {a}")
        if self.capacity % a:
            raise ValueError(f"capacity {self.capacity} must be a multiple of alignment {a}")
        self.placement()  # an unknown policy fails here
        return self
