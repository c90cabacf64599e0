"""The README's examples, run as written against a real stack started the way ``make run``
starts it (``dhisparse up`` with its defaults, on free ports): every ``curl`` block by bash,
every ``openai`` block by Python, the offline ``generate`` block from the repository root. Each
must answer sensibly, and what the README says they print is what they print."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.test_durability import Stack, up_stack

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOC_ADDRESS = "127.0.0.1:8000"  # where the README's examples expect `make run`
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Example:
    lang: str  # bash | python
    code: str
    line: int  # where the block starts in README.md

    @property
    def id(self) -> str:
        return f"{self.lang}@L{self.line}"


def examples() -> list[Example]:
    """The fenced blocks that talk to the stack or the engine: curl, the openai client and
    ``dhisparse generate``."""
    text = README.read_text()
    found = []
    for match in FENCE.finditer(text):
        lang, code = match.group(1), match.group(2)
        line = text.count("\n", 0, match.start()) + 1
        if (lang == "bash" and ("curl " in code or "dhisparse generate" in code)) or (
            lang == "python" and "from openai import" in code
        ):
            found.append(Example(lang, code, line))
    return found


EXAMPLES = examples()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack with `make run`'s defaults for every example."""
    with up_stack(tmp_path_factory.mktemp("readme") / "up.log") as st:
        yield st


def run(example: Example, stack: Stack) -> str:
    """The example's standard output, its address swapped for the test stack's."""
    code = example.code.replace(f"http://{DOC_ADDRESS}", stack.base)
    argv = ["bash", "-euo", "pipefail", "-c", code]
    if example.lang == "python":
        argv = [sys.executable, "-c", code]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, f"README.md line {example.line}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def documented_outputs(example: Example) -> list[str]:
    """What the block's comments say it prints: ``# ... "text": "..."`` (a JSON string) or
    ``print(...)  # '...'`` (a Python repr)."""
    out = [
        json.loads(s)
        for s in re.findall(r'^# \.\.\. "text": ("(?:[^"\\]|\\.)*")', example.code, re.M)
    ]
    out += [ast.literal_eval(s) for s in re.findall(r"^print\(.*\)  # ('.*')$", example.code, re.M)]
    return out


def sse_content(stdout: str) -> str:
    """The text of a streamed chat completion (``data:`` lines of deltas)."""
    text = ""
    for line in stdout.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
    return text


def test_the_readme_has_the_examples() -> None:
    kinds = [(e.lang, "chat" in e.code, "completions" in e.code) for e in EXAMPLES]
    assert ("bash", False, True) in kinds  # curl, code completion: the first example
    assert EXAMPLES[0].lang == "bash" and "/v1/completions" in EXAMPLES[0].code
    assert "def fibonacci" in EXAMPLES[0].code
    assert ("python", False, True) in kinds  # openai, completion
    assert ("bash", True, True) in kinds and ("python", True, True) in kinds  # chat
    # Both completion examples say what they print (checked against what they do print).
    assert [len(documented_outputs(e)) for e in EXAMPLES[:2]] == [1, 1]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.id)
def test_readme_example_answers_sensibly(example: Example, stack: Stack) -> None:
    out = run(example, stack)
    where = f"README.md line {example.line}"
    if "dhisparse generate" in example.code:
        results = [json.loads(line) for line in out.splitlines()]  # one JSON line a prompt
        assert [r["prompt"] for r in results] == ["def f(x):", "import os"], out
        assert all(r["text"] and r["finish_reason"] == "length" for r in results), out
        return
    if example.lang == "bash" and '"stream": true' in example.code:
        assert sse_content(out).strip(), f"{where}: empty chat stream\n{out}"
        return
    if example.lang == "bash":
        body = json.loads(out)
        choice = body["choices"][0]
        text = choice.get("text") or choice.get("message", {}).get("content")
        assert text, f"{where}: {out}"
        if "def fibonacci" in example.code:
            assert "if not isinstance(n, int):" in text, text
    else:
        assert out.strip(), f"{where}: printed nothing"
    for want in documented_outputs(example):
        got = out if example.lang == "python" else json.loads(out)["choices"][0]["text"]
        assert got.removesuffix("\n") == want, f"{where}: the README says {want!r}"


def test_chat_gives_what_the_readme_says(stack: Stack) -> None:
    """The prose says what "Hello!" gets from this code model; the chat examples print it."""
    (chat,) = [e for e in EXAMPLES if e.lang == "bash" and "/v1/chat/completions" in e.code]
    said = re.search(r'"Hello!" gets ``(.+?)``', README.read_text())
    assert said is not None
    assert sse_content(run(chat, stack)).lstrip().startswith(said.group(1))


def test_the_command_up_prints_works(stack: Stack) -> None:
    """`dhisparse up` ends its start-up with a curl command to try; it runs as printed."""
    log = stack.log.read_text()
    banner = log[log.index("dhisparse is serving") : log.index("[up] Ctrl-C")]
    command = banner[banner.index("curl ") :]
    r = subprocess.run(["bash", "-c", command.strip()], capture_output=True, text=True,
                       timeout=60, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["choices"][0]["text"].strip(), r.stdout
