"""Digests of file contents for provenance: git's blob hash of bytes, and the hash of a Python
module's code without its docstrings, comments and layout, the same under Python 3.11 to 3.13
(``code_digest``). Pure functions of bytes; ``provenance`` hashes files with them."""

from __future__ import annotations

import ast
import hashlib


def blob_hash(data: bytes) -> str:
    """Git's object id of a blob with these bytes (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _fstring_parts(values: list[ast.expr]) -> list[object]:
    """An f-string's parts with its literal text merged and empty literals dropped: 3.12's
    parser ends a format spec with an empty literal that 3.11 and 3.13 do not write."""
    out: list[object] = []
    for v in values:
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            if out and isinstance(out[-1], str):
                out[-1] += v.value
            elif v.value:
                out.append(v.value)
        else:
            out.append(v)
    return out


def canonical_ast(node: object) -> str:
    """A syntax tree written out field by field: node types and values, no positions, and no
    field that is None or an empty list (those a newer Python adds, e.g. 3.12's
    ``type_params``, are empty in code that parses on the older one); f-strings by their parts
    (``_fstring_parts``)."""
    if isinstance(node, ast.JoinedStr):
        return f"JoinedStr({canonical_ast(_fstring_parts(node.values))})"
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            fields.append(f"{name}={canonical_ast(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(canonical_ast(v) for v in node) + "]"
    return repr(node)


def code_digest(source: bytes) -> str:
    """The SHA-256 of a module's code: its syntax tree without docstrings (the first
    statement of a module, class or function body when it is a string), comments and layout
    (``canonical_ast``). Source that does not parse is hashed by its bytes."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return blob_hash(source)
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = node.body[1:]
    return hashlib.sha256(canonical_ast(tree).encode()).hexdigest()
