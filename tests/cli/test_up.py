"""`dhisparse up`'s flags for the workers: the default drafter follows the device."""

from __future__ import annotations

import argparse

import pytest

from dhisparse.up import DEFAULT_DRAFTER, _spec_flags, add_arguments


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_auto_drafter_speculates_on_a_cpu_and_not_on_a_gpu() -> None:
    """On a GPU plain decode steps replay as CUDA graphs and verify rounds do not yet, so the
    default there is plain decoding (DFlash measured at 0.42-0.47x plain on the H200)."""
    assert parse().drafter == "auto"
    cpu = _spec_flags(parse())
    assert cpu[:2] == ["--drafter", DEFAULT_DRAFTER] and "--spec-width" in cpu
    assert _spec_flags(parse("--device", "cuda")) == []


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_explicit_drafter_wins_on_any_device(device: str) -> None:
    flags = _spec_flags(parse("--device", device, "--drafter", "dspark", "--spec-width", "6"))
    assert flags == ["--drafter", "dspark", "--spec-width", "6", "--width-policy", "online"]
    assert _spec_flags(parse("--device", device, "--drafter", "none")) == []
