"""What speculative decoding is configured with."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.speculative.width_policy import WIDTH_POLICIES


@dataclass(frozen=True)
class SpeculationConfig:
    # dflash | dspark | dflash2 (random weights) or a checkpoint dir; None: plain decoding
    drafter: str | None = None
    width: int = 8  # K_max: target queries per verify round, anchor included
    width_policy: str = "fixed"  # fixed | paper | online

    def __post_init__(self) -> None:
        if self.width_policy not in WIDTH_POLICIES:
            raise ValueError(
                f"unknown width policy {self.width_policy!r}; choose from {WIDTH_POLICIES}"
            )
        if self.width < 1:
            raise ValueError(f"the verification width must be at least 1, not {self.width}")

    @property
    def on(self) -> bool:
        return bool(self.drafter)

    @property
    def block(self) -> int:
        """Rows a verify round writes per request (1 without speculation)."""
        return self.width if self.on else 1
