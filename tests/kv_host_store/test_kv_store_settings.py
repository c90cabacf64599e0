from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.kv_host_store.cli import add_arguments, settings_from_args
from services.kv_host_store.settings import KVHostStoreSettings, parse_size


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOST", "PORT", "METRICS_PORT", "ARENA_PATH", "CAPACITY", "ALIGNMENT"):
        monkeypatch.delenv(f"DHISPARSE_KV_STORE_{name}", raising=False)
    s = KVHostStoreSettings()
    assert (s.host, s.port, s.metrics_port) == ("127.0.0.1", 50061, 9102)
    assert s.arena_path == Path("/dev/shm/dhisparse-arena")
    assert (s.capacity, s.alignment, s.remove_arena_on_exit) == (1 << 30, 4096, True)


@pytest.mark.parametrize(
    ("text", "size"),
    [("1GiB", 1 << 30), ("512MiB", 512 << 20), ("4 KiB", 4096), ("8192", 8192), (65536, 65536)],
)
def test_human_sizes(text: str | int, size: int) -> None:
    assert parse_size(text) == size


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DHISPARSE_KV_STORE_CAPACITY", "512MiB")
    monkeypatch.setenv("DHISPARSE_KV_STORE_PORT", "6000")
    monkeypatch.setenv("DHISPARSE_KV_STORE_REMOVE_ARENA_ON_EXIT", "false")
    s = settings_from_args(parse())
    assert (s.capacity, s.port, s.remove_arena_on_exit) == (512 << 20, 6000, False)
    s = settings_from_args(parse("--capacity", "2GiB", "--port", "7000", "--remove-arena-on-exit"))
    assert (s.capacity, s.port, s.remove_arena_on_exit) == (2 << 30, 7000, True)
    s = settings_from_args(parse("--arena-path", "/dev/shm/x", "--alignment", "64KiB"))
    assert (s.arena_path, s.alignment, s.capacity) == (Path("/dev/shm/x"), 65536, 512 << 20)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": "1000"},  # not a multiple of the alignment
        {"alignment": 3000},  # not a power of two
        {"capacity": 0},
        {"capacity": "lots"},
        {"port": 70000},
        {"host": ""},
    ],
)
def test_invalid_settings(kwargs: dict) -> None:
    with pytest.raises(ValidationError):
        KVHostStoreSettings(**kwargs)


def test_cli_reports_invalid_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from services.kv_host_store.cli import main

    assert main(parse("--capacity", "1000")) == 2
    assert "multiple of alignment" in capsys.readouterr().err
