"""What speculative decoding is configured with."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.speculative.width_policy import WIDTH_POLICIES

MTP = "mtp"  # the drafter kind of the checkpoint's own MTP layer (``MTPDrafter.kind``)


@dataclass(frozen=True)
class SpeculationConfig:
    # dflash | dspark | dflash2 (random weights) or a checkpoint dir; None: plain decoding
    drafter: str | None = None
    width: int = 8  # K_max: target queries per verify round, anchor included
    width_policy: str = "fixed"  # fixed | paper | online
    # The MTP drafter's hot vocabulary (``model.hot_vocab``; SGLang's --speculative-token-map):
    # a file of token ids, most frequent first (``speculative.token_map``), and how many of its
    # first ids the draft steps score (None: all of them). A size without a map takes the ids
    # 0 .. N-1, which means something only for a model of random weights (bench runs).
    token_map: str | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.width_policy not in WIDTH_POLICIES:
            raise ValueError(
                f"unknown width policy {self.width_policy!r}; choose from {WIDTH_POLICIES}"
            )
        if self.width < 1:
            raise ValueError(f"the verification width must be at least 1, not {self.width}")
        if self.hot_vocab and self.drafter != MTP:
            raise ValueError(
                "--speculative-token-map and --draft-vocab-size apply to the MTP drafter "
                f"(--drafter mtp) only, not to {_named(self.drafter)}"
            )
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"--draft-vocab-size must be at least 1, not {self.draft_vocab_size}")

    @property
    def on(self) -> bool:
        return bool(self.drafter)

    @property
    def block(self) -> int:
        """Rows a verify round writes per request (1 without speculation)."""
        return self.width if self.on else 1

    @property
    def hot_vocab(self) -> bool:
        """Whether the MTP drafter's steps score a hot vocabulary."""
        return self.token_map is not None or self.draft_vocab_size is not None


def _named(drafter: str | None) -> str:
    return f"--drafter {drafter}" if drafter else "plain decoding (no --drafter)"
