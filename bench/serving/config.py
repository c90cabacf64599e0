"""What a serving benchmark runs: the matrix of runs (mode × drafter × width schedule ×
concurrency × input length) and the closed-loop load each run applies. Plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass

MODES = ("resident", "hisparse", "adaptive")
DRAFTERS = ("off", "dflash", "dspark", "dflash2")  # off: no speculation
SCHEDULES = ("fixed", "paper", "online")  # the verification width policy (DESIGN §5)
CONCURRENCY = (1, 4, 16, 32, 64, 128, 256)
SPEC_CONCURRENCY = (4, 64)  # the default subset runs speculation only at these C ...
SPEC_MODES = ("adaptive",)  # ... and only in these modes


@dataclass(frozen=True)
class EngineKey:
    """What needs its own engine (or its own stack): the serving mode and the speculation."""

    mode: str
    drafter: str = "off"
    schedule: str = "fixed"  # meaningless without a drafter; kept "fixed" there

    @property
    def name(self) -> str:
        if self.drafter == "off":
            return self.mode
        return f"{self.mode}/{self.drafter}/{self.schedule}"


@dataclass(frozen=True)
class RunSpec:
    """One point of the matrix: an engine configuration under C closed-loop clients whose
    prompts all have ``input_len`` tokens."""

    key: EngineKey
    concurrency: int
    input_len: int

    @property
    def name(self) -> str:
        return f"{self.key.name}@C{self.concurrency}/in{self.input_len}"

    def as_dict(self) -> dict:
        return {**asdict(self.key), "concurrency": self.concurrency, "input_len": self.input_len}


@dataclass(frozen=True)
class Load:
    """The closed loop: each of C clients keeps exactly one request in flight and submits its
    next as soon as one finishes. Either ``requests_per_client`` requests each (the run ends
    when all are done; the window is the whole run), or for ``warmup_s + duration_s`` seconds
    (requests still in flight at the end are aborted; the window is the last ``duration_s``)."""

    output_len: int = 32
    temperature: float = 0.0  # 0: greedy; 1: sampling with a per-request seed
    requests_per_client: int | None = None
    duration_s: float | None = 5.0
    warmup_s: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.requests_per_client is None) == (self.duration_s is None):
            raise ValueError("give exactly one of requests_per_client and duration_s")
        if self.output_len < 1:
            raise ValueError("output_len must be >= 1")

    def request_seed(self, client: int, index: int) -> int | None:
        """Sampling seed of a client's index-th request (None when greedy): the same request
        samples the same way in every configuration."""
        if self.temperature == 0.0:
            return None
        return (self.seed * 1_000_003 + client * 10_007 + index) % (1 << 63)


def build_matrix(
    modes: list[str],
    drafters: list[str],
    schedules: list[str],
    concurrency: list[int],
    input_lens: list[int],
    *,
    full: bool = False,
    spec_modes: list[str] | None = None,
    spec_concurrency: list[int] | None = None,
) -> list[RunSpec]:
    """The runs, baselines first (so a run cut short by the time limit keeps them).

    ``full``: every combination. Otherwise the default subset: speculation off in every mode
    at every C, and each drafter × schedule only in those of ``spec_modes`` that are among
    ``modes``, at ``spec_concurrency`` (its own axis: ``concurrency`` does not filter it)."""
    for name, given, known in (
        ("mode", modes, MODES),
        ("drafter", drafters, DRAFTERS),
        ("schedule", schedules, SCHEDULES),
    ):
        bad = [x for x in given if x not in known]
        if bad:
            raise ValueError(f"unknown {name} {bad}; choose from {known}")
    keys: list[tuple[EngineKey, list[int]]] = []
    if "off" in drafters:
        keys += [(EngineKey(m), concurrency) for m in modes]
    spec = [d for d in drafters if d != "off"]
    spec_at = concurrency if full else (spec_concurrency or list(SPEC_CONCURRENCY))
    in_modes = modes if full else [m for m in (spec_modes or SPEC_MODES) if m in modes]
    if spec and not in_modes:
        raise ValueError("drafters given, but no spec mode is among the modes (see --spec-modes)")
    for m in in_modes:
        for d in spec:
            keys += [(EngineKey(m, d, s), spec_at) for s in schedules]
    return [RunSpec(k, c, n) for k, cs in keys for n in input_lens for c in cs]
