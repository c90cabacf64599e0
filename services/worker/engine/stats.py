"""The engine's cumulative counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Cumulative counters, read by metrics and benchmarks."""

    prefill_tokens_computed: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0  # wall time in prefill passes (they end in a host sync)
    decode_s: float = 0.0  # wall time in decode steps
    decode_tokens: int = 0  # tokens emitted by decode steps
    sessions_resumed: int = 0  # adopted from a dead worker and continued without a prefill
    # (arrival, first token, finish, output tokens) of finished requests, drained by readers
    finished: list[tuple[float, float | None, float, int]] = field(default_factory=list)

    def drain_finished(self) -> list[tuple[float, float | None, float, int]]:
        out, self.finished = self.finished, []
        return out
