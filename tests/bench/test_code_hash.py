"""Provenance over code, not prose: a result recorded under ``code-ast-v1`` stays fresh when a
docstring or a comment of the code it ran is corrected or the code is reformatted, and goes
stale when code changes or a file it ran is moved; other files count by their bytes; results
recorded before the scheme are still compared by their git blob hashes; the hash is the same
under the Python versions of both machines."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from bench.core import digest, provenance
from bench.stale import check

MODULE = '''"""A module."""

import math


class Rows:
    """Rows of a page."""

    def count(self, n: int) -> int:
        """How many."""
        # one per row
        return math.ceil(n / 64)


def width(x):
    return f"{x:<{8}}"
'''


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    """A root with one measured module and a config, and a result recorded over both (as
    ``provenance.collect`` records it)."""
    root = tmp_path / "root"
    (root / "bench").mkdir(parents=True)
    (root / "bench" / "m.py").write_text(MODULE)
    (root / "models").mkdir()
    (root / "models" / "config.json").write_text('{"hidden_size": 64}\n')
    files = {p: provenance.measured_hash(root / p) for p in ("bench/m.py", "models/config.json")}
    result = root / "docs" / "results" / "r.json"
    result.parent.mkdir(parents=True)
    result.write_text(json.dumps({"provenance": {
        "commit": "a" * 40, "hash_scheme": provenance.HASH_SCHEME, "files": files, "inputs": {},
    }}))  # fmt: skip
    return root, result


def _edit(root: Path, old: str, new: str) -> None:
    f = root / "bench" / "m.py"
    text = f.read_text()
    assert old in text
    f.write_text(text.replace(old, new))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"""A module."""', '"""A module, its docstring corrected."""'),
        ('"""Rows of a page."""', '"""Rows of a page (class docstring)."""'),
        ('"""How many."""', '"""How many pages, rounded up."""'),
        ('"""How many."""\n', ""),  # a docstring removed
        ("# one per row", "# one page per 64 rows"),
        ("return math.ceil(n / 64)", "return math.ceil(\n            n / 64\n        )"),
        ("import math\n", "import math  # ceil\n\n\n"),
    ],
    ids=["module-doc", "class-doc", "function-doc", "doc-removed", "comment", "layout", "blank"],
)
def test_prose_and_layout_leave_a_result_fresh(tmp_path, old: str, new: str) -> None:
    root, result = _tree(tmp_path)
    _edit(root, old, new)
    assert check(result, root) is None


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("n / 64", "n / 128"),
        ("return math.ceil(n / 64)", "return math.floor(n / 64)"),
        ("def width(x):", "def width(y):"),
        ('f"{x:<{8}}"', 'f"{x:>{8}}"'),
        ('"""How many."""', '"""How many."""\n        n += 1'),
    ],
    ids=["constant", "call", "argument", "format-spec", "statement"],
)
def test_a_code_edit_makes_it_stale(tmp_path, old: str, new: str) -> None:
    root, result = _tree(tmp_path)
    _edit(root, old, new)
    found = check(result, root)
    assert found is not None and found.reasons == ("bench/m.py (code changed)",)


def test_a_moved_file_makes_it_stale(tmp_path) -> None:
    root, result = _tree(tmp_path)
    (root / "bench" / "m.py").rename(root / "bench" / "moved.py")
    found = check(result, root)
    assert found is not None and found.reasons == ("bench/m.py (code deleted)",)


def test_other_files_count_by_their_bytes(tmp_path) -> None:
    root, result = _tree(tmp_path)
    config = root / "models" / "config.json"
    assert provenance.measured_hash(config) == provenance.file_hash(config)
    config.write_text('{"hidden_size":  64}\n')  # the same JSON value, other bytes
    found = check(result, root)
    assert found is not None and found.reasons == ("models/config.json (code changed)",)


def test_results_without_a_scheme_keep_the_blob_hashes(tmp_path) -> None:
    root, result = _tree(tmp_path)
    files = {p: provenance.file_hash(root / p) for p in ("bench/m.py", "models/config.json")}
    result.write_text(json.dumps({"provenance": {"commit": "b" * 40, "files": files}}))
    assert check(result, root) is None
    _edit(root, "# one per row", "# a comment: bytes changed")
    found = check(result, root)
    assert found is not None and found.reasons == ("bench/m.py (code changed)",)


def test_an_unknown_scheme_is_stale(tmp_path) -> None:
    root, result = _tree(tmp_path)
    doc = json.loads(result.read_text())
    doc["provenance"]["hash_scheme"] = "code-ast-v9"
    result.write_text(json.dumps(doc))
    found = check(result, root)
    assert found is not None and "unknown hash scheme 'code-ast-v9'" in found.reasons[0]


def test_what_a_newer_parser_adds_empty_does_not_count() -> None:
    """3.12 gives functions an empty ``type_params`` and ends an f-string's format spec with an
    empty literal; 3.11 and 3.13 do not: the canonical form is the same."""
    tree = ast.parse(MODULE)
    plain = digest.canonical_ast(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            node.type_params = []
        if isinstance(node, ast.FormattedValue) and node.format_spec is not None:
            node.format_spec.values.append(ast.Constant(value=""))
    assert digest.canonical_ast(tree) == plain
    assert "type_params" not in plain


def test_source_that_does_not_parse_counts_by_its_bytes() -> None:
    broken = b"def f(:\n"
    assert digest.code_digest(broken) == digest.blob_hash(broken)
