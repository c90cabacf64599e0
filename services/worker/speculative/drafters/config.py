"""A drafter's configuration: architecture, block and window, conditioning layers."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from dhisparse.family.config import ModelConfig

KINDS = ("dflash", "dspark", "dflash2")


@dataclass(frozen=True)
class DrafterConfig:
    kind: str  # dflash | dspark | dflash2
    target: str  # the target model's config name (checked when loading)
    vocab_size: int  # the target's: the drafter borrows its embeddings and lm_head
    d_model: int  # the target's
    mask_token_id: int  # fills the block after its anchor
    target_layers: tuple[int, ...]  # target layers whose outputs condition the drafter
    n_layers: int = 2
    n_heads: int = 4
    head_dim: int = 32
    d_ff: int = 256
    block_size: int = 8  # K_max: target queries per round, anchor included
    window: int = 256  # W: committed positions the drafter reads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    markov_rank: int = 32  # DSpark: rank of the bigram logit bias W2·W1[x]
    num_candidates: int = 8  # DFlash2: C candidates kept per slot
    selector_rank: int = 32  # DFlash2: rank of the transition score

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown drafter {self.kind!r}; choose from {KINDS}")
        if self.block_size < 2:
            raise ValueError("a block needs an anchor and at least one proposal (K_max >= 2)")
        if self.window < 1:
            raise ValueError("the draft window must be >= 1")
        if not self.target_layers:
            raise ValueError("a drafter needs at least one target layer")
        if not 1 <= self.num_candidates <= self.vocab_size:
            raise ValueError("num_candidates must be in [1, vocab_size]")

    @staticmethod
    def for_target(target: ModelConfig, kind: str, **overrides) -> DrafterConfig:
        """A drafter sized for ``target``: its width and vocabulary, conditioned on layers
        spread shallow to deep (as DFlash's [1, 9, 17, 25, 33] for 36 layers)."""
        if target.mask_token_id is None:
            raise ValueError(f"target {target.name!r} defines no mask token")
        cfg = DrafterConfig(
            kind=kind,
            target=target.name,
            vocab_size=target.vocab_size,
            d_model=target.d_model,
            mask_token_id=target.mask_token_id,
            target_layers=spread_layers(target.n_layers, 3),
        )
        cfg = replace(cfg, **overrides)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown drafter config fields: {sorted(unknown)}")
        cfg = cls(**{**d, "target_layers": tuple(d["target_layers"])})
        cfg.validate()
        return cfg

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DrafterConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


def spread_layers(n_layers: int, count: int) -> tuple[int, ...]:
    """``count`` target layers from the second to the second-to-last, evenly spaced."""
    lo, hi = min(1, n_layers - 1), max(min(1, n_layers - 1), n_layers - 2)
    if count <= 1:
        return (hi,)
    picks = {round(lo + (hi - lo) * i / (count - 1)) for i in range(count)}
    return tuple(sorted(picks))
