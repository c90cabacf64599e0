"""Command-line flags shared by the services' parsers."""

from __future__ import annotations

import argparse


def add_switch(parser: argparse.ArgumentParser, flag: str, help_text: str) -> None:
    """``--flag`` / ``--no-flag``; absent, the value is None, so the setting from the
    environment (or its default) stands."""
    parser.add_argument(
        f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help=help_text
    )
