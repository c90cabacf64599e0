"""``python -m bench acceptance``'s kinds: plain, the MTP layer, a drafter directory, and the MTP
layer over a token map's first N ids (``mtp+vocabN``)."""

from __future__ import annotations

import argparse

import pytest

from bench import acceptance
from bench.core import UsageError
from services.worker.speculative.config import SpeculationConfig


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    acceptance.add_arguments(ap)
    args = ap.parse_args(list(argv))
    args.drafters = args.drafters or f"{args.model}/drafters"
    return args


def test_each_kind_is_the_engines_speculation() -> None:
    args = _args()
    assert acceptance.speculation(args, None, 1) == SpeculationConfig(None, 1)
    assert acceptance.speculation(args, "mtp", 4) == SpeculationConfig("mtp", 4)
    assert acceptance.speculation(args, "dflash2", 4).drafter == (
        "models/glm-dsa-mini/drafters/dflash2"
    )
    shipped = "models/glm-dsa-mini/token_map.txt"
    assert acceptance.speculation(args, "mtp+vocab1024", 4) == SpeculationConfig(
        "mtp", 4, token_map=shipped, draft_vocab_size=1024
    )
    given = acceptance.speculation(_args("--token-map", "/tmp/m.pt"), "mtp+vocab8", 2)
    assert (given.token_map, given.draft_vocab_size) == ("/tmp/m.pt", 8)
    for bad in ("mtp+vocab", "mtp+vocab0", "mtp+vocabx"):
        with pytest.raises(UsageError):
            acceptance.speculation(args, bad, 4)
