"""The layout comparison in docs/capacity.md (section "`dhisparse plan`, by example") and the
DeepSeek-V4-Flash plan (section "DeepSeek-V4 on 8 GPUs"), run as written from the repository
root: what each shows is what the command prints."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dhisparse.cli import main

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```\n(\$ dhisparse plan .*?)^```", re.S | re.M)


def test_the_documented_layout_example_prints_what_it_shows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = (ROOT / "docs" / "capacity.md").read_text()
    blocks = [b for b in FENCE.findall(doc) if "--layouts" in b]
    assert len(blocks) == 1
    command, shown = blocks[0].split("\nworkers of ", 1)
    argv = shlex.split(command.removeprefix("$ ").replace("\\\n", " "))
    assert argv[:2] == ["dhisparse", "plan"]
    monkeypatch.chdir(ROOT)  # the example's model path is relative to the repository root
    assert main(argv[1:]) == 0
    out = capsys.readouterr().out
    assert "workers of " + shown == out[out.index("workers of ") :]


@pytest.mark.parametrize("model", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_the_documented_v4_examples_print_what_they_show(
    model: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Section "DeepSeek-V4 on 8 GPUs": each model's whole output, as shown."""
    doc = (ROOT / "docs" / "capacity.md").read_text()
    blocks = [b for b in FENCE.findall(doc) if model in b.split("\n", 1)[0]]
    assert len(blocks) == 1
    command, shown = blocks[0].split("\ndhisparse plan: ", 1)
    argv = shlex.split(command.removeprefix("$ ").replace("\\\n", " "))
    monkeypatch.chdir(ROOT)
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out == "dhisparse plan: " + shown
